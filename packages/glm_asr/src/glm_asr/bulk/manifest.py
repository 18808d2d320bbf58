"""A bulk run's manifest: the paths it names, their durations from the headers, and the tasks they
make (one long file, or short ones grouped to about task_seconds of audio)."""
from __future__ import annotations

from pathlib import Path

from ..audio import EXTENSIONS

MAX_GROUP = 100         # files in one task at most


def read_manifest(manifest: str | Path, glob: str = "**/*", extensions=EXTENSIONS) -> list[str]:
    """The audio paths a manifest names, in order. A text file: one path a line, blank lines and
    lines starting with # skipped, relative paths taken relative to the file's folder. A directory:
    the files under it that glob matches whose suffix is one of extensions (any case; empty: any
    suffix), hidden files (.name) left out, sorted."""
    m = Path(manifest)
    if not m.exists():
        raise ValueError(f"manifest {manifest}: no such file or directory")
    if m.is_dir():
        exts = {e.lower().lstrip(".") for e in (extensions or ())}
        try:
            found = [p for p in m.glob(glob) if p.is_file() and not p.name.startswith(".")
                     and (not exts or p.suffix.lower().lstrip(".") in exts)]
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"glob {glob!r}: {e}") from None
        return sorted(str(p) for p in found)
    try:
        text = m.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"manifest {manifest}: not a UTF-8 text file of paths") from None
    paths = []
    for line in text.splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#"):
            p = Path(entry).expanduser()
            paths.append(str(p if p.is_absolute() else m.parent / p))
    return paths


def probe_duration(path: str) -> float:
    """Seconds of audio in a file from its header (libsndfile, else the container's via PyAV);
    0.0 when unknown (a missing or unreadable file: the worker reports it)."""
    try:
        import soundfile

        return float(soundfile.info(path).duration)
    except Exception:
        pass
    try:
        import av

        with av.open(path) as c:
            return max(0.0, float(c.duration or 0) / 1e6)
    except Exception:
        return 0.0


def plan_tasks(durations: list[float], task_seconds: float) -> list[list[int]]:
    """Tasks (lists of indices into durations), longest first. A file of task_seconds or more is a
    task of its own; shorter ones are grouped, in falling length, until a group holds task_seconds
    of audio (or MAX_GROUP files); files of unknown length (0) come last, one a task."""
    order = sorted(range(len(durations)), key=lambda i: -durations[i])      # stable: ties in manifest order
    tasks, group, acc = [], [], 0.0
    for i in (i for i in order if durations[i] > 0):
        if durations[i] >= task_seconds:
            tasks.append([i])
            continue
        group.append(i)
        acc += durations[i]
        if acc >= task_seconds or len(group) >= MAX_GROUP:
            tasks.append(group)
            group, acc = [], 0.0
    if group:
        tasks.append(group)
    return tasks + [[i] for i in order if durations[i] <= 0]
