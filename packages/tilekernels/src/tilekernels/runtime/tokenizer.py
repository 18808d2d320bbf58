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
    character split over several tokens is held back until it is complete. skip_special_tokens:
    as the tokenizer's decode."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def push(self, token: int) -> str:
        piece = self.stream.step(self.tokenizer, int(token)) or ""
        self.text += piece
        return piece


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in bs}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()
_NAMING: dict[int, tuple] = {}      # id(tokenizer) -> (tokenizer, byte-level?, special token ids)


def token_name(tokenizer, token: int) -> str:
    """One token as OpenAI's completions logprobs name it: its text; a special token its own
    string (<|endoftext|>); a byte-level piece that is no text alone (part of a character)
    'bytes:' and its bytes as \\xNN escapes, so that no two tokens share a name (a lone byte's
    text, U+FFFD, would be every such token's)."""
    from tokenizers import decoders

    entry = _NAMING.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        entry = _NAMING[id(tokenizer)] = (tokenizer, isinstance(tokenizer.decoder, decoders.ByteLevel), special)
    _, byte_level, special = entry
    piece = tokenizer.id_to_token(int(token))
    if int(token) in special:
        return piece
    if byte_level and piece and all(c in _BYTE_OF_CHAR for c in piece):
        raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tokenizer.decode([int(token)])
