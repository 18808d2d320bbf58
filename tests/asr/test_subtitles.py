"""Subtitle cues (<= 2 lines of <= 42 columns, <= 7 s, cut at punctuation) and joined text."""
import numpy as np
import pytest

from glm_asr.subtitles import MAX_DURATION_S, MAX_LINES, MAX_WIDTH, cues, join_text, normalise, width

EN = ("Hello there, this is a fairly long sentence that will need to be split into several cues. "
      "And here is another one; with a clause! Does it work? I hope so, because otherwise the "
      "subtitles would be quite unreadable for everyone who watches.")
ZH = ("今天天气很好，我们一起去公园散步吧。公园里有很多人在跑步，还有一些老人在打太极拳。"
      "孩子们在草地上玩耍，非常开心！你觉得怎么样？")
JA = "きょうはいい天気ですね。こうえんにいきましょう、みんなでおべんとうをたべます。"


def check(segs, got, sep=" "):
    """The cue rules, and each segment's text given back whole (lines and cues joined by sep)."""
    at = 0
    for seg in segs:
        text = normalise(seg["text"])
        if not text:
            continue
        mine = []
        while at < len(got) and seg["start"] - 1e-9 <= got[at]["start"] and got[at]["end"] <= seg["end"] + 1e-9:
            mine.append(got[at])
            at += 1
        assert mine, seg
        assert mine[0]["start"] == pytest.approx(seg["start"])
        for c in mine:
            lines = c["text"].split("\n")
            assert 1 <= len(lines) <= MAX_LINES and all(0 < width(ln) <= MAX_WIDTH and len(ln) <= 42 for ln in lines), c
            assert all(ln == ln.strip() for ln in lines), c
            assert 0 < c["end"] - c["start"] <= MAX_DURATION_S + 1e-9, c
        for a, b in zip(mine, mine[1:]):
            assert a["start"] < a["end"] <= b["start"] < b["end"]
        assert sep.join(c["text"].replace("\n", sep) for c in mine) == text
    assert at == len(got)


def test_english_cues():
    segs = [{"start": 1.0, "end": 14.5, "text": EN}, {"start": 15.0, "end": 16.0, "text": "Short."}]
    got = cues(segs)
    check(segs, got)
    assert len(got) >= 4 and got[-1]["text"] == "Short."
    assert sum(c["text"][-1] in ".!?;," for c in got) >= len(got) - 1    # cut at punctuation


def test_sentences_become_cues():
    a = "The first sentence is long enough to fill most of a line."
    b = "The second sentence is just as long as the first one is."
    got = cues([{"start": 0.0, "end": 6.0, "text": f"{a} {b}"}])
    assert [c["text"].replace("\n", " ") for c in got] == [a, b]
    assert got[0]["end"] == got[1]["start"] == pytest.approx(6.0 * (len(a)) / (len(a) + 1 + len(b)), abs=1e-3)


def test_two_lines_break_at_a_comma_when_it_is_even_enough():
    t = "When the rain stopped at last, everyone went out to the river bank"
    (c,) = cues([{"start": 0.0, "end": 4.0, "text": t}])
    assert c["text"] == "When the rain stopped at last,\neveryone went out to the river bank"


@pytest.mark.parametrize("text", [ZH, JA])
def test_cjk_cues(text):
    segs = [{"start": 41.0, "end": 52.0, "text": text}]
    got = cues(segs)
    check(segs, got, sep="")
    assert all(width(ln) <= 42 for c in got for ln in c["text"].split("\n"))
    assert all(c["text"][-1] in "。！？，、" for c in got)
    assert not any(ln[0] in "。！？，、" for c in got for ln in c["text"].split("\n"))


def test_cjk_lines_cut_after_punctuation():
    got = cues([{"start": 0.0, "end": 9.0, "text": ZH}])
    assert got[1]["text"] == "公园里有很多人在跑步，\n还有一些老人在打太极拳。"


