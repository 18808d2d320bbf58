"""Shared fixtures: fresh random generators, the relative-error metric, GPU gating."""
import numpy as np
import pytest


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


@pytest.fixture
def rng():
    """A generator with a fresh seed every run (printed on failure for replay)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (cupy arrays are copied to the host)."""
    out = np.asarray(out.get() if hasattr(out, "get") else out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "non-finite values in output (unwritten or poisoned?)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


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
