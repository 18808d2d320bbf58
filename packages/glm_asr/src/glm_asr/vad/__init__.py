"""Voice activity detection with Silero VAD (MIT, github.com/snakers4/silero-vad; its license is
data/LICENSE.silero-vad), its network written here against tilekernels' ops (linear, lstm: numpy
on the CPU, cuTile on the GPU; the weights converted from its ONNX file by
tools/convert_silero.py; probabilities within 5e-6 of onnxruntime's on the CPU, 1e-4 on the GPU),
and the speech segments (at most one 30 s encoder window each) that the recogniser decodes
instead of fixed windows.

speech_probs: one speech probability per 32 ms frame (512 samples at 16 kHz); device_probs: those
of many files at once on the GPU (queue_probs: queued, answered once the GPU has them). The model
is a streaming one: each step takes a frame prefixed by the last 64 samples of the one before (its
context) and the LSTM state the step before left.
Everything before the LSTM sees that frame only, so the frames are encoded many at once; only the
LSTM steps, its rows (blocks) together. A file is cut into blocks of BLOCK_S at its multiples,
run side by side (rows of one step, on the CPU such groups in a thread pool: numpy's products
release the GIL); every block but the first starts WARMUP_S earlier with a fresh state and its
first WARMUP_S of probabilities are dropped. Anchored so, a frame's probability depends only on
the audio from its block's warm-up to it: a file streamed in chunks and a live stream
(LiveVad, frame by frame as the audio arrives) get the file's probabilities and segments (on the
CPU within 1e-5, not to the bit: numpy's products add in an order that follows how many rows
share them, so an edge can move a frame where a probability lies that close to a threshold). The
reset is not forgotten that soon (Silero's state moves probabilities at speech edges for minutes
after it), but the speech found is the same: regions within a frame or two, segments within
0.1 s of one sequential pass (tests/asr/test_vad.py).

speech_segments: the speech regions (threshold hysteresis as Silero's get_speech_timestamps)
that pauses shorter than min_silence_duration_ms separate are merged into segments of at most
max_speech_duration_s. A longer group is cut in pauses: the shortest pause cut in is as long as
it can be, then the segments are as few as can be, then the pauses cut in are as long as can be
(a group that fits in two segments with a cut in its longest pause is cut there alone). A region
with no pause longer than max_speech_duration_s is cut at its least speech-like frames. A group
longer than CHAPTER_S (2 minutes) is first cut into chapters at pauses near that length (or,
with none there, inside the speech at its least speech-like frame), each cut as above: speech
with no long pause, or none at all, is final a chapter at a time (segments.chapters). Segment
start/end are the speech bounds (what is written); the audio range given to the model adds
speech_pad_ms each side, never past the middle of the pause to the next segment, the file's
ends or max_speech_duration_s in all.
"""
from .model import (BATCH, BLOCK_S, CHUNK, CONTEXT, DEVICE_FRAMES, MODEL_PATH, STATE, WARMUP_S, block_frames,
                    device_probs, queue_probs, speech_probs, speech_segments, weights)
from .segments import FRAME, MAX_WINDOW_S, SAMPLE_RATE, Segment, VadOptions, segments_from_probs, speech_regions
from .live import LiveVad, Speech
from .workers import (AHEAD, PROCESSES, STREAM_CHUNK, PendingProbs, chunk_probs, pooled_probs, start_workers,
                      stop_workers, stream_probs)

__all__ = ["AHEAD", "BATCH", "BLOCK_S", "CHUNK", "CONTEXT", "DEVICE_FRAMES", "FRAME", "LiveVad", "MAX_WINDOW_S",
           "MODEL_PATH", "PendingProbs", "PROCESSES", "SAMPLE_RATE", "STATE", "STREAM_CHUNK", "Speech", "WARMUP_S",
           "Segment", "VadOptions", "block_frames", "chunk_probs", "device_probs", "pooled_probs", "queue_probs",
           "segments_from_probs",
           "speech_probs", "speech_regions", "speech_segments", "start_workers", "stop_workers", "stream_probs",
           "weights"]
