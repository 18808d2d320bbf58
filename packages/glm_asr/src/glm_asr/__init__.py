"""GLM-ASR speech recognition on tilekernels."""
