"""python -m gpt.generate: GPT-2 text generation from the command line (Hydra app).

    python -m gpt.generate prompt="To be, or not to be" max_new_tokens=60
    python -m gpt.generate model=gpt2 prompt="Hello" temperature=0 device=gpu
    python -m gpt.generate model.path=/path/to/checkpoint prompt_file=prompt.txt
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from tilekernels.runtime import Sampling, check_length, from_model_config, load_tokenizer, pick_device
from tilekernels.runtime.cli import Float, Int, OptInt, OptStr, Str, config_dir, exit_with_one_line_errors, options

from .generation import encode, generate
from .model import GPT

DATA = Path(__file__).resolve().parent / "data"
OmegaConf.register_new_resolver("gpt_data", lambda name: str(DATA / name), replace=True)


def read_prompts(prompt, prompt_file: str | None) -> list[str]:
    if prompt_file:
        try:
            return [Path(prompt_file).expanduser().read_text()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"prompt_file {prompt_file}: cannot read ({e.__class__.__name__}: "
                             f"{getattr(e, 'strerror', None) or e})") from None
    if isinstance(prompt, ListConfig):
        return [str(p) for p in prompt] or [""]
    return ["" if prompt is None else str(prompt)]


def stop_strings(stop) -> list[str]:
    """stop=Sir is one stop string; stop='[a,b]' a list of them."""
    if stop is None:
        return []
    return [str(s) for s in stop] if isinstance(stop, ListConfig) else [str(stop)]


def run(cfg: DictConfig) -> None:
    o = options(cfg, {"max_new_tokens": Int, "temperature": Float, "top_k": Int, "top_p": Float,
                      "repetition_penalty": Float, "seed": OptInt, "num_samples": Int, "max_batch": Int,
                      "prompt_file": OptStr, "device": Str})
    sampling = Sampling(o["temperature"], o["top_k"], o["top_p"], o["repetition_penalty"])
    for name in ("max_new_tokens", "num_samples", "max_batch"):
        if o[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {o[name]}")
    prompts = read_prompts(cfg.prompt, o["prompt_file"])
    stop = stop_strings(cfg.stop)
    directory = from_model_config(cfg.model)
    model, tokenizer = GPT.load(directory, pick_device(o["device"])), load_tokenizer(directory)
    check_length(model, max(len(i) for i in encode(tokenizer, prompts, model.config.eos_token_id)),
                 o["max_new_tokens"])        # before anything is written
    single = len(prompts) * o["num_samples"] == 1
    if single:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()

    def stream(i: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    outs = generate(model, tokenizer, prompts, o["max_new_tokens"], sampling, o["seed"], o["num_samples"], stop,
                    on_text=stream if single else None, max_batch=o["max_batch"])
    if single:
        sys.stdout.write("\n")
    else:
        for i, out in enumerate(outs):
            sys.stdout.write(f"--- sample {i + 1} ---\n{prompts[i // o['num_samples']]}{out.text}\n")


@hydra.main(version_base=None, config_path=config_dir("gpt"), config_name="generate")
def main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


if __name__ == "__main__":
    main()
