"""From audio files to timed text segments, all files through one pipeline:

- reading.py, on the CPU: reader threads read, decode, resample and (with VAD) segment up to
  LOOKAHEAD files ahead, a block at a time, handing on the windows' samples (memory is bounded by
  the queue, not by file length or count); with the model on the GPU their VAD runs there, the
  pending files' together, between the engine's steps (on the CPU: worker processes);
- on the GPU: features, the encoder encoder_batch windows at a time, and every window one
  greedy request of the runtime's continuous-batching engine, so windows of different files
  decode together (max_batch at once), each token scored (avg_logprob) in the same step;
- per file: its segments reassembled in order, the file handed back once all are done.
"""
from __future__ import annotations

import contextlib
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tilekernels.runtime import CheckpointError, Completion, Engine, Request, Sampling, TextStream, check_length, \
    freeze_heap, generate, load_tokenizer, using, warm_up
from tilekernels.runtime.profile import stage

from .features import FRAMES, WINDOW_SAMPLES, Window, audio_tokens, featurize, stream_windows
from .model import GlmAsr
from .reading import Readers, VadJob
from .vad import VadOptions, queue_probs, start_workers

ENCODER_BATCH = 8          # windows encoded together
MAX_BATCH = 64             # windows decoding at once
LOOKAHEAD = 8              # files opened ahead of the oldest unfinished one (at least twice max_batch)
QUEUE = 64                 # windows read ahead (their samples: 1.9 MB each at most)
WINDOW_PROMPT = 512        # tokens a full window's prompt takes at most (375 audio + instruction)
SLOT_POSITIONS = 1024      # a window's prompt and its new tokens (30 s of speech: ~100-300); 2,048 cost
                           # decode attention blocks past every row's end and twice the KV cache's memory
POLL_S = 0.001             # the wait for a window while the GPU is still encoding
_END = object()             # a source iterator's end
SCORED = Sampling(temperature=0, logprobs=0)    # greedy, each token's log-probability kept (avg_logprob)


def decode(engine: Engine, ids: list[int], audio_embeds, max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """The greedy continuation of one prompt whose audio placeholders take audio_embeds (n, C),
    up to its end token (left out)."""
    x = engine.model.prompt_embeds(ids, audio_embeds)
    tokens = generate(engine, [ids], max_new_tokens, embeds=[x], ignore_eos=ignore_eos)[0].tokens
    return tokens if ignore_eos else [t for t in tokens if t not in engine.model.eos_ids]


class Dropped(Exception):
    """A file whose requester has gone before it was transcribed (transcribe_many's dropped)."""


@dataclass
class _File:
    """One input on its way through: its segments by window index as they finish."""
    name: str
    texts: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)          # window index -> its tokens' mean log-probability
    windows: list = field(default_factory=list)
    total: int | None = None        # windows, once the reader has seen them all
    seconds: float = 0.0            # the input's duration (once read)
    error: Exception | None = None
    prompts: dict = field(default_factory=dict)     # window index -> its prompt's tokens
    show: bool = False              # whether its segments go to transcribe_many's partial as they come
    shown: int = 0                  # segments handed to partial so far
    fallback: "Fallback | None" = None      # its loop guard (None: greedy only)
    instruction: str | None = None          # its own (None: the run's)
    temperatures: dict = field(default_factory=dict)    # window index -> the temperature kept
    attempts: dict = field(default_factory=dict)        # window index -> [(ratio, avg_logprob, attempt, tokens)]
    preview: tuple | None = None    # (request, TextStream, tokens read): the next segment's text so far

    @property
    def guarded(self) -> bool:
        """Whether its loop guard is on (a window may be decoded again, its text changed)."""
        return self.fallback is not None and len(self.fallback.temperatures) > 1

    @property
    def complete(self) -> bool:
        return self.error is not None or (self.total is not None and len(self.texts) == self.total)


