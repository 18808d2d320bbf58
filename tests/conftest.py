"""Shared fixtures: fresh random generators, poisoned GPU allocations, GPU gating, the tiny GLM-ASR."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU host)")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def default_precision():
    """Every test starts at tilekernels' default matmul precision ('high'), whatever one before it
    set for the process (GPT.load on the GPU rounds its matrices at bf16)."""
    import tilekernels as tk

    tk.set_matmul_precision("high")
    yield
    tk.set_matmul_precision("high")


@pytest.fixture
def rng():
    """A generator with a fresh seed every run (printed on failure for replay)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned():
    """Every cupy allocation in the test starts as NaN (0xFF bytes), so unwritten output shows."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(alloc)
    yield cupy
    cupy.cuda.set_allocator(pool.malloc)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny GLM-ASR checkpoint, made by the project's own tool (sharded, as the hub's)."""
    out = tmp_path_factory.mktemp("tiny_glm")
    subprocess.run([sys.executable, "-m", "glm_asr.synthetic", str(out), "--shards", "2"],
                   check=True, capture_output=True)
    return out
