"""python -m glm_asr.transcribe audio.wav [more files ...] [key=value ...]

Speech recognition with GLM-ASR on tilekernels. Each 30 s window of a file is one request
(its segment in srt/vtt/json); windows are encoded 8 at a time, so any length works.

    python -m glm_asr.transcribe talk.flac output_format=srt output_dir=subs
    python -m glm_asr.transcribe a.wav b.ogg model.path=/ckpt device=cpu
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tilekernels.runtime import from_model_config, pick_device
from tilekernels.runtime.cli import Int, OptStr, Str, config_dir, exit_with_one_line_errors, options, split_args

from .features import AudioError, read_audio
from .formats import FORMATS, output_names, render, write_atomic
from .pipeline import Transcriber

_FILES: list[str] = []


def run(cfg: DictConfig, files: list[str]) -> int:
    o = options(cfg, {"output_format": Str, "output_dir": OptStr, "max_new_tokens": Int, "prompt": Str,
                      "device": Str})
    fmt, out_dir = o["output_format"], o["output_dir"]
    if fmt not in FORMATS:
        raise ValueError(f"output_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if o["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {o['max_new_tokens']}")
    if not files:
        raise ValueError("no audio files given: python -m glm_asr.transcribe FILE [FILE ...]")
    if fmt in ("srt", "vtt") and len(files) > 1 and not out_dir:
        raise ValueError(f"output_format={fmt} with several files needs output_dir=DIR (one subtitle file each)")
    if out_dir and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"output_dir {out_dir}: exists and is not a directory")
    names = output_names(files, fmt)
    asr = Transcriber(from_model_config(cfg.model), pick_device(o["device"]))
    asr.check(o["prompt"], o["max_new_tokens"])
    failed = 0
    from tqdm import tqdm

    for f, name in zip(files, names):
        try:
            samples = read_audio(f)
            with tqdm(total=round(len(samples) / 16000, 1), unit="s", desc=Path(f).name, file=sys.stderr,
                      disable=not sys.stderr.isatty(), leave=False) as bar:
                segments = asr.transcribe(samples, o["prompt"], o["max_new_tokens"], bar)
        except AudioError as e:
            print(f"error: {e}" if str(e).startswith(f) else f"error: {f}: {e}", file=sys.stderr)
            failed += 1
            continue
        if out_dir:
            try:
                write_atomic(Path(out_dir) / name, render(fmt, f, segments))
            except OSError as e:
                print(f"error: {e}", file=sys.stderr)
                failed += 1
        else:       # several JSON documents on one stream: JSON Lines
            sys.stdout.write(render(fmt, f, segments, json_line=len(files) > 1))
            sys.stdout.flush()
    return 1 if failed else 0


@hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="transcribe")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg, _FILES))


def main() -> None:
    """Audio paths first-class beside Hydra's key=value overrides: an existing path is always an
    input (even named a=b.wav or -x.wav), and so is everything after '--'."""
    _FILES[:], rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0]] + rest
    _hydra_main()


if __name__ == "__main__":
    main()
