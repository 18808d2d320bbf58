"""Readable subtitle cues from timed segments, and plain text with sensible spacing.

cues: each segment's text is cut into cues of at most MAX_LINES lines of at most MAX_WIDTH
columns (a CJK character counts two) and at most MAX_DURATION_S, cut after sentence punctuation
where possible, else after clause punctuation, else at spaces (or between CJK characters, which
have no spaces), else inside a word. A segment's time is shared among its cues by character
count, so the times inside a segment are approximate; its first cue starts at the segment's start
and its last ends at the segment's end.
"""
from __future__ import annotations

import os
import unicodedata

MAX_WIDTH = 42               # columns per line
MAX_LINES = 2
MAX_DURATION_S = 7.0
MIN_FILL = 1 / 3             # two lines cut at punctuation: the shorter at least this much of the longer
CUE_FILL = 1 / 4             # a cue cut at punctuation: at least this much of the longest cue that fits
MIN_SPARSE_CHARS = 20        # a segment slower than this per MAX_DURATION_S is cut by length only

SENTENCE_END = set(".!?。！？…")
CLAUSE_END = set(";:,，、；：")
CLOSING = SENTENCE_END | CLAUSE_END | set(")]}\"'”’」』）》〉】〕")      # never starts a line
OPENING = set("([{\"'“‘「『（《〈【〔")                                       # never ends a line

# priorities of a break (higher is better)
HARD, SOFT, CLAUSE, SENTENCE = 0, 1, 2, 3


def is_cjk(ch: str) -> bool:
    """A character of a script written without spaces (Han, kana) or CJK punctuation."""
    o = ord(ch)
    return (0x2E80 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF
            or 0xFF00 <= o <= 0xFF60 or 0x20000 <= o <= 0x2FA1F or 0x31F0 <= o <= 0x31FF)


def width(text: str) -> int:
    """Display columns: wide and full-width characters count two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def normalise(text: str) -> str:
    """Whitespace runs become one space; no space at either end."""
    return " ".join(text.split())


def cue_text(text: str) -> str:
    """A segment's text as a cue holds it: normalised, and '-->' (which would end a cue's timing
    line early in a player) written '->', as Whisper's writers do."""
    return normalise(text).replace("-->", "->")


def _breaks(text: str) -> dict[int, int]:
    """{position: priority} of the places where text may be cut (text[:i], text[i:]): before a
    space (the cut drops it), between CJK characters, else inside a word (HARD); never before
    closing punctuation or after an opening bracket or quote."""
    out = {}
    for i in range(1, len(text)):
        prev, nxt = text[i - 1], text[i]
        if prev == " " or nxt in CLOSING or (prev in OPENING and nxt != " "):
            continue                               # (cut before a space, not after it)
        if nxt == " ":
            j = i - 1                              # the character that ends the left part
            while j > 0 and text[j] in CLOSING - SENTENCE_END - CLAUSE_END:
                j -= 1                             # look through closing quotes and brackets
            out[i] = SENTENCE if text[j] in SENTENCE_END else CLAUSE if text[j] in CLAUSE_END else SOFT
        elif is_cjk(prev) or is_cjk(nxt):
            out[i] = SENTENCE if prev in SENTENCE_END else CLAUSE if prev in CLAUSE_END else SOFT
        else:
            out[i] = HARD
    return out


class _Text:
    """One segment's normalised text with its breaks and prefix widths, so that any span's
    width and wrapping cost no more than its length."""

    def __init__(self, text: str):
        self.text = text
        self.breaks = _breaks(text)
        self.cum = [0]
        for c in text:
            self.cum.append(self.cum[-1] + width(c))

    def strip(self, a: int, b: int) -> tuple[int, int]:
        while a < b and self.text[a] == " ":
            a += 1
        while b > a and self.text[b - 1] == " ":
            b -= 1
        return a, b

    def width(self, a: int, b: int) -> int:
        return self.cum[b] - self.cum[a]

    def wrap(self, a: int, b: int, max_width: int, max_lines: int) -> tuple[int, list[str]] | None:
        """(quality, lines): text[a:b] (stripped) in at most max_lines lines of at most max_width
        columns, cut at its best breaks and as even as may be; quality is the worst break used
        (CLAUSE for punctuation or one line, SOFT, HARD). None where it does not fit."""
        a, b = self.strip(a, b)
        if self.width(a, b) <= max_width:
            return CLAUSE, [self.text[a:b]]
        if max_lines <= 1 or self.width(a, b) > max_lines * max_width + max_lines - 1:
            return None
        best = None
        for i in range(a + 1, b):
            pri = self.breaks.get(i)
            if pri is None or self.width(a, i) > max_width:
                continue
            rest = self.wrap(i, b, max_width, max_lines - 1)
            if rest is None:
                continue
            widths = [self.width(a, i)] + [width(r) for r in rest[1]]
            # the best kind of break whose lines stay reasonably even, then the evenest
            even = min(widths) >= max(widths) * MIN_FILL
            kind = min(pri, CLAUSE) if even or pri == HARD else SOFT
            score = (min(kind, rest[0]), kind, -(max(widths) - min(widths)))
            if best is None or score > best[0]:
                best = (score, [self.text[a:i]] + rest[1])
        return None if best is None else (best[0][0], best[1])

    def cut(self, at: int, limit: int, max_width: int, max_lines: int) -> int:
        """Where the cue starting at `at` ends: among the breaks other than inside a word within
        `limit` characters whose cue fits without a line cut inside a word and is at least
        CUE_FILL of the longest such cue, the
        best kind of break, then the best line wrap, then the longest cue; inside a word only
        where no other break fits."""
        cands = []
        for i in range(min(at + limit, len(self.text) - 1), at, -1):
            pri = self.breaks.get(i)
            if pri is None:
                continue
            w = self.wrap(at, i, max_width, max_lines)
            if w is not None:
                cands.append((i, pri, w[0]))
        soft = [c for c in cands if c[1] > HARD and c[2] > HARD]
        if soft:
            longest = soft[0][0] - at
            return max((p, q, i) for i, p, q in soft if i - at >= longest * CUE_FILL)[2]
        if cands:                                  # inside a word only where no other break fits
            return cands[0][0]
        i = self.strip(at, at)[0] + 1              # no break at all fits: fill one line
        while i < len(self.text) and self.width(at, i + 1) <= max_width:
            i += 1
        return i


