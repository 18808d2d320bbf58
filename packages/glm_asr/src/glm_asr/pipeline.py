"""From audio files to timed text segments, all files through one pipeline:

- a CPU stage: READERS threads read, decode, resample and (with VAD) segment up to LOOKAHEAD
  files ahead, a block at a time, handing on the windows' samples (memory is bounded by the
  queue, not by file length or count); with the model on the GPU their VAD runs there, the
  pending files' together, between the engine's steps (on the CPU: worker processes);
- on the GPU: features, the encoder encoder_batch windows at a time, and every window one
  greedy request of the runtime's continuous-batching engine, so windows of different files
  decode together (max_batch at once);
- per file: its segments reassembled in order, the file handed back once all are done.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tilekernels.runtime import CheckpointError, Engine, Request, check_length, freeze_heap, generate, \
    load_tokenizer, using, warm_up
from tilekernels.runtime.profile import stage

from .audio import SAMPLE_RATE, Audio
from .features import FRAMES, WINDOW_SAMPLES, Window, audio_tokens, featurize, log_mel, stream_windows, valid_frames
from .model import GlmAsr
from .vad import VadOptions, device_probs, pooled_probs, segment_audio, segments_from_probs, start_workers, stream_probs

ENCODER_BATCH = 8          # windows encoded together
MAX_BATCH = 64             # windows decoding at once
READERS = 8                # files read at once (CPU threads): as many as the VAD's worker processes on a
                           # 16-core host (vad.pooled_probs, the CPU's VAD); 4 left half of them idle
LOOKAHEAD = 8              # files opened ahead of the oldest unfinished one (at least twice max_batch)
QUEUE = 64                 # windows read ahead (their samples: 1.9 MB each at most)
WINDOW_PROMPT = 512        # tokens a full window's prompt takes at most (375 audio + instruction)
SLOT_POSITIONS = 1024      # a window's prompt and its new tokens (30 s of speech: ~100-300); 2,048 cost
                           # decode attention blocks past every row's end and twice the KV cache's memory
POLL_S = 0.001             # the wait for a window while the GPU is still encoding
_END = object()             # a source iterator's end


def decode(engine: Engine, ids: list[int], audio_embeds, max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """The greedy continuation of one prompt whose audio placeholders take audio_embeds (n, C)."""
    x = engine.model.prompt_embeds(ids, audio_embeds)
    return generate(engine, [ids], max_new_tokens, embeds=[x], ignore_eos=ignore_eos)[0].tokens


class Dropped(Exception):
    """A file whose requester has gone before it was transcribed (transcribe_many's dropped)."""


@dataclass
class _File:
    """One input on its way through: its segments by window index as they finish."""
    name: str
    texts: dict = field(default_factory=dict)
    windows: list = field(default_factory=list)
    total: int | None = None        # windows, once the reader has seen them all
    seconds: float = 0.0            # the input's duration (once read)
    error: Exception | None = None
    prompts: dict = field(default_factory=dict)     # window index -> its prompt's tokens
    show: bool = False              # whether its segments go to transcribe_many's partial as they come
    shown: int = 0                  # segments handed to partial so far

    @property
    def complete(self) -> bool:
        return self.error is not None or (self.total is not None and len(self.texts) == self.total)


@dataclass
class _VadJob:
    """A reader's samples whose speech probabilities the pipeline's loop computes on the GPU."""
    samples: np.ndarray
    future: Future = field(default_factory=Future)


class Transcriber:
    """One loaded model, tokenizer and engine serving many files."""

    def __init__(self, model: GlmAsr, tokenizer, max_batch: int = MAX_BATCH, encoder_batch: int = ENCODER_BATCH):
        self.model, self.tok = model, tokenizer
        # a batch's windows may join in one prefill: rows admitted in several groups start apart and
        # finish apart, costing the later ones' last steps at a smaller batch
        self.engine = Engine(self.model, max_batch, SLOT_POSITIONS, prefill_tokens=max_batch * WINDOW_PROMPT)
        self.encoder_batch = encoder_batch
        self._vad_stream = None
        self._encoded = None        # the event of the last encoder pass queued (GPU)
        pad = self.tok.token_to_id("<|pad|>")
        for name in ("<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"):
            if self.tok.token_to_id(name) is None:
                raise CheckpointError(f"tokenizer.json: special token {name} missing")
        if pad != self.model.config.audio_token_id:
            raise CheckpointError(f"tokenizer.json: <|pad|> is {pad} but config audio_token_id is "
                                  f"{self.model.config.audio_token_id}")

    @classmethod
    def load(cls, directory: Path, device: str, max_batch: int = MAX_BATCH,
             encoder_batch: int = ENCODER_BATCH) -> "Transcriber":
        """The checkpoint and tokenizer in directory, on device 'gpu' or 'cpu'."""
        return cls(GlmAsr.load(directory, device), load_tokenizer(directory), max_batch, encoder_batch)

    def warm_up(self, instruction: str) -> None:
        """Build before any request what a server's first requests would otherwise wait for (on the
        GPU: kernels compiled, graphs captured): the engine's greedy decode steps at every batch
        size, then the encoder, prefill and first decode steps of a group of each size from 1 to
        encoder_batch windows (after the engine's, whose prompts may regrow the prefill's staging), and
        the VAD's kernels."""
        warm_up(self.engine)
        if self.model.xp is not np:
            self._vad([_VadJob(np.zeros(WINDOW_SAMPLES, np.float32))])
        window = next(stream_windows([np.zeros(WINDOW_SAMPLES, np.float32)], self.model.config.encoder.num_mel_bins,
                                     None))
        for n in range(1, self.encoder_batch + 1):
            self._encode([(0, i, window) for i in range(n)], [_File("warm-up")], instruction, 2, True)
            while self.engine.busy:
                self.engine.step()

    def prompt_ids(self, n_audio: int, instruction: str) -> list[int]:
        text = (f"<|user|>\n<|begin_of_audio|>{'<|pad|>' * n_audio}<|end_of_audio|><|user|>\n"
                f"{instruction}<|assistant|>\n")
        return self.tok.encode(text, add_special_tokens=False).ids

    def check(self, instruction: str, max_new_tokens: int) -> None:
        """Refuse max_new_tokens that a full window's prompt leaves no room for in the decoder's
        positions or the engine's slots (before any file is read)."""
        ids = self.prompt_ids(audio_tokens(FRAMES), instruction)
        check_length(self.model, len(ids), max_new_tokens)
        self.engine.check(Request(ids, max_new_tokens))

    def transcribe_many(self, sources: Iterable[tuple | None], instruction: str, max_new_tokens: int,
                        progress=None, vad: VadOptions | None = None, ignore_eos: bool = False,
                        in_order: bool = True, dropped: Callable[[str], bool] | None = None,
                        partial: Callable[[str, dict, int, int], None] | None = None
                        ) -> Iterator[tuple[str, list[dict] | Exception, float]]:
        """(name, segments, seconds of audio) for each (name, open) source in order, each as soon
        as it and those before it are done (in_order False: as soon as it is done); open() returns
        an Audio or samples. A source that cannot be read gives (name, the exception, 0) and the
        others go on. progress: update(seconds) per window. A live source (a server's) may yield
        None for "nothing new yet": the work in flight goes on and the source is asked again.
        dropped(name): whether a file's requester has gone; its reading stops, its windows leave
        the engine, and it ends with Dropped. partial(name, segment, prompt tokens, new tokens):
        each segment of a source given as (name, open, True), as soon as it and those before it
        are decoded (a stream's text)."""
        gpu_vad = vad is not None and self.model.xp is not np
        if vad is not None and not gpu_vad:
            start_workers()
        freeze_heap()       # the model and the kernels compiled so far: out of the collector's full passes
        files: list[_File] = []
        vad_jobs: list[_VadJob] = []
        windows: queue.Queue = queue.Queue(max(QUEUE, 2 * self.engine.max_batch))
        sources = iter(sources)
        n_mels = self.model.config.encoder.num_mel_bins
        stop = threading.Event()

        def wanted(index: int) -> bool:
            """Whether the loop still takes what a reader puts: not stopped, its file not dropped."""
            return not stop.is_set() and (index < 0 or files[index] is not None and files[index].error is None)

        def put(item) -> bool:
            while wanted(item[0]):
                try:
                    windows.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def loop_probs(samples: np.ndarray) -> np.ndarray:
            """A reader's VAD, run by the loop below (on the GPU, with other files' VAD)."""
            job = _VadJob(samples)
            if not put((-1, -1, job)):
                raise RuntimeError("stopped")
            while True:
                try:
                    return job.future.result(timeout=0.1)
                except FutureTimeout:
                    if stop.is_set():
                        raise RuntimeError("stopped") from None

        def read(index: int, opener: Callable) -> None:
            audio = None
            try:
                audio = opener()
                if vad is not None:
                    wins = speech_windows(audio, vad, n_mels, None, loop_probs if gpu_vad else pooled_probs)
                else:
                    blocks, offset = ([audio], 0.0) if isinstance(audio, np.ndarray) else (audio, audio.offset_s)
                    wins = stream_windows(blocks, n_mels, None, offset)
                n, end = 0, 0.0
                for w in wins:
                    if not put((index, n, w)):
                        return
                    n, end = n + 1, w.end_s
                seconds = len(audio) / SAMPLE_RATE if isinstance(audio, np.ndarray) else audio.seconds
                put((index, n, seconds or end))
            except Exception as e:      # noqa: BLE001 - handed to the caller as this file's result
                put((index, -1, e))
            finally:
                if isinstance(audio, Audio):
                    audio.close()       # now, not at the next garbage collection (a server's upload)

        pool = ThreadPoolExecutor(READERS, thread_name_prefix="glm_asr-read")
        done_before, group, exhausted = 0, [], False
        try:
            while True:
                while not exhausted and len(files) - done_before < max(LOOKAHEAD, 2 * self.engine.max_batch):
                    item = next(sources, _END)
                    if item is _END:
                        exhausted = True
                    elif item is None:          # a live source with nothing new yet
                        break
                    else:
                        files.append(_File(item[0], show=item[2:3] == (True,)))
                        pool.submit(read, len(files) - 1, item[1])
                if exhausted and done_before == len(files):
                    break
                # take what the readers have while the engine has room for it, waiting for them only
                # when nothing else can move; encode a group once it is full, or when no more is at hand
                # and the GPU has run the encoder passes queued so far (so too for stepping the engine
                # before its batch is full): a prefill queued sooner would wait behind them anyway, and
                # the windows read meanwhile join the same group, prefill and flow
                e = self.engine
                room = e.free
                encoding = self._encoding()
                wait = 0.1 if not e.busy and not group and not encoding else POLL_S if encoding else 0.0
                while len(group) < min(self.encoder_batch, max(room, 1)):
                    try:
                        index, n, w = windows.get(block=wait > 0, timeout=wait or None)
                    except queue.Empty:
                        break
                    wait = 0.0
                    if isinstance(w, _VadJob):
                        vad_jobs.append(w)
                    elif files[index] is None or files[index].error is not None:
                        pass                    # a file dropped while its reader was under way
                    elif isinstance(w, Window):
                        group.append((index, n, w))
                    elif isinstance(w, Exception):
                        files[index].error = w
                    else:
                        files[index].total, files[index].seconds = n, w
                if vad_jobs:
                    with stage("vad"):
                        self._vad(vad_jobs)
                    vad_jobs = []
                # once every input is read no window can join a group or the batch any more: then the
                # prefill queues behind the encoder pass at once (a short clip's answer comes sooner)
                read_all = exhausted and all(f is None or f.total is not None or f.error is not None
                                             for f in files[done_before:])
                ready = windows.empty() and (read_all or not self._encoding())
                if group and (len(group) >= min(self.encoder_batch, max(room, 1)) or ready):
                    live = [g for g in group if files[g[0]] is not None and files[g[0]].error is None]
                    if live:
                        with stage("encode + prefill queued"):
                            self._encode(live, files, instruction, max_new_tokens, ignore_eos)
                    room -= len(group)
                    group = []
                if dropped is not None:
                    self._drop(files, done_before, dropped)
                # decode once the batch is full or the readers have nothing more right now
                if e.busy and (room <= 0 or (windows.empty() and (read_all or not self._encoding()))):
                    with stage("engine steps"):
                        events = e.step()
                    for ev in events:
                        index, n, w = ev.request.tag
                        if ev.finished and files[index] is not None:
                            files[index].texts[n] = ev.request.out.tokens
                            if progress is not None:
                                progress.update(w.end_s - w.start_s)
                            if partial is not None and files[index].show:
                                self._show(files[index], partial)
                for i in range(done_before, len(files) if not in_order else done_before):
                    f = files[i]
                    if f is not None and f.complete:
                        files[i] = None
                        yield f.name, f.error if f.error is not None else self._segments(f), f.seconds
                while done_before < len(files) and (files[done_before] is None or files[done_before].complete):
                    f = files[done_before]
                    files[done_before] = None
                    done_before += 1
                    if f is not None:
                        yield f.name, f.error if f.error is not None else self._segments(f), f.seconds
        finally:
            stop.set()                          # readers give up within 0.1 s
            pool.shutdown(wait=True, cancel_futures=True)
            self.engine.cancel_where()          # a consumer that stopped early leaves nothing running

    def _drop(self, files: list, start: int, dropped: Callable[[str], bool]) -> None:
        """End the files in flight whose requester has gone: their windows leave the engine."""
        gone = {i for i in range(start, len(files))
                if files[i] is not None and files[i].error is None and dropped(files[i].name)}
        for i in gone:
            files[i].error = Dropped(f"{files[i].name}: dropped (its requester has gone)")
        if gone:
            self.engine.cancel_where(lambda r: r.tag[0] in gone)

    def _vad(self, jobs: list[_VadJob]) -> None:
        """The speech probabilities of the readers' pending samples, all in one batch on a stream of
        their own (the engine's decode steps in flight go on meanwhile); a batch that fails is
        retried a job at a time, so that a bad input fails alone."""
        import cupy

        if self._vad_stream is None:
            self._vad_stream = cupy.cuda.Stream(non_blocking=True)
        try:
            with self._vad_stream:
                probs = device_probs([j.samples for j in jobs])
        except Exception as e:      # noqa: BLE001 - handed to the readers
            if len(jobs) > 1:
                for j in jobs:
                    self._vad([j])
            else:
                jobs[0].future.set_exception(e)
            return
        for j, p in zip(jobs, probs):
            j.future.set_result(p)

    def _encoding(self) -> bool:
        """Whether the GPU is still running the last encoder pass queued (always False on the CPU)."""
        return self._encoded is not None and not self._encoded.done

    def _encode(self, group: list, files: list, instruction: str, max_new_tokens: int, ignore_eos: bool) -> None:
        """Encode a group of windows and queue each as a request of the engine."""
        m, xp = self.model, self.model.xp
        n_mels = m.config.encoder.num_mel_bins
        with self.engine.stream, using(self.engine.precision):     # ordered before the prefill reads them
            emb = m.encode(featurize([w for _, _, w in group], n_mels, xp))
            eos = frozenset() if ignore_eos else frozenset(m.eos_ids)
            for j, (index, n, w) in enumerate(group):
                ids = self.prompt_ids(w.tokens, instruction)
                files[index].windows.append((n, w.start_s, w.end_s))
                files[index].prompts[n] = len(ids)
                self.engine.add(Request(ids, max_new_tokens, eos=eos, embeds=m.prompt_embeds(ids, emb[j, :w.tokens]),
                                        tag=(index, n, w)))
            if xp is not np:
                self._encoded = xp.cuda.get_current_stream().record()

    def _segment(self, f: _File, n: int, start: float, end: float) -> dict:
        text = self.tok.decode(f.texts[n], skip_special_tokens=True)
        return {"start": round(start, 3), "end": round(end, 3), "text": text.strip()}

    def _segments(self, f: _File) -> list[dict]:
        return [self._segment(f, n, start, end) for n, start, end in sorted(f.windows)]

    def _show(self, f: _File, partial: Callable[[str, dict, int, int], None]) -> None:
        """Hand partial each segment of f now decoded with every segment before it."""
        spans = {n: (start, end) for n, start, end in f.windows}
        while f.shown in f.texts:
            n = f.shown
            partial(f.name, self._segment(f, n, *spans[n]), f.prompts[n], len(f.texts[n]))
            f.shown += 1


def speech_windows(audio: Audio | np.ndarray, options: VadOptions, n_mels: int = 128, xp=np,
                   probs: Callable = pooled_probs) -> Iterator[Window]:
    """A window for each segment of speech Silero VAD finds: its padded audio as the features
    (computed with xp; None leaves the samples), its unpadded speech bounds as the times (in the
    file's time). Two passes over a file (the probabilities, then the segments' audio), each
    holding a block at a time; probs(samples) computes the probabilities of a block."""
    if isinstance(audio, np.ndarray):
        first, again, offset = [audio], (lambda: [audio]), 0.0
    else:
        first, again, offset = audio, audio.reopen, audio.offset_s
    p, n = stream_probs(first, probs)
    for seg, x in segment_audio(again(), segments_from_probs(p, n, options)):
        tokens = audio_tokens(valid_frames(len(x)))
        if tokens >= 1:
            yield Window(offset + seg.start_s, offset + seg.end_s, x if xp is None else log_mel(x, n_mels, xp), tokens)
