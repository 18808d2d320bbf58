"""python -m glm_asr.bulk manifest=FILE|DIR output_dir=DIR [key=value ...]

Bulk transcription on Dask distributed: a manifest of audio files, one transcript per file in
output_dir (the names `python -m glm_asr.transcribe ... output_dir=DIR` gives), written by the
workers as each file is done, so a re-run skips what exists and a crash costs only what was missing.

    python -m glm_asr.bulk manifest=files.txt output_dir=out                # a worker per local GPU
    python -m glm_asr.bulk manifest=/archive glob='**/*.flac' output_dir=out output_format=srt
    python -m glm_asr.bulk manifest=files.txt output_dir=out scheduler=tcp://head:8786
    python -m glm_asr.bulk --overhead 10000     # the scheduler's cost per task (docs/scaling.md)

Each worker process loads the model once (kept in bulk.worker, keyed by model and device) and
runs the files of the tasks it is given through one batched pipeline: a local worker runs two
tasks at once (a `dask worker` started with --nthreads 2 does too), so the next task's files are
read and encoded while the last one's still decode. Tasks are one file, or short ones making about
task_seconds of audio (a batch's worth by default), submitted longest first with falling
priority, at most WINDOW in flight: a fast worker takes more of them (Dask's queuing and work
stealing). A task returns, for each file, its output name, audio seconds and error (None when
written). A worker that dies takes its tasks with it and Dask runs them again elsewhere; outputs
are written atomically under fixed names, so no transcript is lost, duplicated or half written. Unreadable files go to
output_dir/errors.jsonl ({"path", "reason"} per line) and the run goes on (exit code 1).
"""
from .cli import check_options, main, run
from .cluster import drive, local_cluster, task_overhead, visible_gpus, worker_plan
from .manifest import plan_tasks, probe_duration, read_manifest
from .progress import ERRORS
from .worker import prepare, transcribe_files

__all__ = ["ERRORS", "check_options", "drive", "local_cluster", "main", "plan_tasks", "prepare", "probe_duration",
           "read_manifest", "run", "task_overhead", "transcribe_files", "visible_gpus", "worker_plan"]
