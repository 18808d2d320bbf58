"""Text <-> token ids with the `tokenizers` library, and streaming detokenisation."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError


def load_tokenizer(directory: Path):
    """A tokenizers.Tokenizer from tokenizer.json, or GPT-2's original vocab.json + merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        if (directory / "tokenizer.json").exists():
            return Tokenizer.from_file(str(directory / "tokenizer.json"))
        if (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
            tok = Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            return tok
    except Exception as e:
        raise CheckpointError(f"{directory}: unreadable tokenizer ({e})") from None
    raise CheckpointError(f"{directory}: no tokenizer.json (or vocab.json + merges.txt)")


class TextStream:
    """Turns one sequence's token ids into text pieces as they come; a multi-byte
    character split over several tokens is held back until it is complete."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=False)
        self.text = ""

    def push(self, token: int) -> str:
        piece = self.stream.step(self.tokenizer, int(token)) or ""
        self.text += piece
        return piece
