"""python -m gpt.serve [key=value ...]: an OpenAI-compatible completions server (FastAPI on uvicorn).

    python -m gpt.serve model=gpt2 port=8000 device=gpu
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "gpt2", "prompt": "Hello", "max_tokens": 20, "temperature": 0}'

POST /v1/completions (prompt: a string, a list of them, token ids or a list of those; max_tokens,
temperature, top_p, top_k and repetition_penalty (extensions), n, stop, seed, stream (server-sent
events), echo; logprobs, suffix, best_of != n, logit_bias and nonzero presence/frequency penalties
are refused with 400), GET /v1/models, /health, /metrics. Every option of python -m gpt.generate is
the default of the matching request field (max_new_tokens -> max_tokens, num_samples -> n).
Every request's rows join the engine's running batch (EngineWorker): concurrent requests share each
decode step, and each gets what python -m gpt.generate gives for it (same seeds, the engine's
tokens do not depend on the batch).
"""
from __future__ import annotations

import asyncio
import json
import time

import hydra
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from omegaconf import DictConfig, OmegaConf

from tilekernels.runtime import GREEDY, Completion, Sampling, check_length, from_model_config, requests, warm_up
from tilekernels.runtime.cli import Float, Int, OptInt, Str, config_dir, exit_with_one_line_errors, options

from tilekernels.runtime.server import (APIError, ClientGone, EngineJob, EngineWorker, Job, Metrics, check_model,
                                        make_app, new_id, serve, submit, wait)

from . import generate as _cli  # noqa: F401  (registers the gpt_data resolver the model configs use)
from .api import GPTError, LanguageModel, load
from .generate import stop_strings

UNSUPPORTED = {"logprobs": "logprobs are not supported", "suffix": "suffix (insertion) is not supported",
               "logit_bias": "logit_bias is not supported"}


