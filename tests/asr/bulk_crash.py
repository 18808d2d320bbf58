"""A Dask worker plugin for the bulk tests: the first worker about to write an output whose name is
a file in crash_dir removes that marker and exits at once (each marker once), as a worker killed
mid-task would. Registered by the test's client, so nothing of it ships in glm_asr.bulk; the
workers import it by name (the test puts this folder on their PYTHONPATH)."""
import os

from distributed import WorkerPlugin


class CrashBeforeWriting(WorkerPlugin):
    name = "crash-before-writing"

    def __init__(self, crash_dir: str):
        self.crash_dir = crash_dir

    def setup(self, worker) -> None:
        from glm_asr.bulk import worker as bulk_worker

        write, crash_dir = bulk_worker.write_atomic, self.crash_dir

        def write_or_die(path, text):
            try:
                os.unlink(os.path.join(crash_dir, os.path.basename(str(path))))
            except FileNotFoundError:
                return write(path, text)
            os._exit(17)

        bulk_worker.write_atomic = write_or_die
