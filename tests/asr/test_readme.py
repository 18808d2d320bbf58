"""The README's Python examples, run as written: the bundled Shakespeare model, and the tiny
GLM-ASR checkpoint and an m4a made here in place of the hub id and talk.m4a."""
import re
from pathlib import Path

import pytest
from media import encode, voice

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(section: str) -> str:
    text = README.read_text()
    part = text[text.index(section):]
    part = part[: part.index("\n## ", 1)]
    return "\n".join(re.findall(r"```python\n(.*?)```", part, re.S))


def test_use_it_from_python(tiny, tmp_path, monkeypatch, capsys):
    code = python_blocks("## Use it from Python")
    assert "gpt.load(" in code and "glm_asr.load(" in code
    encode(tmp_path / "talk.m4a", [("aac", voice(4.0))])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = code.replace('"zai-org/GLM-ASR-Nano-2512"', repr(str(tiny)))
    exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert out.count("talk.m4a") == 2


def test_api_contracts(tiny, tmp_path):
    """What the README promises: continuation only, stream joins to generate, logits' shape, the
    one-line error classes, samples in, errors of one input reported and the others go on."""
    import numpy as np

    import glm_asr
    import gpt

    lm = gpt.load("shakespeare", device="cpu")
    [a] = lm.generate("ROMEO:", max_new_tokens=20, temperature=0.9, seed=4)
    assert "".join(lm.stream("ROMEO:", max_new_tokens=20, temperature=0.9, seed=4)) == a.text
    assert len(a.tokens) <= 20 and a.finish_reason in ("stop", "length") and not a.text.startswith("ROMEO:")
    ids = lm.encode(["To be, or not"])[0]
    logits = lm.logits(ids)
    assert logits.shape == (1, len(ids), lm.model.config.vocab_size)
    assert int(logits[0, -1].argmax()) == lm.generate([ids], max_new_tokens=1, temperature=0)[0].tokens[0]
    with pytest.raises(gpt.GPTError, match="top_p must be in"):
        lm.generate("x", top_p=2)
    with pytest.raises(gpt.GPTError, match="no such directory"):
        gpt.load("./missing-model", device="cpu")

    asr = glm_asr.load(str(tiny), device="cpu")
    x = voice(3.0)
    r = asr.transcribe(x, sample_rate=16000, max_new_tokens=2, vad="none")
    stereo48k = np.repeat(np.interp(np.arange(3 * 48000) / 3, np.arange(len(x)), x)[:, None], 2, 1)
    assert asr.transcribe(stereo48k, sample_rate=48000, max_new_tokens=2, vad="none").segments[0].end == r.segments[0].end == 3.0
    with pytest.raises(glm_asr.ASRError, match="sample_rate is needed"):
        asr.transcribe(x)
    with pytest.raises(glm_asr.ASRError, match="sample_rate must be an integer"):
        asr.transcribe(x, sample_rate="16000")
    pcm = np.round(x * 32767).astype(np.int16)             # integer PCM is scaled as soundfile reads it
    as_int = asr.transcribe(pcm, sample_rate=16000, max_new_tokens=2, vad="silero")
    as_float = asr.transcribe(pcm / 32768.0, sample_rate=16000, max_new_tokens=2, vad="silero")
    assert as_int.segments == as_float.segments
    results = list(asr.transcribe_many([tmp_path / "missing.wav", tmp_path / "missing.wav"], max_new_tokens=2))
    assert [r.error for r in results] == [f"{tmp_path / 'missing.wav'}: no such file"] * 2
