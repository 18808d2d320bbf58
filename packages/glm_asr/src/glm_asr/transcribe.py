"""python -m glm_asr.transcribe audio.wav [more files ...] [key=value ...]

Speech recognition with GLM-ASR on tilekernels. Each speech segment of a file (vad=none: each
30 s window) is one request (its segment in srt/vtt/json); all files' segments decode together,
so any length and number works. With output_dir each file is written as soon as it is done.

    python -m glm_asr.transcribe talk.flac output_format=srt output_dir=subs
    python -m glm_asr.transcribe a.wav b.ogg model.path=/ckpt device=cpu
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tilekernels.runtime import from_model_config, pick_device
from tilekernels.runtime.cli import (Bool, Device, Float, Int, OptFloat, OptInt, OptStr, Precision, Str, config_dir,
                                     exit_with_one_line_errors, options, profile_at_exit, run_hydra, split_args)
from tilekernels.runtime.profile import mark

from .api import fallback_settings, load
from .audio import expand_inputs
from .formats import FORMATS, check_output_dir, output_names, render, write_atomic
from .pipeline import with_context
from .vad import start_workers

_FILES: list[str] = []
# the options of every glm_asr command (transcribe, bulk, serve: its requests' defaults)
MODEL_OPTIONS = {"max_new_tokens": Int(min=1), "prompt": Str, "context": OptStr, "device": Device,
                 "precision": Precision, "audio_stream": OptInt(min=0), "vad": Str(choices=("silero", "none")),
                 "max_batch": Int(min=1),
                 "compression_ratio_threshold": Float(gt=0), "logprob_threshold": OptFloat(max=0)}
# those transcribe and bulk share: the files written
SHARED_OPTIONS = {**MODEL_OPTIONS, "output_format": Str(choices=FORMATS), "output_dir": OptStr,
                  "encoder_batch": Int(min=1), "max_line_width": Int(min=1), "max_line_count": Int(min=1)}
TRANSCRIBE_OPTIONS = {**SHARED_OPTIONS, "profile": Bool}


def layout_options(o: dict) -> dict:
    """render's subtitle layout from the options: vad none's fixed windows, the line width and count."""
    return {"windows": o["vad"] == "none", "max_width": o["max_line_width"], "max_lines": o["max_line_count"]}


def run(cfg: DictConfig, args: list[str]) -> int:
    o = options(cfg, TRANSCRIBE_OPTIONS)
    o["prompt"] = with_context(o["prompt"], o["context"])
    profile_at_exit(o["profile"])
    mark("options read")
    fmt, out_dir = o["output_format"], o["output_dir"]
    if not args:
        raise ValueError("no audio files given: python -m glm_asr.transcribe FILE|DIR|-|'GLOB' [...]")
    if args.count("-") > 1:
        raise ValueError("standard input ('-') can be read once only")
    files, errors = expand_inputs(args, extensions(cfg.extensions))
    for e in errors:                                # said before the model loads
        print(f"error: {e}", file=sys.stderr)
    if not files:
        return 1
    if fmt in ("srt", "vtt") and len(files) + len(errors) > 1 and not out_dir:
        raise ValueError(f"output_format={fmt} with several files needs output_dir=DIR (one subtitle file each)")
    if out_dir:
        check_output_dir(out_dir)
    names = output_names(files, fmt)
    vad = vad_options(cfg.get("vad_options"))         # checked before the model loads
    layout = layout_options(o)
    guard = loop_guard(cfg, o)
    device = pick_device(o["device"])
    if o["vad"] == "silero" and device == "cpu":
        start_workers()                               # the VAD's processes start while the model loads
    asr = load(str(from_model_config(cfg.model)), device, max_batch=o["max_batch"], encoder_batch=o["encoder_batch"],
               precision=o["precision"])
    asr.transcriber.check(o["prompt"], o["max_new_tokens"])
    mark("model loaded")
    failed, done, seconds, began = len(errors), 0, 0.0, time.perf_counter()
    from tqdm import tqdm

    with tqdm(unit="s", desc="audio", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False) as bar:
        results = asr.transcribe_many(files, prompt=o["prompt"], max_new_tokens=o["max_new_tokens"],
                                      audio_stream=o["audio_stream"], vad=o["vad"], vad_options=vad,
                                      progress=bar, in_order=not out_dir, **guard)
        named: dict[str, list[str]] = {}
        for f, name in zip(files, names):
            named.setdefault(f, []).append(name)
        for r in results:
            name = named[r.source].pop(0)
            if r.error:
                print(f"error: {r.error}", file=sys.stderr)
                failed += 1
                continue
            doc = r.to_dict()
            if out_dir:
                try:
                    write_atomic(Path(out_dir) / name, render(fmt, r.source, doc["segments"], **layout))
                except OSError as e:
                    print(f"error: {e}", file=sys.stderr)
                    failed += 1
                    continue
            else:       # several JSON documents on one stream: JSON Lines
                sys.stdout.write(render(fmt, r.source, doc["segments"], json_line=len(files) > 1, **layout))
                sys.stdout.flush()
            done, seconds = done + 1, seconds + r.seconds
            mark("first file written")
    wall = time.perf_counter() - began
    if done:
        print(f"{done} file{'s' * (done != 1)} transcribed, {seconds:.1f} s of audio in {wall:.1f} s: "
              f"{seconds / max(wall, 1e-9):.1f}x real time" + (f"; {failed} failed" if failed else ""),
              file=sys.stderr)
    return 1 if failed else 0


def loop_guard(cfg, o: dict) -> dict:
    """temperature and the thresholds as transcribe_many takes them, checked (fallback_settings)
    before the model loads."""
    guard = {"temperature": temperatures(cfg.get("temperature", 0.0)),
             "compression_ratio_threshold": o["compression_ratio_threshold"],
             "logprob_threshold": o["logprob_threshold"]}
    fallback_settings(**guard)
    return guard


def temperatures(value) -> list:
    """temperature=0.2 or temperature=[0,0.2,0.4] as a list of numbers (text that reads as one is
    taken as one; fallback_settings checks the values)."""
    from omegaconf import ListConfig

    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    out = []
    for v in items:
        try:
            out.append(v if isinstance(v, (int, float)) and not isinstance(v, bool) else float(str(v)))
        except ValueError:
            raise ValueError(f"temperature must be a number or a list of them, got {v!r}") from None
    return out


def vad_options(value) -> dict:
    """vad_options.* as plain values, each checked (VadOptions names the one that is wrong)."""
    from omegaconf import OmegaConf

    from .api import vad_settings
    from .vad import VadOptions

    o = OmegaConf.to_container(value) if OmegaConf.is_config(value) else {} if value is None else value
    if not isinstance(o, dict):
        raise ValueError(f"vad_options must be a group of settings (vad_options.threshold=0.6), got {o!r}")
    for k, v in o.items():          # every VadOptions field is a number; Hydra may hand over a string
        if k in VadOptions.__dataclass_fields__ and v is not None and not isinstance(v, bool):
            try:
                o[k] = float(v)
            except ValueError:
                raise ValueError(f"vad_options.{k} must be a number, got {v!r}") from None
    vad_settings("silero", o)
    return o


def extensions(value) -> list[str]:
    """extensions=[wav,mp4] (or one, extensions=wav): the file types a folder argument takes."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    out = [str(e).strip().lstrip(".").lower() for e in items if str(e).strip()]
    if not out:
        raise ValueError("extensions must name at least one file type, e.g. extensions=[wav,flac,mp4]")
    return out


@hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="transcribe")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg, _FILES))


def main() -> None:
    """Audio paths first-class beside Hydra's key=value overrides: an existing path is always an
    input (even named a=b.wav or -x.wav), so are '-' (standard input) and everything after '--'."""
    _FILES[:], rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0]] + rest
    run_hydra(_hydra_main)


if __name__ == "__main__":
    main()