@dataclass(frozen=True)
class Fallback:
    """The loop guard, as faster-whisper's: a segment whose text compresses better than
    compression_ratio_threshold (a decode that repeats itself) or whose tokens' mean
    log-probability is below logprob_threshold (None: not checked) is decoded again at the next
    of temperatures, batched with the other work, its draws seeded by the segment's start time, so
    that its text is the same in every run. When every attempt fails, the likeliest (highest
    avg_logprob) of those that do not loop is kept, else the likeliest. temperatures (0,) alone:
    off."""
    temperatures: tuple[float, ...] = (0.0,)
    compression_ratio_threshold: float = 2.4
    logprob_threshold: float | None = -1.0

    def draw(self, attempt: int, start_s: float) -> tuple[Sampling, int]:
        """The sampling of a segment's attempt and the seed of its draws."""
        t = self.temperatures[attempt]
        return Sampling(temperature=t, logprobs=0), int(round(start_s * 1000)) * 16 + attempt

    def failed(self, ratio: float, avg_logprob: float) -> bool:
        return ratio > self.compression_ratio_threshold or (
            self.logprob_threshold is not None and avg_logprob < self.logprob_threshold)

    def kept(self, tried: list[tuple]) -> tuple:
        """Of a window's attempts (ratio, avg_logprob, attempt, tokens), the one it keeps."""
        if not self.failed(*tried[-1][:2]):
            return tried[-1]
        no_loop = [a for a in tried if a[0] <= self.compression_ratio_threshold]
        return max(no_loop or tried, key=lambda a: (a[1], -a[2]))


def with_context(instruction: str, context: str | None) -> str:
    """The instruction a window's prompt carries, with the caller's context (names, terms, the
    text before) after it: GLM-ASR reads both in its user turn."""
    return instruction if not context else f"{instruction}. Context: {context}"