def test_long_segment_with_little_text_is_shown_at_most_7s():
    got = cues([{"start": 16.0, "end": 40.0, "text": "Hi there."}])
    assert got == [{"start": 16.0, "end": 23.0, "text": "Hi there."}]


def test_long_segment_is_cut_by_time():
    text = " ".join(["word"] * 40)                  # 199 characters over 28 s
    segs = [{"start": 0.0, "end": 28.0, "text": text}]
    got = cues(segs)
    check(segs, got)
    assert len(got) >= 4 and got[-1]["end"] == 28.0


def test_a_word_longer_than_a_line_is_cut_hard():
    word = "Supercalifragilistic" * 5
    segs = [{"start": 0.0, "end": 5.0, "text": f"{word} end"}]
    got = cues(segs)
    assert "".join(c["text"].replace("\n", "") for c in got).replace(" ", "") == f"{word}end"
    assert all(width(ln) <= 42 for c in got for ln in c["text"].split("\n"))


def test_empty_and_blank_segments_give_no_cues():
    assert cues([]) == []
    assert cues([{"start": 0.0, "end": 3.0, "text": ""}, {"start": 3.0, "end": 4.0, "text": "  \n "}]) == []


def test_random_texts_keep_the_rules():
    rng = np.random.default_rng(0)
    words = ["a", "the", "speech", "recognition", "works", "tomorrow", "we", "never", "extraordinarily", "x"]
    segs, t = [], 0.0
    for _ in range(60):
        n = int(rng.integers(1, 60))
        text = " ".join(str(rng.choice(words)) + (str(rng.choice(list(".,;!? "), p=[.1, .1, .05, .03, .02, .7]))
                                                   .strip()) for _ in range(n))
        dur = float(rng.uniform(0.3, 30))
        segs.append({"start": round(t, 3), "end": round(t + dur, 3), "text": text})
        t += dur + float(rng.uniform(0, 3))
    check(segs, cues(segs))


def test_join_text_spacing():
    assert join_text([{"text": " Hello  world. "}, {"text": ""}, {"text": "How\nare you?"}]) == "Hello world. How are you?"
    assert join_text([{"text": "今天天气很好。"}, {"text": "我们去公园吧。"}]) == "今天天气很好。我们去公园吧。"
    assert join_text([{"text": "Hello"}, {"text": "你好"}, {"text": "world"}]) == "Hello 你好 world"
    assert join_text([{"text": "wait"}, {"text": ", what?"}]) == "wait, what?"
    assert join_text([]) == ""


def test_deltas_only_grow_and_join_to_the_segments_text():
    """A stream's deltas: previews of the next segment and decoded segments, each delta what the
    joined text grew by; a preview that does not extend what was sent is held back."""
    from glm_asr.subtitles import Deltas, join_text

    d, sent = Deltas(), []
    for item in ["Hel", "Hello wor", ({"text": "Hello world."}, 10, 4), "你", "Hx",
                 ({"text": "你好"}, 12, 2), ({"text": ", friend"}, 9, 3)]:
        sent.append(d.add(item))
    segs = [{"text": "Hello world."}, {"text": "你好"}, {"text": ", friend"}]
    assert "".join(sent) == d.text == join_text(segs) == "Hello world. 你好, friend"
    assert sent[:2] == ["Hel", "lo wor"] and sent[4] == "" and (d.used_in, d.used_out) == (31, 9)


def test_deltas_go_on_past_a_segment_that_parts_from_its_preview():
    """A segment whose text is no extension of what its previews sent (a tokenizer whose prefix
    decodes differently) does not stall the stream: its deltas go on from where the two part."""
    from glm_asr.subtitles import Deltas

    d = Deltas()
    assert d.add("John '") == "John '"
    assert d.add(({"text": "John's dog."}, 5, 4)) == "'s dog."        # the two part after "John"
    assert d.add("And") == " And" and d.text == "John's dog. And"
    assert d.add(({"text": "And then"}, 5, 2)) == " then"
