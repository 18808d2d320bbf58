"""The committed benchmark results: each JSON as tools/benchlib.result_json writes it (a row a
line), listed in benchmarks/results/index.md (CPU, instant)."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("*.json"))


SPEC = importlib.util.spec_from_file_location("benchlib", ROOT / "tools" / "benchlib.py")
benchlib = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(benchlib)     # standard library imports only at its top
INDEX = (RESULTS / "index.md").read_text()


def test_result_json_puts_a_row_a_line_and_round_trips():
    payload = {"gpu": "NVIDIA H200", "versions": {"cupy": "14.2.0"}, "errs": [1e-5, 2.5e-3],
               "rows": [{"system": "tile-inference", "batch": 1}, {"system": "transformers eager", "batch": 32}]}
    text = benchlib.result_json(payload)
    assert json.loads(text) == payload
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and text.endswith("\n")
    assert '  {"system": "transformers eager", "batch": 32}' in lines
    assert ' "errs": [1e-05, 0.0025],' in lines


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_committed_results_are_written_so_and_indexed(path):
    text = path.read_text()
    assert benchlib.result_json(json.loads(text)) == text
    assert f"`{path.name}`" in INDEX


def _codes(node):
    """Every "code" value in a result (the payload's and its rows')."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "code" and isinstance(value, str):
                yield value
            else:
                yield from _codes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _codes(value)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_code_fields_name_a_commit_and_a_date(path):
    """A figure's "code" names the commit measured and the date ("1070c0c, 2026-12-07", a note may
    follow), never a working period."""
    for code in _codes(json.loads(path.read_text())):
        assert re.match(r"[0-9a-f]{7,40}, \d{4}-\d\d-\d\d\b", code), code
