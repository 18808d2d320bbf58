"""GPT-2 text generation on tilekernels: `gpt.load(...)` from Python, `python -m gpt.generate`
from the command line."""
from .api import GPTError, LanguageModel, load

__all__ = ["GPTError", "LanguageModel", "load"]
