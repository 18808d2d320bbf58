"""Audio in: any file libsndfile reads (the fast path) or FFmpeg decodes (PyAV: m4a, mp4 and other
video, webm, aac, wma, ...), standard input, folders and glob patterns; out: 16 kHz mono float32
samples in blocks, so memory does not grow with a file's length.

Channels are averaged to mono and other rates resampled with soxr's streaming resampler at
librosa's default quality: the samples librosa.resample gives for the whole file, as many (its
length rounds up, zero padded).
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

SAMPLE_RATE = 16000
MIN_RATE = 4000             # Hz: slower files hold no speech, and a few bytes of one would resample to hours
BLOCK_SECONDS = 30          # samples handed on at a time (about 2 MB at 16 kHz)
EXTENSIONS = ("wav", "flac", "ogg", "oga", "opus", "mp3", "m4a", "aac", "wma", "aiff", "aif", "caf", "amr",
              "mp4", "m4v", "mov", "mkv", "webm", "avi", "wmv", "flv", "mpg", "mpeg", "ts", "3gp")


class AudioError(Exception):
    """An audio file that cannot be transcribed; one line for the user."""


class Audio:
    """An opened input: iterate it for its samples in blocks (16 kHz mono float32). Opening reads
    the header, so an unreadable file fails here, before any work; a decoding error or a
    non-finite sample later raises AudioError from the iteration.

    offset_s: the file time of the first sample (an audio stream that starts after the
    container's start); seconds: the duration when the header tells it, else None. The file
    stays open until its samples have all been read or close() (or a with block's end)."""

    def __init__(self, path: str, audio_stream: int | None = None, name: str | None = None):
        self.name, self.offset_s, self.seconds = name or path, 0.0, None
        self.path, self.audio_stream = path, audio_stream
        p = Path(path)
        if not p.exists():
            raise AudioError(f"{self.name}: no such file")
        if p.is_dir():
            raise AudioError(f"{self.name}: is a directory")
        self._handle = None
        self._blocks = self._open_soundfile(p) if not audio_stream else None
        if self._blocks is None:
            self._blocks = self._open_av(p, audio_stream)

    def close(self) -> None:
        """Let go of the file now (a server deletes an upload once it is done with it)."""
        self._blocks.close()
        self._handle.close()

    def __enter__(self) -> "Audio":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[np.ndarray]:
        n = 0
        for block in self._blocks:
            if not np.isfinite(block).all():
                raise AudioError(f"{self.name}: contains NaN or infinite samples")
            n += len(block)
            yield block
        if n == 0:
            raise AudioError(f"{self.name}: contains no samples")

    # ---------------------------------------------------------------- libsndfile
    def _open_soundfile(self, p: Path):
        import soundfile

        try:
            f = soundfile.SoundFile(str(p))
        except Exception:       # not a format libsndfile knows: FFmpeg's turn
            return None
        # libsndfile's note on a cut-short file; a size of 2**32 - 1 is a streamed WAV's "unknown" (ffmpeg's
        # to a pipe), not a claim
        short = re.search(r"data\s*:\s*(\d+) \(should be (\d+)\)", f.extra_info)
        if short and 0 < int(short.group(2)) < int(short.group(1)) < 0xFFFFFFFF:   # (0: no samples, said when read)
            got = f.frames / f.samplerate
            print(f"warning: {self.name}: truncated: its header claims "
                  f"{got * int(short.group(1)) / int(short.group(2)):.2f} s, {got:.2f} s read", file=sys.stderr)
        self.seconds, self._handle = f.frames / f.samplerate, f
        _check_rate(f.samplerate, self.name, f)
        return self._soundfile_blocks(f, self.name)

    @staticmethod
    def _soundfile_blocks(f, name: str) -> Iterator[np.ndarray]:
        with f:
            rs = _resampler(f.samplerate)
            size = BLOCK_SECONDS * f.samplerate
            n_in = n_out = 0
            while True:
                try:
                    data = f.read(size, dtype="float32", always_2d=True)
                except Exception as e:
                    raise AudioError(f"{name}: not a readable audio file ({_first_line(e)})") from None
                last = len(data) < size
                mono = data.mean(axis=1)
                n_in += len(mono)
                if rs is not None:
                    mono = rs.resample_chunk(mono, last=last)
                    mono = _ended(mono, n_in, n_out, f.samplerate) if last else mono
                    n_out += len(mono)
                if len(mono):
                    yield np.ascontiguousarray(mono, dtype=np.float32)
                if last:
                    return

    # ---------------------------------------------------------------- FFmpeg (PyAV)
    def _open_av(self, p: Path, audio_stream: int | None):
        try:
            import av
        except ImportError:
            raise AudioError(f"{self.name}: not a format libsndfile reads, and PyAV (the av package) is not "
                             f"installed to decode it") from None
        try:
            container = av.open(str(p))
        except Exception as e:
            raise AudioError(f"{self.name}: not a readable audio or video file ({_first_line(e)})") from None
        streams = container.streams.audio
        k = audio_stream or 0
        if not streams:
            container.close()
            raise AudioError(f"{self.name}: no audio stream")
        if not 0 <= k < len(streams):
            container.close()
            raise AudioError(f"{self.name}: audio_stream={k}, but the file has {len(streams)} audio stream(s)")
        stream = streams[k]
        _check_rate(stream.rate or SAMPLE_RATE, self.name, container)
        start = container.start_time / 1e6 if container.start_time is not None else 0.0
        if stream.start_time is not None:
            self.offset_s = max(0.0, float(stream.start_time * stream.time_base) - start)
        if stream.duration is not None:
            self.seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            self.seconds = container.duration / 1e6
        self._handle = container
        return self._av_blocks(container, stream, self.name)

    @staticmethod
    def _av_blocks(container, stream, name: str) -> Iterator[np.ndarray]:
        import av

        rs, pending, have, n_in, n_out, rate = None, [], 0, 0, 0, SAMPLE_RATE
        try:
            with container:
                for frame in container.decode(stream):
                    data = frame.to_ndarray()          # (channels, n) planar, or (1, n * channels) packed
                    if not frame.format.is_planar:
                        data = data.reshape(-1, len(frame.layout.channels)).T
                    mono = data.astype(np.float32).mean(axis=0)
                    if data.dtype.kind in "iu":        # integer PCM to [-1, 1)
                        half = float(1 << (8 * data.dtype.itemsize - 1))
                        mono = (mono - half if data.dtype.kind == "u" else mono) / half
                    if rs is None:
                        rate, rs = frame.sample_rate, _resampler(frame.sample_rate)
                    n_in += len(mono)
                    pending.append(mono if rs is None else rs.resample_chunk(mono))
                    have += len(pending[-1])
                    if have >= BLOCK_SECONDS * SAMPLE_RATE:
                        yield np.concatenate(pending)
                        pending, n_out, have = [], n_out + have, 0
        except av.error.FFmpegError as e:
            raise AudioError(f"{name}: cannot decode ({_first_line(e)})") from None
        if rs is not None:
            tail = np.concatenate(pending + [rs.resample_chunk(np.zeros(0, np.float32), last=True)])
            pending = [_ended(tail, n_in, n_out, rate)]
        if pending and sum(map(len, pending)):
            yield np.concatenate(pending).astype(np.float32)


def _check_rate(rate: int, name: str, handle) -> None:
    """Refuse (and close) a file sampled under MIN_RATE."""
    if rate < MIN_RATE:
        handle.close()
        raise AudioError(f"{name}: sampled at {rate} Hz; at least {MIN_RATE} Hz is needed to hear speech")


def _resampler(rate: int):
    """soxr's streaming resampler from rate to 16 kHz ('HQ': librosa's default, soxr_hq), or None."""
    if rate == SAMPLE_RATE:
        return None
    import soxr

    return soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")


def _ended(tail: np.ndarray, n_in: int, n_out: int, rate: int) -> np.ndarray:
    """A resampled stream's last samples, zero padded (or cut) to the length librosa.resample
    gives n_in samples at `rate` (n_out samples came before them)."""
    want = int(np.ceil(n_in * (SAMPLE_RATE / rate))) - n_out
    return tail[:want] if len(tail) >= want else np.concatenate([tail, np.zeros(want - len(tail), np.float32)])


def _first_line(e: Exception) -> str:
    """The reason alone: FFmpeg's strerror (its message repeats the path), else the first line."""
    if getattr(e, "strerror", None):
        return e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def read_audio(path: str | Path, audio_stream: int | None = None) -> np.ndarray:
    """All of a file's samples at once (16 kHz mono float32)."""
    return np.concatenate(list(Audio(str(path), audio_stream)))


# -------------------------------------------------------------------- inputs
def expand_inputs(args: list[str], extensions=EXTENSIONS) -> tuple[list[str], list[str]]:
    """(inputs, errors): each argument as given ('-' is standard input), a directory as the files
    inside it whose extension is one of `extensions` (recursively, in sorted path order, hidden
    files such as macOS's ._x.wav skipped), a glob
    pattern that is not an existing path as its matches (sorted; '**' recurses), the same on every
    shell. A missing path, or a pattern or directory that yields nothing, is an error line."""
    exts = {"." + e.lower().lstrip(".") for e in extensions}
    inputs, errors = [], []
    for a in args:
        p = Path(a)
        if a == "-" or p.is_file():
            inputs.append(a)
        elif p.is_dir():
            found = sorted(str(f) for f in p.rglob("*")
                           if f.is_file() and f.suffix.lower() in exts and not f.name.startswith("."))
            inputs += found
            if not found:
                errors.append(f"{a}: no audio or video files ({', '.join(sorted(e[1:] for e in exts))})")
        elif glob.has_magic(a):
            found = sorted(f for f in glob.glob(a, recursive=True) if Path(f).is_file())
            inputs += found
            if not found:
                errors.append(f"{a}: no files match")
        elif p.exists():
            inputs.append(a)        # not a regular file (a pipe): said when read, if it cannot be
        else:
            errors.append(f"{a}: no such file")
    return inputs, errors


def stdin_to_file(directory: str) -> str:
    """Standard input copied to a file in `directory` (decoders seek, a pipe cannot): its path."""
    if sys.stdin is None:
        raise OSError("standard input is closed")
    return copy_to_file(directory, sys.stdin.buffer, "stdin.")


def copy_to_file(directory: str, source, prefix: str = "audio.") -> str:
    """A binary file object or bytes copied to a file in `directory`: its path."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=prefix)
    with os.fdopen(fd, "wb") as f:
        if isinstance(source, (bytes, bytearray, memoryview)):
            f.write(source)
            return path
        while chunk := source.read(1 << 20):
            if not isinstance(chunk, (bytes, bytearray)):
                raise ValueError("audio file objects must be opened in binary mode ('rb')")
            f.write(chunk)
    return path
