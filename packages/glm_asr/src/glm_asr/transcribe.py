"""python -m glm_asr.transcribe audio.wav [more files ...] [key=value ...]

Speech recognition with GLM-ASR on tilekernels. Each 30 s window of a file is one request
(its segment in srt/vtt/json); windows are encoded 8 at a time, so any length works.

    python -m glm_asr.transcribe talk.flac output_format=srt output_dir=subs
    python -m glm_asr.transcribe a.wav b.ogg model.path=/ckpt device=cpu
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator

import hydra
import numpy as np
from omegaconf import DictConfig

from gpt.checkpoint import CheckpointError, from_model_config
from gpt.device import exit_with_one_line_errors, pick_device
from gpt.tokenizer import load_tokenizer

from .features import AudioError, read_audio, windows
from .formats import FORMATS, render, write_atomic
from .model import GlmAsr

CONFIGS = Path(__file__).resolve().parents[4] / "configs" / "glm_asr"
ENCODER_BATCH = 8          # windows encoded together
_FILES: list[str] = []


class Transcriber:
    """One loaded model and tokenizer serving many files."""

    def __init__(self, directory: Path, device: str):
        self.model = GlmAsr.load(directory, device)
        self.tok = load_tokenizer(directory)
        pad = self.tok.token_to_id("<|pad|>")
        for name in ("<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"):
            if self.tok.token_to_id(name) is None:
                raise CheckpointError(f"tokenizer.json: special token {name} missing")
        if pad != self.model.config.audio_token_id:
            raise CheckpointError(f"tokenizer.json: <|pad|> is {pad} but config audio_token_id is "
                                  f"{self.model.config.audio_token_id}")

    def prompt_ids(self, n_audio: int, instruction: str) -> list[int]:
        text = (f"<|user|>\n<|begin_of_audio|>{'<|pad|>' * n_audio}<|end_of_audio|><|user|>\n"
                f"{instruction}<|assistant|>\n")
        return self.tok.encode(text, add_special_tokens=False).ids

    def transcribe(self, samples: np.ndarray, instruction: str, max_new_tokens: int, progress=None) -> list[dict]:
        segments = []
        wins = windows(samples, self.model.config.encoder.num_mel_bins, self.model.xp)
        for w, tokens in window_tokens(self.model, wins, lambda n: self.prompt_ids(n, instruction), max_new_tokens):
            text = self.tok.decode(tokens, skip_special_tokens=True)
            segments.append({"start": round(w.start_s, 3), "end": round(w.end_s, 3), "text": text.strip()})
            if progress:
                progress.update(w.end_s - w.start_s)
        return segments


def window_tokens(model: GlmAsr, wins: list, prompt_ids: Callable[[int], list[int]], max_new_tokens: int,
                  eos=None) -> Iterator[tuple]:
    """(window, generated token ids) for each window in order: windows encoded ENCODER_BATCH at
    a time, each one request of prompt_ids(audio tokens) decoded greedily."""
    for g in range(0, len(wins), ENCODER_BATCH):
        group = wins[g: g + ENCODER_BATCH]
        emb = model.encode(model.xp.stack([w.features for w in group]))
        for j, w in enumerate(group):
            yield w, model.greedy(prompt_ids(w.tokens), emb[j, : w.tokens], max_new_tokens, eos)


def run(cfg: DictConfig, files: list[str]) -> int:
    if cfg.output_format not in FORMATS:
        raise ValueError(f"output_format must be one of {', '.join(FORMATS)}, got {cfg.output_format!r}")
    if cfg.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not files:
        raise ValueError("no audio files given: python -m glm_asr.transcribe FILE [FILE ...]")
    asr = Transcriber(from_model_config(cfg.model), pick_device(cfg.device))
    failed = 0
    from tqdm import tqdm

    for f in files:
        try:
            samples = read_audio(f)
            with tqdm(total=round(len(samples) / 16000, 1), unit="s", desc=Path(f).name, file=sys.stderr,
                      disable=not sys.stderr.isatty(), leave=False) as bar:
                segments = asr.transcribe(samples, str(cfg.prompt), int(cfg.max_new_tokens), bar)
        except AudioError as e:
            print(f"error: {e}" if str(e).startswith(f) else f"error: {f}: {e}", file=sys.stderr)
            failed += 1
            continue
        text = render(cfg.output_format, f, segments)
        if cfg.output_dir:
            write_atomic(Path(cfg.output_dir) / f"{Path(f).stem}.{cfg.output_format}", text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
    return 1 if failed else 0


@hydra.main(version_base=None, config_path=str(CONFIGS), config_name="transcribe")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg, _FILES))


def main() -> None:
    """Positional audio paths first-class beside Hydra's key=value overrides."""
    args = sys.argv[1:]
    _FILES[:] = [a for a in args if "=" not in a and not a.startswith("-")]
    sys.argv = [sys.argv[0]] + [a for a in args if a not in _FILES]
    _hydra_main()


if __name__ == "__main__":
    main()
