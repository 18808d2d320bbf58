"""python -m gpt.serve [key=value ...]: an OpenAI-compatible completions server (FastAPI on uvicorn).

    python -m gpt.serve model=gpt2 port=8000 device=gpu
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "gpt2", "prompt": "Hello", "max_tokens": 20, "temperature": 0}'

POST /v1/completions (prompt: a string, a list of them, token ids or a list of those; max_tokens,
temperature, top_p, top_k and repetition_penalty (extensions), n, stop, seed, stream (server-sent
events), echo, logprobs (0 to 20: each token's log-probability under the model and that many
alternatives, in OpenAI's completions shape; with echo the prompt's too, and max_tokens 0 scores
the prompt alone, as lm-evaluation-harness asks), presence_penalty, frequency_penalty, logit_bias,
min_p (vLLM's extension); suffix and best_of != n are refused with 400), GET /v1/models, /health,
/metrics, and vLLM's
POST /tokenize, POST /detokenize, GET /tokenizer_info (what lm-evaluation-harness's
local-completions model tokenizes with, so it needs no tokenizer of its own). Every option of python -m gpt.generate is
the default of the matching request field (max_new_tokens -> max_tokens, num_samples -> n).
Every request's rows join the engine's running batch (EngineWorker): concurrent requests share each
decode step, and each gets what python -m gpt.generate gives for it (same seeds, the engine's
tokens do not depend on the batch). A body is read up to max_request_mb and checked whole
(CompletionRequest) before anything of it reaches the engine; a request asks at most max_rows
rows (prompts x n, n <= 128), and the queue admits by rows (max_queue past max_batch).
"""
from __future__ import annotations

import asyncio
import json
import math
import time

import hydra
import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse
from omegaconf import DictConfig, OmegaConf

from tilekernels.logprobs import MAX_TOP
from tilekernels.runtime import (GREEDY, Completion, Sampling, TextStream, TokenLogprob, check_length,
                                 from_model_config, requests, token_name, warm_up)
from tilekernels.runtime.sampler import check_seed
from tilekernels.runtime.cli import Float, Int, config_dir, exit_with_one_line_errors, options, run_hydra

from tilekernels.runtime.server import (SERVER_OPTIONS, APIError, ClientGone, EngineJob, EngineWorker, Job, Metrics,
                                        check_model, error_body, error_response, make_app, new_id, read_body,
                                        run_server, submit, wait)

from . import generate as _cli  # noqa: F401  (registers the gpt_data resolver the model configs use)
from .api import GPTError, LanguageModel, load
from .generate import SHARED_OPTIONS, stop_strings

UNSUPPORTED = {"suffix": "suffix (insertion) is not supported"}
MAX_BIASES = 1024       # logit_bias entries a request
MAX_N = 128             # completions a prompt (n)
MAX_STOPS, MAX_STOP_CHARS = 4, 256      # OpenAI's rule: up to 4 stop strings
INLINE_BYTES = 1 << 16  # bodies parsed on the event loop; larger ones in a thread
SERVE_OPTIONS = {**SERVER_OPTIONS, **SHARED_OPTIONS, "max_rows": Int(min=1), "max_request_mb": Float(gt=0)}