def avg_logprob(out: Completion) -> float:
    """The mean log-probability of a completion's tokens, its end token counted (Whisper's: the
    sum over the text's tokens and the end token, over their number); 0 for none."""
    scores = out.logprobs or []
    return sum(t.logprob for t in scores) / len(scores) if scores else 0.0


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib compression (Whisper's measure; 0 for no text)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class _InFlight:
    """The files in flight, in input order: a file handed back leaves its place (None); `done`
    is the oldest not yet handed back."""

    def __init__(self, fallback: Fallback | None = None):
        self.files: list[_File | None] = []
        self.done = 0
        self.fallback = fallback

    def add(self, name: str, show: bool, fallback: Fallback | None = None, instruction: str | None = None) -> int:
        """A new file's place; fallback, instruction: its own (None: the run's)."""
        self.files.append(_File(name, show=show, fallback=fallback or self.fallback, instruction=instruction))
        return len(self.files) - 1

    def live(self, index: int) -> bool:
        """Whether a file still takes windows (not handed back, dropped or failed)."""
        f = self.files[index]
        return f is not None and f.error is None

    def all_read(self) -> bool:
        """Whether every file in flight has been read to its end (or failed)."""
        return all(f is None or f.total is not None or f.error is not None for f in self.files[self.done:])

    def finished(self, in_order: bool, segments: Callable) -> Iterator[tuple]:
        """(name, segments or the error, seconds) of each file done: in input order, or, in_order
        False, each as soon as it is done."""
        files = self.files
        for i in range(self.done, len(files) if not in_order else self.done):
            f = files[i]
            if f is not None and f.complete:
                files[i] = None
                yield f.name, f.error if f.error is not None else segments(f), f.seconds
        while self.done < len(files) and (files[self.done] is None or files[self.done].complete):
            f, files[self.done] = files[self.done], None
            self.done += 1
            if f is not None:
                yield f.name, f.error if f.error is not None else segments(f), f.seconds


class Transcriber:
    """One loaded model, tokenizer and engine serving many files."""

    def __init__(self, model: GlmAsr, tokenizer, max_batch: int = MAX_BATCH, encoder_batch: int = ENCODER_BATCH):
        self.model, self.tok = model, tokenizer
        # a batch's windows may join in one prefill: rows admitted in several groups start apart and
        # finish apart, costing the later ones' last steps at a smaller batch
        self.engine = Engine(self.model, max_batch, SLOT_POSITIONS, prefill_tokens=max_batch * WINDOW_PROMPT)
        self.encoder_batch = encoder_batch
        self._vad_stream = None
        self._vad_queued: list = []     # (jobs, QueuedProbs) the GPU is running, oldest first
        self._encoded = None        # the event of the last encoder pass queued (GPU)
        self._busy, self._owner = threading.Lock(), None      # _turn: one call drives the engine
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

    @contextlib.contextmanager
    def _turn(self):
        """One call at a time drives the engine (every request in it and every result is that
        call's): another thread's call waits for its turn; an unfinished transcribe_many of this
        same thread is an error, as it would wait for itself."""
        if not self._busy.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise RuntimeError("this model's last transcribe_many in this thread is unfinished: read it to "
                                   "the end or close() it first")
            self._busy.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            self._busy.release()

    def warm_up(self, instruction: str) -> None:
        """Build before any request what a server's first requests would otherwise wait for (on the
        GPU: kernels compiled, graphs captured): the engine's greedy decode steps at every batch
        size, then the encoder, prefill and first decode steps of a group of each size from 1 to
        encoder_batch windows (after the engine's, whose prompts may regrow the prefill's staging), and
        the VAD's kernels."""
        with self._turn():
            warm_up(self.engine, (SCORED,))
            if self.model.xp is not np:
                self._vad([VadJob(np.zeros(WINDOW_SAMPLES, np.float32))])
                self._vad_answer(wait=True)
            window = next(stream_windows([np.zeros(WINDOW_SAMPLES, np.float32)],
                                         self.model.config.encoder.num_mel_bins, None))
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
                        partial: Callable[[str, dict, int, int], None] | None = None,
                        fallback: Fallback | None = None,
                        preview: Callable[[str, str], None] | None = None,
                        ) -> Iterator[tuple[str, list[dict] | Exception, float]]:
        """(name, segments, seconds of audio) for each (name, open) source in order, each as soon
        as it and those before it are done (in_order False: as soon as it is done); open() returns
        an Audio or samples. A source that cannot be read gives (name, the exception, 0) and the
        others go on. progress: update(seconds) per window. A live source (a server's) may yield
        None for "nothing new yet": the work in flight goes on and the source is asked again.
        dropped(name): whether a file's requester has gone; its reading stops, its windows leave
        the engine, and it ends with Dropped. partial(name, segment, prompt tokens, new tokens):
        each segment of a source given as (name, open, True), as soon as it and those before it
        are decoded (a stream's text). fallback: the loop guard (None: greedy only); a source
        (name, open, show, fallback, instruction) brings its own of either. preview(name, text):
        for such a source without a loop guard (its text then only grows), the text so far of the
        segment partial gets next, after each engine step that added to it."""
        with self._turn():
            yield from self._transcribe_many(sources, instruction, max_new_tokens, progress, vad, ignore_eos, in_order,
                                             dropped, partial, fallback, preview)

    def _transcribe_many(self, sources, instruction, max_new_tokens, progress, vad, ignore_eos, in_order, dropped,
                         partial, fallback, preview):
        gpu_vad = vad is not None and self.model.xp is not np
        if vad is not None and not gpu_vad:
            start_workers()
        freeze_heap()       # the model and the kernels compiled so far: out of the collector's full passes
        e, flight, sources = self.engine, _InFlight(fallback), iter(sources)
        readers = Readers(vad, gpu_vad, self.model.config.encoder.num_mel_bins, max(QUEUE, 2 * e.max_batch),
                          flight.live)
        group: list = []
        exhausted = False
        try:
            while True:
                exhausted = exhausted or self._open(sources, flight, readers)
                if exhausted and flight.done == len(flight.files):
                    break
                # take what the readers have while the engine has room for it, waiting for them only
                # when nothing else can move; encode a group once it is full, or when no more is at hand
                # and the GPU has run the encoder passes queued so far (so too for stepping the engine
                # before its batch is full): a prefill queued sooner would wait behind them anyway, and
                # the windows read meanwhile join the same group, prefill and flow
                self._vad_answer()
                room, encoding = e.free, self._encoding()
                full = min(self.encoder_batch, max(room, 1))
                pending = encoding or bool(self._vad_queued)
                wait = 0.1 if not e.busy and not group and not pending else POLL_S if pending else 0.0
                jobs = self._gather(readers, flight, group, full, wait)
                if jobs:
                    with stage("vad"):
                        self._vad(jobs)
                # once every input is read no window can join a group or the batch any more: then the
                # prefill queues behind the encoder pass at once (a short clip's answer comes sooner)
                read_all = exhausted and flight.all_read()
                if group and (len(group) >= full or (readers.empty() and (read_all or not self._encoding()))):
                    self._encode_group(group, flight, instruction, max_new_tokens, ignore_eos)
                    room -= len(group)
                    group = []
                if dropped is not None:
                    self._drop(flight, dropped)
                # decode once the batch is full or the readers have nothing more right now
                if e.busy and (room <= 0 or (readers.empty() and (read_all or not self._encoding()))):
                    self._decode_step(flight, progress, partial, preview)
                yield from flight.finished(in_order, self._segments)
        finally:
            self._vad_answer(wait=True)
            readers.close()             # readers give up within 0.1 s
            e.cancel_where()            # a consumer that stopped early leaves nothing running

    def _open(self, sources: Iterator, flight: "_InFlight", readers: Readers) -> bool:
        """Hand readers new sources while fewer than LOOKAHEAD (at least twice max_batch) files are
        in flight; True once the sources are exhausted (a live one's None: nothing new yet)."""
        while len(flight.files) - flight.done < max(LOOKAHEAD, 2 * self.engine.max_batch):
            item = next(sources, _END)
            if item is _END:
                return True
            if item is None:
                return False
            show, fallback, instruction = (*item[2:], None, None, None)[:3]
            readers.submit(flight.add(item[0], show is True, fallback, instruction), item[1])
        return False

    @staticmethod
    def _gather(readers: Readers, flight: "_InFlight", group: list, full: int, wait: float) -> list[VadJob]:
        """Take the readers' items until `group` holds `full` windows or none is at hand (waiting
        `wait` for the first): windows join the group, ends and errors go to their files; the
        VAD jobs met are returned."""
        jobs = []
        while len(group) < full:
            item = readers.get(wait)
            if item is None:
                break
            wait = 0.0
            index, n, w = item
            if isinstance(w, VadJob):
                jobs.append(w)
            elif not flight.live(index):
                pass                    # a file dropped or failed while its reader was under way
            elif isinstance(w, Window):
                group.append(item)
            elif isinstance(w, Exception):
                flight.files[index].error = w
            else:
                flight.files[index].total, flight.files[index].seconds = n, w
        return jobs

    def _encode_group(self, group: list, flight: "_InFlight", instruction: str, max_new_tokens: int,
                      ignore_eos: bool) -> None:
        live = [g for g in group if flight.live(g[0])]
        if live:
            with stage("encode + prefill queued"):
                self._encode(live, flight.files, instruction, max_new_tokens, ignore_eos)

    def _decode_step(self, flight: "_InFlight", progress, partial, preview=None) -> None:
        """One engine step; the windows it finished go to their files (or, the loop guard's, back
        to the engine at the next temperature); preview gets the text so far of each shown file's
        next segment the step added to."""
        with stage("engine steps"):
            events = self.engine.step()
        growing = {}
        for ev in events:
            index, n, w, attempt = ev.request.tag
            f = flight.files[index]
            if f is None:
                continue
            if not ev.finished:
                if preview is not None and f.show and n == f.shown and not f.guarded:
                    growing[index] = ev.request
                continue
            if self._retried(ev.request, f):
                continue
            if progress is not None:
                progress.update(w.end_s - w.start_s)
            if partial is not None and f.show:
                self._show(f, partial)
        for index, r in growing.items():
            f = flight.files[index]
            if r.finished or r.tag[1] != f.shown:
                continue
            if f.preview is None or f.preview[0] is not r:     # a character's bytes wait for the rest
                f.preview = (r, TextStream(self.tok, skip_special_tokens=True), 0)
            _, text, seen = f.preview
            grew = "".join(text.push(t) for t in r.out.tokens[seen:])
            f.preview = (r, text, len(r.out.tokens))
            if grew:
                preview(f.name, text.text)

    def _retried(self, r: Request, f: _File) -> bool:
        """Keep a finished attempt's tokens as its window's text, or queue the next attempt (the
        loop guard, Fallback): whether it was queued again."""
        _, n, w, attempt = r.tag
        tokens, g, score = [t for t in r.out.tokens if t not in r.eos], f.fallback, avg_logprob(r.out)
        if not f.guarded:
            f.texts[n], f.scores[n], f.temperatures[n] = tokens, score, 0.0 if g is None else g.temperatures[0]
            return False
        ratio = compression_ratio(self.tok.decode(tokens, skip_special_tokens=True).strip())
        tried = f.attempts.setdefault(n, [])
        tried.append((ratio, score, attempt, tokens))
        if g.failed(ratio, score) and attempt + 1 < len(g.temperatures):
            sampling, seed = g.draw(attempt + 1, w.start_s)
            self.engine.add(Request(r.prompt, r.max_new_tokens, sampling, seed, eos=r.eos, embeds=r.embeds,
                                    tag=(r.tag[0], n, w, attempt + 1)))
            return True
        _, f.scores[n], kept, f.texts[n] = g.kept(tried)
        f.temperatures[n] = g.temperatures[kept]
        del f.attempts[n]
        return False

    def _drop(self, flight: "_InFlight", dropped: Callable[[str], bool]) -> None:
        """End the files in flight whose requester has gone: their windows leave the engine."""
        files = flight.files
        gone = {i for i in range(flight.done, len(files)) if flight.live(i) and dropped(files[i].name)}
        for i in gone:
            files[i].error = Dropped(f"{files[i].name}: dropped (its requester has gone)")
        if gone:
            self.engine.cancel_where(lambda r: r.tag[0] in gone)

    def _vad(self, jobs: list[VadJob]) -> None:
        """Queue the speech probabilities of the readers' pending samples, all in one batch on a
        stream of their own (the engine's decode steps in flight go on meanwhile; _vad_answer hands
        them over once the GPU has them); a batch that fails is queued again a job at a time, so
        that a bad input fails alone."""
        import cupy

        if self._vad_stream is None:
            self._vad_stream = cupy.cuda.Stream(non_blocking=True)
        try:
            with self._vad_stream:
                self._vad_queued.append((jobs, queue_probs([j.samples for j in jobs])))
        except Exception as e:      # noqa: BLE001 - handed to the readers
            if len(jobs) > 1:
                for j in jobs:
                    self._vad([j])
            else:
                jobs[0].future.set_exception(e)

    def _vad_answer(self, wait: bool = False) -> None:
        """Hand the readers the probabilities of the VAD batches the GPU has finished, in order
        (with wait: of all of them, waiting for the GPU)."""
        while self._vad_queued and (wait or self._vad_queued[0][1].done()):
            jobs, queued = self._vad_queued.pop(0)
            try:
                probs = queued.result()
            except Exception as e:      # noqa: BLE001 - handed to the readers
                for j in jobs:
                    j.future.set_exception(e)
                continue
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
                ids = self.prompt_ids(w.tokens, files[index].instruction or instruction)
                files[index].windows.append((n, w.start_s, w.end_s, w.speech))
                files[index].prompts[n] = len(ids)
                guard = files[index].fallback
                sampling, seed = (SCORED, None) if guard is None else guard.draw(0, w.start_s)
                self.engine.add(Request(ids, max_new_tokens, sampling, seed, eos=eos,
                                        embeds=m.prompt_embeds(ids, emb[j, :w.tokens]), tag=(index, n, w, 0)))
            if xp is not np:
                self._encoded = xp.cuda.get_current_stream().record()

    def _segment(self, f: _File, n: int, start: float, end: float, speech: float | None) -> dict:
        """A window's segment: its times, text and tokens, the text's compression ratio (as Whisper
        computes it: a looping decode compresses well), its tokens' mean log-probability and
        no_speech_prob: 1 minus the VAD's mean speech probability over it (None where no VAD ran)."""
        tokens = [int(t) for t in f.texts[n]]
        text = self.tok.decode(tokens, skip_special_tokens=True).strip()
        return {"start": round(start, 3), "end": round(end, 3), "text": text, "tokens": tokens,
                "temperature": f.temperatures.get(n, 0.0), "avg_logprob": round(f.scores.get(n, 0.0), 4),
                "compression_ratio": round(compression_ratio(text), 3),
                "no_speech_prob": None if speech is None else round(1.0 - speech, 4)}

    def _segments(self, f: _File) -> list[dict]:
        return [self._segment(f, *w) for w in sorted(f.windows, key=lambda w: w[0])]

    def _show(self, f: _File, partial: Callable[[str, dict, int, int], None]) -> None:
        """Hand partial each segment of f now decoded with every segment before it."""
        spans = {w[0]: w[1:] for w in f.windows}
        while f.shown in f.texts:
            n = f.shown
            partial(f.name, self._segment(f, n, *spans[n]), f.prompts[n], len(f.texts[n]))
            f.shown += 1
