"""docs/ops.md, the ops reference: a heading for every name tilekernels exports, and its numpy
examples run as written."""
import re
from pathlib import Path

import pytest

import tilekernels as tk

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def python_blocks() -> list[tuple[int, str]]:
    """(line, code) of each ```python block, the line its code starts on."""
    text = DOC.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


BLOCKS = python_blocks()


def test_every_export_has_a_heading():
    headings = [line for line in DOC.read_text().splitlines() if line.startswith("#")]
    assert [name for name in tk.__all__ if not any(f"`{name}`" in h for h in headings)] == []


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_example(line, code):
    """Each block in a fresh namespace, compiled at its own lines of the file for tracebacks."""
    exec(compile("\n" * (line - 1) + code, str(DOC), "exec"), {})
