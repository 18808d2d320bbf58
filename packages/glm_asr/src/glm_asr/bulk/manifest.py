"""A bulk run's manifest: the paths it names, their durations from the headers, and the tasks they
make (one long file, or short ones grouped to about task_seconds of audio)."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from ..audio import EXTENSIONS
from ..formats import output_names, write_atomic

MAX_GROUP = 100         # files in one task at most
NAMES = ".glm_asr-bulk-names.json"      # in output_dir: which source each output name was given to


def kept_names(sources: list[str], fmt: str, out_dir: Path) -> list[str]:
    """Each source's output name in out_dir, the same from run to run whatever the manifest
    became: a source keeps the name an earlier run gave it (NAMES records them, per format);
    a new one gets formats.output_names', or if another source of this manifest holds that, the
    next free <stem>-<n>. So a resumed run never takes another listed file's transcript for a new
    file's; a name whose source has left the manifest goes to whoever gets it now (a corpus
    moved elsewhere keeps its outputs). A repeated path's k-th occurrence is its own source."""
    path = out_dir / NAMES
    try:
        every = json.loads(path.read_text(encoding="utf-8"))
        recorded = every.get(fmt, {}) if isinstance(every, dict) else {}
    except (OSError, ValueError):
        every, recorded = {}, {}
    seen = Counter()
    keys = []
    for s in sources:
        a = os.path.abspath(s)
        keys.append(a if not seen[a] else f"{a}#{seen[a]}")
        seen[a] += 1
    present = set(keys)
    owners = {n: k for k, n in recorded.items() if k in present}
    names, taken = [], set()
    for source, key, fresh in zip(sources, keys, output_names(sources, fmt)):
        name = recorded.get(key)
        if name is None:
            name, n = fresh, 0
            stem = "stdin" if source == "-" else Path(source).stem
            while owners.get(name, key) != key or name in taken:
                n += 1
                name = f"{stem}-{n}.{fmt}"
        names.append(name)
        taken.add(name)
    if any(recorded.get(k) != n for k, n in zip(keys, names)):
        mine = dict(zip(keys, names))
        kept = {k: n for k, n in recorded.items() if k not in mine and n not in taken}    # names handed on leave
        write_atomic(path, json.dumps({**every, fmt: {**kept, **mine}}, ensure_ascii=False))
    return names


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
        text = m.read_text(encoding="utf-8-sig")      # a BOM (Windows editors) is not part of the first path
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
