"""From audio samples to timed text segments: 30 s windows, encoded ENCODER_BATCH at a time,
each window one greedy request that the runtime's token loop decodes."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tilekernels.runtime import CheckpointError, ModelRunner, check_length, generate, load_tokenizer

from .audio import Audio
from .features import FRAMES, Window, audio_tokens, log_mel, stream_windows, valid_frames
from .vad import VadOptions, segment_audio, segments_from_probs, stream_probs
from .model import GlmAsr

ENCODER_BATCH = 8          # windows encoded together


def decode(runner: ModelRunner, ids: list[int], audio_embeds, max_new_tokens: int,
           ignore_eos: bool = False) -> list[int]:
    """The greedy continuation of one prompt whose audio placeholders take audio_embeds (n, C)."""
    x = runner.model.prompt_embeds(ids, audio_embeds)
    return generate(runner, [ids], max_new_tokens, embeds=[x], ignore_eos=ignore_eos)[0].tokens


def window_tokens(runner: ModelRunner, wins: Iterable, prompt_ids: Callable[[int], list[int]], max_new_tokens: int,
                  ignore_eos: bool = False) -> Iterator[tuple]:
    """(window, generated token ids) for each window in order; windows are taken from `wins` (a
    list or a stream) ENCODER_BATCH at a time."""
    model, wins = runner.model, iter(wins)
    while group := list(itertools.islice(wins, ENCODER_BATCH)):
        emb = model.encode(model.xp.stack([w.features for w in group]))
        for j, w in enumerate(group):
            yield w, decode(runner, prompt_ids(w.tokens), emb[j, : w.tokens], max_new_tokens, ignore_eos)


class Transcriber:
    """One loaded model, tokenizer and runner serving many files."""

    def __init__(self, directory: Path, device: str):
        self.model = GlmAsr.load(directory, device)
        self.runner = ModelRunner(self.model)
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

    def check(self, instruction: str, max_new_tokens: int) -> None:
        """Refuse max_new_tokens that a full window's prompt leaves no room for in the decoder's
        positions (before any file is read)."""
        check_length(self.model, len(self.prompt_ids(audio_tokens(FRAMES), instruction)), max_new_tokens)

    def transcribe(self, audio: Audio | np.ndarray, instruction: str, max_new_tokens: int, progress=None,
                   vad: VadOptions | None = None) -> list[dict]:
        """The segments ({start, end, text}, seconds in the file's time) of an opened input, read
        block by block (memory bounded by ENCODER_BATCH windows), or of 16 kHz mono samples: with
        vad, one per stretch of speech (silence is not decoded), else one per 30 s window."""
        segments = []
        n_mels, xp = self.model.config.encoder.num_mel_bins, self.model.xp
        if vad is not None:
            wins = speech_windows(audio, vad, n_mels, xp)
        else:
            blocks, offset = ([audio], 0.0) if isinstance(audio, np.ndarray) else (audio, audio.offset_s)
            wins = stream_windows(blocks, n_mels, xp, offset)
        prompt = lambda n: self.prompt_ids(n, instruction)      # noqa: E731
        for w, tokens in window_tokens(self.runner, wins, prompt, max_new_tokens):
            text = self.tok.decode(tokens, skip_special_tokens=True)
            segments.append({"start": round(w.start_s, 3), "end": round(w.end_s, 3), "text": text.strip()})
            if progress is not None:
                progress.update(w.end_s - w.start_s)
        return segments


def speech_windows(audio: Audio | np.ndarray, options: VadOptions, n_mels: int = 128, xp=np) -> Iterator[Window]:
    """A window for each segment of speech Silero VAD finds: its padded audio as the features, its
    unpadded speech bounds as the times (in the file's time). Two passes over a file (the
    probabilities, then the segments' audio), each holding a block at a time."""
    if isinstance(audio, np.ndarray):
        first, again, offset = [audio], (lambda: [audio]), 0.0
    else:
        first, again, offset = audio, audio.reopen, audio.offset_s
    probs, n = stream_probs(first)
    for seg, x in segment_audio(again(), segments_from_probs(probs, n, options)):
        tokens = audio_tokens(valid_frames(len(x)))
        if tokens >= 1:
            yield Window(offset + seg.start_s, offset + seg.end_s, log_mel(x, n_mels, xp), tokens)
