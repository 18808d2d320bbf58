"""GPT-2 text generation on tilekernels."""
