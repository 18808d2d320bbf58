"""Text in, text out: GPT-2 prompts encoded (an empty one starts from <|endoftext|>, as GPT-2
does), each repeated num_samples times, continued by the runtime's token loop."""
from __future__ import annotations

from typing import Callable, Sequence

from tilekernels.runtime import GREEDY, Completion, ModelRunner, Sampling
from tilekernels.runtime import generate as run_tokens
from tilekernels.runtime.generation import MAX_BATCH

from .model import GPT


def encode(tokenizer, prompts: list, eos: int) -> list[list[int]]:
    """Token ids of each prompt (a string, or already a list of ids); empty ones become [eos]."""
    return [(tokenizer.encode(p).ids if isinstance(p, str) else list(p)) or [eos] for p in prompts]


def generate(model: GPT, tokenizer, prompts: list, max_new_tokens: int, sampling: Sampling = GREEDY,
             seed: int | None = None, num_samples: int = 1, stop: Sequence[str] | str = (),
             on_text: Callable[[int, str], None] | None = None, max_batch: int = MAX_BATCH,
             runner: ModelRunner | None = None) -> list[Completion]:
    """num_samples completions of every prompt (prompt-major order), max_batch rows at a time;
    on_text(i, piece) streams completion i's text (see tilekernels.runtime.generate)."""
    ids = [p for p in encode(tokenizer, prompts, model.config.eos_token_id) for _ in range(num_samples)]
    return run_tokens(runner or ModelRunner(model), ids, max_new_tokens, sampling, seed, stop, tokenizer,
                      on_text, max_batch=max_batch)
