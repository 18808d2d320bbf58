"""A real client: lm-evaluation-harness's local-completions model scores a task made from
files in the repo against python -m gpt.serve on loopback (tokenizing through the server's
/tokenize), and every log-likelihood it computes equals lm.score's."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "gpt2"))
from checkpoints import make_gpt2  # noqa: E402
from serving import start  # noqa: E402

CHOICES = Path(__file__).resolve().parent / "fixtures" / "choices.jsonl"
TASK = f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {CHOICES}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_loglikelihoods_equal_lm_score(request, tmp_path, monkeypatch):
    import gpt
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = make_gpt2(tmp_path / "tiny")
    server = start(request, "gpt.serve", [f"model.path={ckpt}"], tmp_path / "srv")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(TASK)
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        model_args=f"base_url={server.url('/v1/completions')},model=tiny,num_concurrent=1,max_retries=1,"
                   "max_length=60",
        batch_size=4, log_samples=True)
    samples = out["samples"]["tiny_choice"]
    assert len(samples) == 5 and 0 <= out["results"]["tiny_choice"]["acc,none"] <= 1
    lm = gpt.load(str(ckpt), "cpu")
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ctx = lm.encode([context])[0]
            whole = lm.encode([context + continuation])[0]
            assert whole[:len(ctx)] == ctx
            scores = lm.score([whole])[0]
            want = sum(t.logprob for t in scores[len(ctx):])
            assert np.isclose(resp[0][0], want, rtol=1e-6, atol=1e-6), (context, continuation)
            checked += 1
    assert checked == 13
