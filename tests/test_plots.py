"""tools/plots.py renders every picture from the committed benchmark JSON (CPU, a few seconds)."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")   # the workspace's dev group has it; a bare GPU bundle may not

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "tools" / "plots.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LIMIT = 150 * 1024


def render(out: Path, *extra: str) -> str:
    r = subprocess.run([sys.executable, str(PLOTS), "--out", str(out), *extra], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def check_pngs(out: Path, expected: list[str]) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for name in expected:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) <= LIMIT, f"{name}: {len(data)} bytes"


def test_renders_every_picture_from_the_committed_results(tmp_path):
    out = tmp_path / "assets"
    render(out)
    check_pngs(out, ["kernels-vs-torch-h100.png", "gpt-batch-h100.png", "glm-asr-bulk-h100.png"])


def test_an_absent_result_skips_its_picture(tmp_path):
    """Rows in bench_gpt's layout draw the engine's picture; the absent kernels file is skipped."""
    results, out = tmp_path / "results", tmp_path / "assets"
    results.mkdir()
    rows = [{"system": s, "model": "gpt2", "precision": "bf16", "work": "32-token prompts", "batch": b,
             "new_tokens": 128, "tokens_per_s": 900.0 * b / (1 if s == "tile-inference" else 9)}
            for s in ("tile-inference", "transformers 5.17 eager") for b in (1, 8, 32)]
    (results / "gpt-batch-h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "date": "2030-01-02",
                                                             "rows": rows}))
    stdout = render(out, "--results", str(results))
    check_pngs(out, ["gpt-batch-h100.png"])
    assert "skipped kernels-vs-torch-h100.png" in stdout and "skipped glm-asr-bulk-h100.png" in stdout


def test_dates_come_from_the_json_else_git():
    spec = importlib.util.spec_from_file_location("plots", PLOTS)
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    path = RESULTS / "gpt-batch-h100.json"
    assert plots.measured_on({"date": "2030-01-02"}, path) == "2030-01-02"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", plots.measured_on({}, path))