def cues(segments: list[dict], max_width: int = MAX_WIDTH, max_lines: int = MAX_LINES,
         max_duration: float = MAX_DURATION_S) -> list[dict]:
    """Subtitle cues ({start, end, text}, lines joined with "\\n") of segments ({start, end,
    text}, seconds): each of at most max_lines lines of at most max_width columns and at most
    max_duration seconds, in order, times monotone; segments without text give none."""
    out = []
    for seg in segments:
        t = _Text(cue_text(seg.get("text") or ""))
        n = len(t.text)
        if not n:
            continue
        start, end = float(seg["start"]), float(seg["end"])
        dur = max(end - start, 0.0)
        # the characters a cue may hold so that its share of the time stays within max_duration
        limit = n if dur <= max_duration else max(int(max_duration * n / dur), MIN_SPARSE_CHARS)
        at = 0
        while at < n:
            whole = t.wrap(at, n, max_width, max_lines) if n - at <= limit else None
            if whole and whole[0] > HARD:
                cut = n
            else:
                cut = t.cut(at, limit, max_width, max_lines)
            t0 = round(start + dur * at / n, 3)
            t1 = round(min(start + dur * cut / n if cut < n else end, t0 + max_duration), 3)
            out.append({"start": t0, "end": t1, "text": "\n".join(t.wrap(at, cut, max_width, max_lines)[1])})
            at = cut
    return out


def join_text(segments: list[dict]) -> str:
    """The segments' texts as one line: whitespace runs become one space, segments are joined
    by a space except between CJK text (no spaces) or before closing punctuation."""
    out = ""
    for seg in segments:
        t = normalise(seg.get("text") or "")
        if not t:
            continue
        if out and not ((is_cjk(out[-1]) and is_cjk(t[0])) or t[0] in CLOSING - set("\"'")):
            out += " "
        out += t
    return out


class Deltas:
    """A streamed transcription's text as it comes (the servers' stream and realtime events):
    add() takes a decoded segment (segment, prompt tokens, new tokens) or the next segment's text
    so far (a str) and returns what the joined text grew by ('' for nothing), so that the deltas
    join to join_text of the segments; tokens used are counted. A preview that does not extend
    the text sent is held back; a segment that does not (a tokenizer whose text of a prefix is no
    prefix of the whole's) goes on from where the two part, rather than stall the stream."""

    def __init__(self):
        self.done = ""                  # join_text of the segments so far
        self.text, self.used_in, self.used_out = "", 0, 0

    def add(self, item) -> str:
        if isinstance(item, str):
            now = join_text([{"text": self.done}, {"text": item}])
            if not now.startswith(self.text):
                return ""
        else:
            segment, prompt_tokens, new_tokens = item
            self.used_in, self.used_out = self.used_in + prompt_tokens, self.used_out + new_tokens
            now = self.done = join_text([{"text": self.done}, segment])
            if not now.startswith(self.text):
                start, self.text = len(os.path.commonprefix([now, self.text])), now
                return now[start:]
        if len(now) <= len(self.text):
            return ""
        delta, self.text = now[len(self.text):], now
        return delta

    def usage(self) -> dict:
        """The tokens used so far, in OpenAI's transcription `usage` shape."""
        return {"type": "tokens", "input_tokens": self.used_in, "output_tokens": self.used_out,
                "total_tokens": self.used_in + self.used_out}
