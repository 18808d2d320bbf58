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

from .checkpoint import from_model_config
from .device import exit_with_one_line_errors, pick_device
from .generation import generate
from .model import GPT
from .sampling import Sampling
from .tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parent / "data"
CONFIGS = Path(__file__).resolve().parents[4] / "configs" / "gpt"
OmegaConf.register_new_resolver("gpt_data", lambda name: str(DATA / name), replace=True)


def load(model_cfg: DictConfig, device: str):
    """(model, tokenizer) from a model config: a local path, else a hub id."""
    directory = from_model_config(model_cfg)
    return GPT.load(directory, device), load_tokenizer(directory)


def read_prompts(cfg: DictConfig) -> list[str]:
    if cfg.prompt_file:
        try:
            return [Path(cfg.prompt_file).expanduser().read_text()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"prompt_file {cfg.prompt_file}: cannot read ({e.__class__.__name__}: "
                             f"{getattr(e, 'strerror', None) or e})") from None
    if isinstance(cfg.prompt, ListConfig):
        return [str(p) for p in cfg.prompt] or [""]
    return [str(cfg.prompt)]


def run(cfg: DictConfig) -> None:
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p), float(cfg.repetition_penalty))
    if cfg.max_new_tokens < 1 or cfg.num_samples < 1:
        raise ValueError("max_new_tokens and num_samples must be >= 1")
    prompts = read_prompts(cfg)
    model, tokenizer = load(cfg.model, pick_device(cfg.device))
    stop = [str(s) for s in cfg.stop]
    single = len(prompts) * cfg.num_samples == 1
    if single:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()

    def stream(i: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    outs = generate(model, tokenizer, prompts, int(cfg.max_new_tokens), sampling, cfg.seed,
                    int(cfg.num_samples), stop, on_text=stream if single else None)
    if single:
        sys.stdout.write("\n")
    else:
        for i, o in enumerate(outs):
            sys.stdout.write(f"--- sample {i + 1} ---\n{o.prompt}{o.text}\n")


@hydra.main(version_base=None, config_path=str(CONFIGS), config_name="generate")
def main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


if __name__ == "__main__":
    main()