class CompletionRequest:
    """A /v1/completions body checked whole before anything of it reaches the engine: every
    field's type and range (ids in the vocabulary, finite numbers, strings valid UTF-8, at most
    max_rows rows: prompts x n), the token ids per row (prompt-major, n rows per prompt) and the
    sampling settings. Any fault is an APIError 400 naming the field."""

    def __init__(self, body: dict, defaults: dict, lm: LanguageModel, model_id: str, max_rows: int):
        check_model(body.get("model"), model_id)
        for name, why in UNSUPPORTED.items():
            if body.get(name) not in (None, {}, "", False):
                raise APIError(400, why, name, "unsupported_parameter")

        def get(name, default, kind):
            v = body.get(name)
            if v is None:
                return default
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise APIError(400, f"{name} must be an integer, got {v!r}", name)
            if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise APIError(400, f"{name} must be a finite number, got {v!r}", name)
            if kind is bool and not isinstance(v, bool):
                raise APIError(400, f"{name} must be true or false, got {v!r}", name)
            return v

        vocab = lm.model.config.vocab_size
        self.max_tokens = get("max_tokens", defaults["max_new_tokens"], int)
        self.n = get("n", defaults["num_samples"], int)
        self.seed = get("seed", defaults["seed"], int)
        self.stream = get("stream", False, bool)
        self.echo = get("echo", False, bool)
        best_of = get("best_of", None, int)
        if best_of is not None and best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of", "unsupported_parameter")
        so = body.get("stream_options") or {}
        self.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        self.logprobs = get("logprobs", None, int)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_TOP}], got {self.logprobs}", "logprobs")
        if self.max_tokens < (0 if self.echo else 1):
            raise APIError(400, f"max_tokens must be >= 1 (0 with echo: the prompt alone), got {self.max_tokens}",
                           "max_tokens")
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        try:
            check_seed(self.seed)
            self.sampling = Sampling(float(get("temperature", defaults["temperature"], float)),
                                     get("top_k", defaults["top_k"], int),
                                     float(get("top_p", defaults["top_p"], float)),
                                     float(get("repetition_penalty", defaults["repetition_penalty"], float)),
                                     self.logprobs, self.logprobs if self.echo else None,
                                     float(get("min_p", 0.0, float)), float(get("presence_penalty", 0.0, float)),
                                     float(get("frequency_penalty", 0.0, float)),
                                     _logit_bias(body.get("logit_bias"), vocab))
        except ValueError as e:
            raise APIError(400, str(e), str(e).split()[0]) from None
        if self.sampling.top_k > vocab:
            raise APIError(400, f"top_k must be in [0, {vocab}] (the vocabulary), got {self.sampling.top_k}", "top_k")
        self.stop = _stop(body.get("stop", None), defaults["stop"])
        prompt = body.get("prompt", None)
        self.prompts = _prompts(defaults["prompt"] if prompt is None else prompt, vocab)
        if len(self.prompts) * self.n > max_rows:
            raise APIError(400, f"{len(self.prompts)} prompt(s) x n={self.n} is more than the {max_rows} rows a "
                           f"request may ask (max_rows)", "n" if self.n > 1 else "prompt", "too_many_rows")
        self.steps = max(self.max_tokens, 1)        # max_tokens 0: the prompt's prefill alone, its token dropped
        with _bad_request():
            ids = lm.encode(self.prompts)
        with _bad_request("max_tokens"):
            check_length(lm.model, max(len(i) for i in ids), self.steps)
        self.prompt_ids = ids
        self.ids = [i for i in ids for _ in range(self.n)]
        self.prompt_texts = [p if isinstance(p, str) else lm.tokenizer.decode(list(p)) for p in self.prompts]
        self.prompt_tokens = sum(len(i) for i in ids)


