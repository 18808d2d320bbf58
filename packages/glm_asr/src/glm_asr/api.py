"""GLM-ASR from Python: load a model once, then transcribe files or samples.

    import glm_asr
    asr = glm_asr.load("zai-org/GLM-ASR-Nano-2512")    # a hub id or a local directory
    r = asr.transcribe("talk.m4a")                     # a path, or samples with sample_rate=...
    r.text, r.segments[0].start, r.segments[0].end, r.segments[0].text
    for r in asr.transcribe_many(paths): ...           # each file's result as it completes
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

import numpy as np

from tilekernels.runtime import CheckpointError, pick_device, resolve, using
from tilekernels.runtime.precision import DEFAULT as DEFAULT_PRECISION
from tilekernels.runtime.sampler import MAX_TEMPERATURE

from .audio import MIN_RATE, SAMPLE_RATE, Audio, AudioError, copy_to_file, stdin_to_file
from .pipeline import ENCODER_BATCH, MAX_BATCH, Fallback, Transcriber, with_context
from .subtitles import join_text
from .vad import VadOptions

COMPRESSION_RATIO_THRESHOLD = 2.4     # faster-whisper's: above it a segment's text is taken for a loop
LOGPROB_THRESHOLD = -1.0              # faster-whisper's: below it a segment's tokens are taken for guesses

HUB_ID = "zai-org/GLM-ASR-Nano-2512"
PROMPT = "Please transcribe this audio into text"


class ASRError(ValueError):
    """Bad input to the glm_asr package (a checkpoint or audio that cannot be read, an
    out-of-range value): the message is one line for the user."""


@dataclass
class Segment:
    start: float        # seconds, in the file's time
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)     # the decoded token ids
    temperature: float = 0.0            # the attempt kept (the loop guard's: fallback_settings)
    avg_logprob: float = 0.0            # the tokens' mean log-probability under the model, end token counted
    compression_ratio: float = 0.0      # text bytes / zlib-compressed bytes (Whisper's; loops compress well)
    no_speech_prob: float | None = None     # 1 - the VAD's mean speech probability (None: vad none)


@dataclass
class Transcript:
    """One input's result: its segments, their text joined, or the one-line error that stopped it
    (transcribe_many reports a bad input this way and goes on with the others)."""
    source: str
    segments: list[Segment] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0            # the input's duration

    @property
    def text(self) -> str:
        return join_text([asdict(s) for s in self.segments])

    def to_dict(self) -> dict:
        return {"file": self.source, "text": self.text, "segments": [asdict(s) for s in self.segments]}


@contextlib.contextmanager
def _one_line():
    try:
        yield
    except ASRError:
        raise
    except (CheckpointError, AudioError, ValueError, OSError) as e:
        raise ASRError(str(e)) from None


def load(model: str = HUB_ID, device: str = "auto", revision: str | None = None, max_batch: int = MAX_BATCH,
         encoder_batch: int = ENCODER_BATCH, precision: str = DEFAULT_PRECISION) -> "SpeechRecognizer":
    """A SpeechRecognizer (transcribe, transcribe_many): GLM-ASR from a hub id (through the HF
    cache) or a local checkpoint directory, on device 'auto' (the GPU when one works), 'gpu' or
    'cpu'. max_batch: the most windows decoding at once; encoder_batch: windows encoded
    together; precision (GPU): 'bf16', 'tf32' or 'fp32' (tilekernels.runtime.precision), kept
    by this model whatever other models or settings the process has. Raises ASRError (one line)
    for a checkpoint that cannot be found or read."""
    with _one_line(), using(precision):
        return SpeechRecognizer(Transcriber.load(resolve(str(model), revision), pick_device(device), max_batch,
                                            encoder_batch))


class SpeechRecognizer:
    """A loaded model; options are those of python -m glm_asr.transcribe."""

    def __init__(self, transcriber: Transcriber):
        self.transcriber = transcriber
        self.device = "cpu" if transcriber.model.xp is np else "gpu"

    def transcribe(self, audio: str | Path | bytes | BinaryIO | np.ndarray, sample_rate: int | None = None, *,
                   prompt: str = PROMPT, max_new_tokens: int = 500, audio_stream: int | None = None,
                   vad: str = "silero", vad_options: dict | VadOptions | None = None, progress=None,
                   temperature: float | Sequence[float] = 0.0,
                   compression_ratio_threshold: float = COMPRESSION_RATIO_THRESHOLD,
                   logprob_threshold: float | None = LOGPROB_THRESHOLD, context: str | None = None) -> Transcript:
        """The transcript of a file (a path, its bytes or a binary file object; any format the CLI
        reads; '-' is standard input) or of samples ((n,) or (n, channels) at sample_rate: mixed
        to mono, resampled to 16 kHz).
        vad='silero': one segment per stretch of speech, its times the speech's (silence is not
        decoded); 'none': fixed 30 s windows. vad_options: VadOptions or a dict of its fields.
        Raises ASRError for input that cannot be transcribed. progress: anything with
        update(seconds) (a tqdm bar), told the audio done window by window. temperature: one, or
        the loop guard's list (fallback_settings). prompt is the instruction; context: text the
        model reads after it (names, terms, what was said before: pipeline.with_context)."""
        with _one_line():
            prompt = with_context(prompt, context)
            self.transcriber.check(prompt, max_new_tokens)
            options = vad_settings(vad, vad_options)
            guard = fallback_settings(temperature, compression_ratio_threshold, logprob_threshold)
            if isinstance(audio, np.ndarray):
                return self._one("<samples>", lambda: _samples(audio, sample_rate), prompt, max_new_tokens, progress,
                                 options, guard)
            if sample_rate is not None:
                raise ValueError("sample_rate is for samples; a file carries its own")
            if isinstance(audio, (list, tuple)):
                raise ValueError("transcribe takes one input; transcribe_many takes several")
            in_memory = isinstance(audio, (bytes, bytearray, memoryview)) or hasattr(audio, "read")
            if not in_memory and not isinstance(audio, (str, os.PathLike)):
                raise ValueError(f"audio must be a path, bytes, a binary file object or samples (a numpy array), "
                                 f"got {type(audio).__name__}")
            name = (str(getattr(audio, "name", "<file>")) if hasattr(audio, "read") else "<bytes>") if in_memory \
                else os.fspath(audio)
            with tempfile.TemporaryDirectory(prefix="glm_asr.") as scratch:
                path = copy_to_file(scratch, audio) if in_memory else stdin_to_file(scratch) if name == "-" else name
                opened = Audio(path, audio_stream, name=name)
                return self._one(name, lambda: opened, prompt, max_new_tokens, progress, options, guard)

    def _one(self, name: str, opener, prompt: str, max_new_tokens: int, progress, vad, guard) -> Transcript:
        [(_, result, seconds)] = self.transcriber.transcribe_many([(name, opener)], prompt, max_new_tokens, progress, vad,
                                                                  fallback=guard)
        if isinstance(result, BaseException):
            raise result
        return Transcript(name, [Segment(**s) for s in result], seconds=seconds)

    def transcribe_many(self, inputs: Iterable[str | Path], *, prompt: str = PROMPT, max_new_tokens: int = 500,
                        audio_stream: int | None = None, vad: str = "silero",
                        vad_options: dict | VadOptions | None = None, progress=None,
                        ignore_eos: bool = False, temperature: float | Sequence[float] = 0.0,
                        compression_ratio_threshold: float = COMPRESSION_RATIO_THRESHOLD,
                        logprob_threshold: float | None = LOGPROB_THRESHOLD,
                        context: str | None = None, in_order: bool = True) -> Iterator[Transcript]:
        """transcribe of each input (a path; '-' is standard input), all through one pipeline
        (windows of different files decode together), each yielded once it and those before it are
        done (in_order False: once it is done, so a short file is not held behind a long one); an
        input that cannot be transcribed yields a Transcript with .error set, and the others go
        on. ignore_eos: decode max_new_tokens a window whatever comes (benchmarks: the same work
        every run). A live iterable may yield None for "nothing new yet": the work in flight goes
        on. Bad settings raise ASRError here, before the first result is asked for."""
        with _one_line():
            if isinstance(inputs, (str, bytes, os.PathLike)) or (isinstance(inputs, np.ndarray)
                                                                  and inputs.dtype.kind not in "UO"):
                raise ValueError("transcribe_many takes a list (or any iterable) of paths; transcribe takes one "
                                 "(samples too)")
            prompt = with_context(prompt, context)
            self.transcriber.check(prompt, max_new_tokens)
            options = vad_settings(vad, vad_options)
            guard = fallback_settings(temperature, compression_ratio_threshold, logprob_threshold)
        return self._many(inputs, prompt, max_new_tokens, audio_stream, options, progress, ignore_eos, in_order, guard)

    def _many(self, inputs, prompt, max_new_tokens, audio_stream, options, progress, ignore_eos, in_order,
              guard) -> Iterator[Transcript]:
        with contextlib.ExitStack() as stack:
            scratch: list[str] = []         # made for standard input's copy only

            def source(s):
                if s is None:
                    return None
                if not isinstance(s, (str, os.PathLike)):
                    wrong = ValueError(f"expected a file path, got {type(s).__name__}"
                                       + (" (samples go to transcribe)" if isinstance(s, np.ndarray) else ""))
                    return f"<{type(s).__name__}>", lambda: _raise(wrong)
                name = os.fspath(s)
                if name != "-":
                    return name, lambda: Audio(name, audio_stream, name=name)
                try:        # standard input copied here, in the caller's thread: Ctrl-C and SIGTERM stop it
                    scratch[:] = scratch or [stack.enter_context(tempfile.TemporaryDirectory(prefix="glm_asr."))]
                    path = stdin_to_file(scratch[0])
                except OSError as e:
                    failed = e
                    return name, lambda: _raise(failed)
                return name, lambda: Audio(path, audio_stream, name=name)

            sources = (source(s) for s in inputs)
            for name, result, seconds in self.transcriber.transcribe_many(sources, prompt, max_new_tokens, progress,
                                                                          options, ignore_eos, in_order,
                                                                          fallback=guard):
                if isinstance(result, Exception):       # this input's failure: the others go on
                    msg = str(result) if isinstance(result, (CheckpointError, AudioError, ValueError, OSError)) \
                        else f"{type(result).__name__}: {result}"
                    yield Transcript(name, error=msg if msg.startswith(name) else f"{name}: {msg}")
                elif isinstance(result, BaseException):
                    raise result
                else:
                    yield Transcript(name, [Segment(**s) for s in result], seconds=seconds)


def _raise(e: BaseException):
    raise e


def fallback_settings(temperature, compression_ratio_threshold: float = COMPRESSION_RATIO_THRESHOLD,
                      logprob_threshold: float | None = LOGPROB_THRESHOLD) -> Fallback:
    """The loop guard (pipeline.Fallback) of a temperature or a list of them (faster-whisper's
    default list: 0, 0.2, 0.4, 0.6, 0.8, 1.0): a segment whose text's compression ratio is above
    compression_ratio_threshold or whose tokens' mean log-probability is below logprob_threshold
    (None: not checked) is decoded again at the next temperature. One temperature: no guard."""
    temps = [temperature] if isinstance(temperature, str) or not hasattr(temperature, "__len__") \
        else list(temperature)
    if not temps:
        raise ValueError("temperature must be a number or a non-empty list of them")
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g} or a list of them, "
                             f"got {t!r}")
    r = compression_ratio_threshold
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
        raise ValueError(f"compression_ratio_threshold must be a finite number > 0, got {r!r}")
    lp = logprob_threshold
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, float)) or not -float("inf") < lp <= 0):
        raise ValueError(f"logprob_threshold must be a finite number <= 0 or None, got {lp!r}")
    return Fallback(tuple(float(t) for t in temps), float(r), None if lp is None else float(lp))


def vad_settings(vad: str, options) -> VadOptions | None:
    """VadOptions for vad='silero' (from a dict of its fields, or as given), None for 'none'."""
    if vad not in ("silero", "none"):
        raise ValueError(f"vad must be silero or none, got {vad!r}")
    if vad == "none":
        return None
    if isinstance(options, VadOptions):
        return options
    known = VadOptions.__dataclass_fields__
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        raise ValueError(f"vad_options: unknown option {unknown[0]!r} (known: {', '.join(known)})")
    return VadOptions(**(options or {}))


MAX_RATE = 768_000          # Hz: the highest rate audio hardware and files use


def _samples(x: np.ndarray, rate: int | None) -> np.ndarray:
    """(n,) or (n, channels) samples at `rate` as 16 kHz mono float32 (integer PCM scaled to
    [-1, 1), as soundfile reads it)."""
    if rate is None:
        raise ValueError("sample_rate is needed with samples")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"sample_rate must be an integer from {MIN_RATE} to {MAX_RATE} Hz, got {rate!r}")
    if x.ndim not in (1, 2) or x.size == 0:
        raise ValueError(f"samples must be (n,) or (n, channels), got shape {x.shape}")
    if x.ndim == 2 and x.shape[1] > x.shape[0]:
        raise ValueError(f"samples must be (n, channels), got shape {x.shape}: more channels than samples "
                         f"(channels first? pass samples.T)")
    if x.dtype.kind in "iu":
        x = (x.astype(np.float64) - (1 << (8 * x.itemsize - 1) if x.dtype.kind == "u" else 0)) \
            / (1 << (8 * x.itemsize - 1))
    elif x.dtype.kind != "f":
        raise ValueError(f"samples must be floating point or integer PCM, got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError("samples contain NaN or infinite values")
    mono = (x if x.ndim == 1 else x.mean(axis=1)).astype(np.float32)
    if rate != SAMPLE_RATE:
        import soxr

        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(mono)
