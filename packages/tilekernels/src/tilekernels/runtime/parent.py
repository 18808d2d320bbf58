"""Worker processes that end with the process that started them.

A parent killed outright (SIGKILL, or a signal re-raised after its own shutdown) runs no cleanup,
so its workers are never told to stop: a pool's workers wait on a queue whose write end they hold
themselves, and live on as orphans. watch_parent makes such a process notice and exit.
"""
from __future__ import annotations

import os
import threading
import time

_WATCHING: list[int] = []      # the pid the watch was started in: once a process


def watch_parent(parent: int | None = None, poll_s: float = 0.5) -> None:
    """Exit this process (os._exit(1): no cleanup can be trusted once the parent is gone) when its
    parent dies, as a daemon thread that polls os.getppid() every poll_s seconds. parent: the
    parent's pid (default: os.getppid() now; the pid the parent gave, so that a parent gone before
    this call is noticed too). Once a process; later calls do nothing."""
    if _WATCHING == [os.getpid()]:
        return
    _WATCHING[:] = [os.getpid()]
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()
