"""Transcript output: plain text, JSON, SubRip (srt) and WebVTT, one segment per window."""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path

from .subtitles import MAX_DURATION_S, MAX_LINES, MAX_WIDTH, cues, join_text

FORMATS = ("txt", "json", "srt", "vtt")
UMASK = os.umask(0o022)     # the process's, read once here (reading it sets it: not from threads)
os.umask(UMASK)


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(fmt: str, source: str, segments: list[dict], json_line: bool = False, windows: bool = False,
           max_width: int = MAX_WIDTH, max_lines: int = MAX_LINES) -> str:
    """One file's transcript in fmt; json_line: its JSON on one line (JSON Lines, several files on
    one stream). The text is the segments' joined with CJK-aware spacing (Transcript.text's), a
    line of its own even when empty (several files' lines stay in step on one stream); srt and vtt
    cues hold at most max_lines lines of max_width columns for 7 s (subtitles.cues; vtt's text
    escaped), or with windows (vad none's fixed windows: where in one the words fall is not known) as long as
    the window; a transcript with no text has none."""
    text = join_text(segments)
    cut = partial(cues, max_width=max_width, max_lines=max_lines, max_duration=math.inf if windows else MAX_DURATION_S)
    if fmt == "txt":
        return text + "\n"
    if fmt == "json":
        return json.dumps({"file": source, "text": text, "segments": segments}, ensure_ascii=False,
                          indent=None if json_line else 2) + "\n"
    if fmt == "srt":
        return "".join(f"{i}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n\n"
                       for i, s in enumerate(cut(segments), 1))
    if fmt == "vtt":
        return "WEBVTT\n\n" + "".join(f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n"
                                      f"{_vtt(s['text'].strip())}\n\n" for s in cut(segments))
    raise ValueError(f"output_format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _vtt(text: str) -> str:
    """Cue text as WebVTT reads it: &, < and > escaped (else read as markup)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def output_names(paths: list[str], fmt: str) -> list[str]:
    """The output file name of each input: <stem>.<fmt>; inputs whose stems clash (s1/x.wav and
    s2/x.wav, or x.wav and x.flac) become <stem>-1.<fmt>, <stem>-2.<fmt>, ... in argument order
    (skipping names another input already has), so no transcript overwrites another; standard
    input ('-') is named stdin."""
    stems = ["stdin" if p == "-" else Path(p).stem for p in paths]
    counts = Counter(stems)
    taken = {s for s in stems if counts[s] == 1}
    names, seen = [], {}
    for s in stems:
        if counts[s] == 1:
            names.append(f"{s}.{fmt}")
            continue
        n = seen.get(s, 0) + 1
        while f"{s}-{n}" in taken:
            n += 1
        seen[s] = n
        taken.add(f"{s}-{n}")
        names.append(f"{s}-{n}.{fmt}")
    return names


def check_output_dir(directory: str) -> None:
    """An output directory that takes files, or can be made where its nearest existing folder
    takes them: tried there (root ignores modes), before any work, leaving nothing; one line if
    not."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ValueError(f"output_dir {directory}: exists and is not a directory")
    there = d
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise ValueError(f"output_dir {directory}: {there} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=there, prefix=".glm_asr-check.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"output_dir {directory}: cannot write there ({e.strerror or e})") from None


def temporary_stem(name: str) -> str:
    """What write_atomic's temporary for an output `name` is called between its leading '.' and
    its random suffix: the name, or for a long one (whose temporary would pass the file system's
    255 bytes) its start and a digest of it."""
    if len(name.encode()) <= 128:
        return name
    import hashlib

    return name.encode()[:100].decode(errors="ignore") + "~" + hashlib.sha1(name.encode()).hexdigest()[:16]


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a failure never leaves half a transcript;
    a failure names the output file."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{temporary_stem(path.name)}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~UMASK)       # mkstemp's 0600 would outlive the rename
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        if tmp is not None and Path(tmp).exists():
            Path(tmp).unlink(missing_ok=True)
