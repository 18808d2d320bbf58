"""python -m gpt.generate: GPT-2 text generation from the command line (Hydra app).

    python -m gpt.generate prompt="To be, or not to be" max_new_tokens=60
    python -m gpt.generate model=gpt2 prompt="Hello" temperature=0 device=gpu
    python -m gpt.generate model.path=/path/to/checkpoint prompt_file=prompt.txt
"""
from __future__ import annotations

import stat
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from tilekernels.runtime import from_model_config
from tilekernels.runtime.cli import (Bool, Device, Float, Int, OptInt, OptStr, Precision, config_dir,
                                     exit_with_one_line_errors, options, profile_at_exit, run_hydra)
from tilekernels.runtime.profile import mark
from tilekernels.runtime.sampler import INT32_MAX, MAX_PENALTY, MAX_SEED, MAX_TEMPERATURE

from .api import load

DATA = Path(__file__).resolve().parent / "data"
OmegaConf.register_new_resolver("gpt_data", lambda name: str(DATA / name), replace=True)


MAX_PROMPT_FILE = 16 * 2 ** 20
# the options generate and serve share (serve: each request's defaults), as Sampling takes them
SHARED_OPTIONS = {"max_new_tokens": Int(min=1), "temperature": Float(min=0, max=MAX_TEMPERATURE),
                  "top_k": Int(min=0, max=INT32_MAX), "top_p": Float(gt=0, max=1),
                  "repetition_penalty": Float(min=1 / MAX_PENALTY, max=MAX_PENALTY),
                  "seed": OptInt(min=0, max=MAX_SEED),
                  "num_samples": Int(min=1), "max_batch": Int(min=1), "device": Device, "precision": Precision}
GENERATE_OPTIONS = {**SHARED_OPTIONS, "prompt_file": OptStr, "profile": Bool}


def read_prompts(prompt, prompt_file: str | None) -> list[str]:
    """The prompts: prompt_file's lines (one prompt a line, blank lines skipped, a literal \\n in a
    line a newline; a regular file of at most 16 MB), else the prompt option (a string or a list)."""
    if prompt_file:
        path = Path(prompt_file).expanduser()
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"prompt_file {prompt_file}: not a regular file")
            if st.st_size > MAX_PROMPT_FILE:
                raise ValueError(f"prompt_file {prompt_file}: larger than {MAX_PROMPT_FILE >> 20} MB")
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"prompt_file {prompt_file}: cannot read ({e.__class__.__name__}: "
                             f"{getattr(e, 'strerror', None) or e})") from None
        prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompt_file {prompt_file}: no prompt in it (one a line)")
        return prompts
    if isinstance(prompt, ListConfig):
        return [str(p) for p in prompt] or [""]
    return ["" if prompt is None else str(prompt)]


def stop_strings(stop) -> list[str]:
    """stop=Sir is one stop string; stop='[a,b]' a list of them; a literal \\n in one is a newline
    (as in prompt_file: a shell passes none), so stop='["\\n\\n",Sir]' stops at a blank line."""
    if stop is None:
        return []
    return [str(s).replace("\\n", "\n") for s in (stop if isinstance(stop, ListConfig) else [stop])]


def run(cfg: DictConfig) -> None:
    o = options(cfg, GENERATE_OPTIONS)
    profile_at_exit(o["profile"])
    mark("options read")
    prompts = read_prompts(cfg.prompt, o["prompt_file"])
    lm = load(str(from_model_config(cfg.model)), o["device"], precision=o["precision"])
    mark("model loaded")
    settings = {k: o[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed")}
    if len(prompts) * o["num_samples"] == 1:
        pieces = lm.stream(prompts[0], stop=stop_strings(cfg.stop), **settings)
        first = next(pieces, "")            # a bad value or a too-long prompt fails here, before any output
        mark("first token")
        for piece in (prompts[0], first, *pieces):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    outs = lm.generate(prompts, num_samples=o["num_samples"], stop=stop_strings(cfg.stop), max_batch=o["max_batch"],
                       **settings)
    mark("completions done")
    for i, out in enumerate(outs):
        sys.stdout.write(f"--- sample {i + 1} ---\n{prompts[i // o['num_samples']]}{out.text}\n")


@hydra.main(version_base=None, config_path=config_dir("gpt"), config_name="generate")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


def main() -> None:
    run_hydra(_hydra_main)


if __name__ == "__main__":
    main()