def _logit_bias(bias, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {"token id": bias in [-100, 100]} as (id, bias) pairs."""
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_BIASES:
        raise APIError(400, f"logit_bias must be an object of at most {MAX_BIASES} token ids", "logit_bias")
    out = []
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < vocab):
            raise APIError(400, f"logit_bias: token ids must be in [0, {vocab}), got {k!r}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise APIError(400, f"logit_bias values must be numbers in [-100, 100], got {v!r}", "logit_bias")
        out.append((int(k), float(v)))
    return tuple(out)


class _bad_request:
    """A ValueError in the block as a 400 (naming param)."""

    def __init__(self, param: str | None = None):
        self.param = param

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and isinstance(e, (GPTError, ValueError, OverflowError)):
            raise APIError(400, str(e), self.param) from None
        return False


def _utf8(name: str, text: str) -> str:
    """text, if it is valid Unicode (JSON's escapes can carry lone surrogates, which UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{name} must be valid Unicode text (it holds a lone surrogate)", name) from None
    return text


def _stop(stop, default: list[str]) -> list[str]:
    """The stop strings: a string or a list of at most MAX_STOPS, each at most MAX_STOP_CHARS long."""
    stop = default if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                       "stop")
    return [_utf8("stop", s) for s in stop if s]


def _prompts(prompt, vocab: int) -> list:
    """A string, a list of strings, a list of token ids or a list of those lists; ids in [0, vocab)."""
    def ids(p) -> bool:
        return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
        prompts = prompt
    else:
        raise APIError(400, "prompt must be a string, a list of strings, token ids or a list of token id lists",
                       "prompt")
    for p in prompts:
        if isinstance(p, str):
            _utf8("prompt", p)
        elif p and not 0 <= min(p) <= max(p) < vocab:
            raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {min(p)}..{max(p)}", "prompt")
    return prompts


def build_app(cfg: DictConfig, lm: LanguageModel | None = None):
    o = options(cfg, SERVE_OPTIONS)
    prompt = cfg.get("prompt")
    defaults = {**o, "stop": stop_strings(cfg.get("stop")),
                "prompt": OmegaConf.to_container(prompt) if OmegaConf.is_config(prompt) else (prompt or "")}
    source = from_model_config(cfg.model)
    model_id = str(cfg.get("served_model_name") or (source.name if cfg.model.get("path") else cfg.model.get("id")))
    lm = lm or load(str(source), o["device"], precision=o["precision"])
    max_bytes = int(o["max_request_mb"] * 2 ** 20)
    metrics = Metrics("gpt")
    tokens_out = metrics.add_counter("generated_tokens", "tokens generated")
    tokens_in = metrics.add_counter("prompt_tokens", "prompt tokens of admitted requests")
    engine = lm.engine(o["max_batch"])
    sampling = Sampling(o["temperature"], o["top_k"], o["top_p"], o["repetition_penalty"])
    if lm.model.xp is not np:       # compiles and captures every batch size, greedy and the defaults' sampling
        warm_up(engine, (GREEDY, sampling))
    app, worker = make_app("gpt", model_id, metrics, lambda: EngineWorker(engine, o["max_queue"], metrics),
                           cfg.get("api_key") or None)

    def parse(raw: bytes, loop: asyncio.AbstractEventLoop) -> tuple[CompletionRequest, EngineJob]:
        """The checked request and its job; a body past INLINE_BYTES in a thread (its parsing and
        tokenizing do not hold up the event loop, /health included), a small one at once (no
        hand-off to a thread for the common request)."""
        req = CompletionRequest(_json_object(raw), defaults, lm, model_id, o["max_rows"])
        return req, EngineJob(requests(engine, req.ids, req.steps, req.sampling, req.seed, req.stop,
                                       lm.tokenizer, samples=req.n), loop)

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_body(request, max_bytes, "max_request_mb")
        loop = asyncio.get_running_loop()
        req, job = parse(raw, loop) if len(raw) <= INLINE_BYTES else await asyncio.to_thread(parse, raw, loop)
        rid, created = new_id("cmpl"), int(time.time())
        submit(worker(), job)
        tokens_in.inc(req.prompt_tokens)
        job.future.add_done_callback(
            lambda f: f.exception() or tokens_out.inc(sum(len(c.tokens) for c in _kept(req, f.result()))))
        if not req.stream:
            try:
                outs = _kept(req, await wait(request, job))
            except ClientGone:
                return error_response(499, "the client went away")
            except ValueError as e:
                raise APIError(400, str(e)) from None
            except Exception as e:  # noqa: BLE001 - the engine failed it: a server error, said as such
                raise APIError(500, str(e)) from None
            choices = []
            for i, c in enumerate(outs):
                head = req.prompt_texts[i // req.n] if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = _logprobs(lm.tokenizer, _prompt_places(req, i, c) if req.echo else [])
                    more = _logprobs(lm.tokenizer, list(zip(c.tokens, c.logprobs or [])),
                                     Offsets(lm.tokenizer, len(head)))
                    lp = {k: lp[k] + more[k] for k in lp}
                choices.append({"text": head + c.text, "index": i, "logprobs": lp, "finish_reason": c.finish_reason})
            return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                    "choices": choices, "usage": _usage(req, outs)}
        return StreamingResponse(_events(request, job, req, rid, created, model_id, lm.tokenizer),
                                 media_type="text/event-stream", headers={"cache-control": "no-cache"})

    def tokens(raw: bytes) -> dict:
        body = _json_object(raw)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string", "prompt")
        ids = lm.tokenizer.encode(_utf8("prompt", text)).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": lm.model.max_positions}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw = await read_body(request, max_bytes, "max_request_mb")
        return tokens(raw) if len(raw) <= INLINE_BYTES else await asyncio.to_thread(tokens, raw)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = _json_object(await read_body(request, max_bytes, "max_request_mb"))
        ids = body.get("tokens")
        vocab = lm.model.config.vocab_size
        if (not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                or not all(0 <= t < vocab for t in ids)):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": lm.tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = lm.tokenizer.id_to_token(lm.model.config.eos_token_id)
        return {"eos_token": eos, "bos_token": eos, "pad_token": None, "model_max_length": lm.model.max_positions,
                "tokenizer_class": "GPT2TokenizerFast"}

    return app, o


def _json_object(raw: bytes) -> dict:
    """A request body parsed, if it is a JSON object (else a 400)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "the body must be JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _kept(req: CompletionRequest, outs: list[Completion]) -> list[Completion]:
    """The completions as asked: with max_tokens 0 the token the prefill chose is dropped."""
    if req.max_tokens:
        return outs
    return [Completion(finish_reason="length", logprobs=[] if c.logprobs is not None else None,
                       prompt_logprobs=c.prompt_logprobs) for c in outs]


def _prompt_places(req: CompletionRequest, row: int, c: Completion) -> list[tuple[int, TokenLogprob | None]]:
    """(token id, its TokenLogprob or None) for each prompt token of row `row` (echo)."""
    ids = req.prompt_ids[row // req.n]
    return list(zip(ids, c.prompt_logprobs or [None] * len(ids)))


class Offsets:
    """Where each of a text's tokens begins in it, in characters, from `start`, as the text is
    decoded a token at a time: a character split over tokens is held back until complete, so
    each of its tokens begins where the character does; a token whose piece brings held-back
    text with it (a byte that never made a character) begins after that text."""

    def __init__(self, tokenizer, start: int = 0):
        self.stream, self.start = TextStream(tokenizer), start

    def next(self, token: int) -> int:
        """The offset of token."""
        before = len(self.stream.text)
        piece = self.stream.push(token)
        own = self.stream.tokenizer.decode([token], skip_special_tokens=False)
        return self.start + before + max(0, len(piece) - len(own))


def _logprobs(tokenizer, places: list[tuple[int, TokenLogprob | None]], offsets: Offsets | None = None) -> dict:
    """OpenAI's completions logprobs object for (token id, TokenLogprob or None) places: each
    token's name (runtime.token_name: its text, "bytes:\\xNN" for part of a character, the end
    token's own string), log-probability (null where there is none: an echoed prompt's first
    token), its alternatives {name: log-probability}, the token itself first (OpenAI's logprobs
    + 1), and its character offset in the choice's text (offsets: where the places' text begins)."""
    offsets = offsets or Offsets(tokenizer)
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in places:
        name = token_name(tokenizer, token)
        out["tokens"].append(name)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {name: lp.logprob,
                                                            **{token_name(tokenizer, t): v for t, v in lp.top}})
        out["text_offset"].append(offsets.next(token))
    return out


def _usage(req: CompletionRequest, outs: list[Completion]) -> dict:
    done = sum(len(c.tokens) for c in outs)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": done, "total_tokens": req.prompt_tokens + done}


async def _events(request: Request, job: Job, req: CompletionRequest, rid: str, created: int, model_id: str,
                  tokenizer):
    """Server-sent events in OpenAI's shape: text chunks, a last chunk per choice with its
    finish_reason, (usage when stream_options.include_usage), then data: [DONE]. A client that
    goes away cancels the job. With logprobs each chunk carries those of the tokens generated
    since the row's last chunk (a token whose text is held back, maybe part of a stop string,
    may come before its text)."""
    sent = [0] * len(req.ids)      # tokens of each row whose logprobs have gone out
    offsets = [Offsets(tokenizer, len(req.prompt_texts[i // req.n]) if req.echo else 0) for i in range(len(req.ids))]

    def scores(index: int) -> dict | None:
        """The logprobs of row index's tokens not yet sent (None when none were asked)."""
        if req.logprobs is None:
            return None
        c = job.requests[index].out
        if not req.max_tokens:
            return _logprobs(tokenizer, [])
        have = list(zip(c.tokens, c.logprobs or []))[sent[index]:]
        sent[index] += len(have)
        return _logprobs(tokenizer, have, offsets[index])

    def chunk(index: int, text: str, finish=None, logprobs=None) -> str:
        return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model_id,
                                      "choices": [{"text": text, "index": index, "logprobs": logprobs,
                                                   "finish_reason": finish}]}, ensure_ascii=False) + "\n\n"

    def ending() -> str:
        """The chunks after the last text: finish_reason per choice, usage, [DONE] (or the error)."""
        try:
            outs = _kept(req, job.future.result())
        except Exception as e:  # noqa: BLE001 - the headers are gone: said in the stream, a server error as unstreamed
            return "data: " + json.dumps(error_body(500, str(e))) + "\n\ndata: [DONE]\n\n"
        tail = [chunk(i, "", c.finish_reason, scores(i)) for i, c in enumerate(outs)]
        if req.include_usage:
            tail.append("data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                               "model": model_id, "choices": [], "usage": _usage(req, outs)}) + "\n\n")
        return "".join(tail) + "data: [DONE]\n\n"

    job.future.add_done_callback(lambda _: job.emit(None))     # after the last pieces: the end
    try:
        if req.echo:
            prompt_scores = None
            if req.logprobs is not None:    # the prompt's logprobs come with the first token's
                waited = 0
                while not job.future.done() and not all(r.out.prompt_logprobs is not None or r.finished
                                                        for r in job.requests):
                    waited += 1
                    if waited % 100 == 0 and await request.is_disconnected():
                        return          # queued and gone: the job is cancelled below
                    await asyncio.sleep(0.005)
                if job.future.done() and job.future.exception() is not None:
                    prompt_scores = [None] * len(req.ids)
                else:
                    prompt_scores = [_logprobs(tokenizer, _prompt_places(req, i, r.out))
                                     for i, r in enumerate(job.requests)]
            yield "".join(chunk(i, req.prompt_texts[i // req.n], None, prompt_scores and prompt_scores[i])
                          for i in range(len(req.ids)))
        ended = False
        while not ended:
            try:
                pieces = await asyncio.wait_for(job.items.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return
                continue
            ended = pieces is None
            pieces = pieces or []
            while not ended and not job.items.empty():      # every piece at hand in one write
                more = job.items.get_nowait()
                ended = more is None
                pieces += more or []
            # the last pieces and the ending in one write too: a wave of streams ending together
            # is that many sends fewer on the event loop
            if not req.max_tokens:      # the prefill's token is dropped, and its text
                pieces = []
            yield "".join(chunk(row, piece, None, scores(row)) for row, piece in pieces) + (ending() if ended else "")
    finally:
        if not job.future.done():
            job.cancel()


def run(cfg: DictConfig) -> None:
    app, o = build_app(cfg)
    run_server(app, o, cfg.get("log_level"))


@hydra.main(version_base=None, config_path=config_dir("gpt"), config_name="serve")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


def main() -> None:
    run_hydra(_hydra_main)


if __name__ == "__main__":
    main()
