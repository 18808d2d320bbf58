"""GLM-ASR speech recognition on tilekernels: `glm_asr.load(...)` from Python,
`python -m glm_asr.transcribe` from the command line."""
from .api import ASRError, Segment, SpeechRecognizer, Transcript, load

__all__ = ["ASRError", "Segment", "SpeechRecognizer", "Transcript", "load"]