class CompletionRequest:
    """A checked /v1/completions body: token ids per row (prompt-major, n rows per prompt)."""

    def __init__(self, body: dict, defaults: dict, lm: LanguageModel, model_id: str):
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        check_model(body.get("model"), model_id)
        for name, why in UNSUPPORTED.items():
            if body.get(name) not in (None, {}, "", False):
                raise APIError(400, why, name, "unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (repetition_penalty is)", name, "unsupported_parameter")

        def get(name, default, kind):
            v = body.get(name)
            if v is None:
                return default
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise APIError(400, f"{name} must be an integer, got {v!r}", name)
            if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise APIError(400, f"{name} must be a number, got {v!r}", name)
            if kind is bool and not isinstance(v, bool):
                raise APIError(400, f"{name} must be true or false, got {v!r}", name)
            return v

        self.max_tokens = get("max_tokens", defaults["max_new_tokens"], int)
        self.temperature = float(get("temperature", defaults["temperature"], float))
        self.top_p = float(get("top_p", defaults["top_p"], float))
        self.top_k = get("top_k", defaults["top_k"], int)
        self.repetition_penalty = float(get("repetition_penalty", defaults["repetition_penalty"], float))
        self.n = get("n", defaults["num_samples"], int)
        self.seed = get("seed", defaults["seed"], int)
        self.stream = get("stream", False, bool)
        self.echo = get("echo", False, bool)
        best_of = get("best_of", None, int)
        if best_of is not None and best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of", "unsupported_parameter")
        so = body.get("stream_options") or {}
        self.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        for name, v, low in (("max_tokens", self.max_tokens, 1), ("n", self.n, 1)):
            if v < low:
                raise APIError(400, f"{name} must be >= {low}, got {v}", name)
        stop = body.get("stop", None)
        if stop is None:
            stop = defaults["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        self.stop = [s for s in stop if s]
        prompt = body.get("prompt", None)
        if prompt is None:
            prompt = defaults["prompt"]
        self.prompts = _prompts(prompt)
        with _bad_request():
            ids, self.sampling = lm._request(self.prompts, self.max_tokens, self.temperature, self.top_k, self.top_p,
                                             self.repetition_penalty, self.n)
            check_length(lm.model, max(len(i) for i in ids), self.max_tokens)
        self.ids = ids
        self.prompt_texts = [p if isinstance(p, str) else lm.tokenizer.decode(list(p)) for p in self.prompts]
        self.prompt_tokens = sum(len(i) for i in ids[::self.n])


class _bad_request:
    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and isinstance(e, (GPTError, ValueError, OverflowError)):
            raise APIError(400, str(e)) from None
        return False


def _prompts(prompt) -> list:
    """A string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return prompt
    raise APIError(400, "prompt must be a string, a list of strings, token ids or a list of token id lists",
                   "prompt")


def build_app(cfg: DictConfig, lm: LanguageModel | None = None):
    o = options(cfg, {"host": Str, "port": Int, "max_queue": Int, "max_batch": Int, "max_upload_mb": Float,
                      "max_new_tokens": Int, "temperature": Float, "top_k": Int, "top_p": Float,
                      "repetition_penalty": Float, "seed": OptInt, "num_samples": Int, "device": Str,
                      "precision": Str})
    if o["max_queue"] < 0:
        raise ValueError(f"max_queue must be >= 0, got {o['max_queue']}")
    if o["max_batch"] < 1:
        raise ValueError(f"max_batch must be >= 1, got {o['max_batch']}")
    prompt = cfg.get("prompt")
    defaults = {**o, "stop": stop_strings(cfg.get("stop")),
                "prompt": OmegaConf.to_container(prompt) if OmegaConf.is_config(prompt) else (prompt or "")}
    source = from_model_config(cfg.model)
    model_id = str(cfg.get("served_model_name") or (source.name if cfg.model.get("path") else cfg.model.get("id")))
    lm = lm or load(str(source), o["device"], precision=o["precision"])
    metrics = Metrics("gpt")
    tokens_out = metrics.add_counter("generated_tokens", "tokens generated")
    tokens_in = metrics.add_counter("prompt_tokens", "prompt tokens of admitted requests")
    engine = lm.engine(o["max_batch"])
    if lm.model.xp is not np:       # compiles and captures every batch size, greedy and the defaults' sampling
        warm_up(engine, (GREEDY, Sampling(o["temperature"], o["top_k"], o["top_p"], o["repetition_penalty"])))
    app, worker = make_app("gpt", model_id, metrics, lambda: EngineWorker(engine, o["max_queue"], metrics),
                           cfg.get("api_key") or None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the body must be JSON") from None
        req = CompletionRequest(body, defaults, lm, model_id)
        tokens_in.inc(req.prompt_tokens)
        rid, created = new_id("cmpl"), int(time.time())

        job = submit(worker(), EngineJob(requests(engine, req.ids, req.max_tokens, req.sampling, req.seed, req.stop,
                                                  lm.tokenizer)))
        job.future.add_done_callback(
            lambda f: f.exception() or tokens_out.inc(sum(len(c.tokens) for c in f.result())))
        if not req.stream:
            try:
                outs = await wait(request, job)
            except ClientGone:
                return JSONResponse({}, status_code=499)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            choices = [{"text": (req.prompt_texts[i // req.n] if req.echo else "") + c.text, "index": i,
                        "logprobs": None, "finish_reason": c.finish_reason} for i, c in enumerate(outs)]
            return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                    "choices": choices, "usage": _usage(req, outs)}
        return StreamingResponse(_events(request, job, req, rid, created, model_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return app, o


def _usage(req: CompletionRequest, outs: list[Completion]) -> dict:
    done = sum(len(c.tokens) for c in outs)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": done, "total_tokens": req.prompt_tokens + done}


async def _events(request: Request, job: Job, req: CompletionRequest, rid: str, created: int, model_id: str):
    """Server-sent events in OpenAI's shape: text chunks, a last chunk per choice with its
    finish_reason, (usage when stream_options.include_usage), then data: [DONE]. A client that
    goes away cancels the job."""
    def chunk(index: int, text: str, finish=None) -> str:
        return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model_id,
                                      "choices": [{"text": text, "index": index, "logprobs": None,
                                                   "finish_reason": finish}]}, ensure_ascii=False) + "\n\n"

    def ending() -> str:
        """The chunks after the last text: finish_reason per choice, usage, [DONE] (or the error)."""
        try:
            outs = job.future.result()
        except Exception as e:  # noqa: BLE001 - the headers are gone: report it in the stream
            return "data: " + json.dumps({"error": {"message": str(e), "type": "invalid_request_error",
                                                    "param": None, "code": None}}) + "\n\ndata: [DONE]\n\n"
        tail = [chunk(i, "", c.finish_reason) for i, c in enumerate(outs)]
        if req.include_usage:
            tail.append("data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                               "model": model_id, "choices": [], "usage": _usage(req, outs)}) + "\n\n")
        return "".join(tail) + "data: [DONE]\n\n"

    job.future.add_done_callback(lambda _: job.emit(None))     # after the last pieces: the end
    try:
        if req.echo:
            yield "".join(chunk(i, req.prompt_texts[i // req.n]) for i in range(len(req.ids)))
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
            yield "".join(chunk(row, piece) for row, piece in pieces) + (ending() if ended else "")
    finally:
        if not job.future.done():
            job.cancel()


def run(cfg: DictConfig) -> None:
    app, o = build_app(cfg)
    serve(app, o["host"], o["port"], str(cfg.get("log_level") or "info"))


@hydra.main(version_base=None, config_path=config_dir("gpt"), config_name="serve")
def main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


if __name__ == "__main__":
    main()
