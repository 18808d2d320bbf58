"""docs/ops.md, the ops reference: a heading for every name tilekernels exports, and its
examples run as written (numpy ones here, the GPU ones with torch and CuPy on the GPU host)."""
import re
from pathlib import Path

import pytest

import tilekernels as tk

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def python_blocks(info: str = "python") -> list[tuple[int, str]]:
    """(line, code) of each ```<info> block, the line its code starts on."""
    text = DOC.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(rf"```{info}\n(.*?)```", text, re.S)]


BLOCKS, GPU_BLOCKS = python_blocks(), python_blocks("python gpu")


def test_every_export_has_a_heading():
    headings = [line for line in DOC.read_text().splitlines() if line.startswith("#")]
    assert [name for name in tk.__all__ if not any(f"`{name}`" in h for h in headings)] == []


def run(line: int, code: str) -> None:
    """A block in a fresh namespace, compiled at its own lines of the file for tracebacks."""
    exec(compile("\n" * (line - 1) + code, str(DOC), "exec"), {})


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_example(line, code):
    run(line, code)


def test_every_array_op_has_a_gpu_example():
    from test_interop import ARRAY_OPS

    called = {op for op in ARRAY_OPS for _, code in GPU_BLOCKS if re.search(rf"\btk\.{op}\(", code)}
    assert sorted(ARRAY_OPS - called) == []


@pytest.mark.gpu
@pytest.mark.parametrize("line, code", GPU_BLOCKS, ids=[f"line{line}" for line, _ in GPU_BLOCKS])
def test_gpu_example(line, code):
    pytest.importorskip("torch")
    run(line, code)
