"""The error metric every numeric test uses."""
import numpy as np


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (cupy arrays are copied to the host)."""
    out = np.asarray(out.get() if hasattr(out, "get") else out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "non-finite values in output (unwritten or poisoned?)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
