"""An LSTM layer over a whole sequence, its time loop inside one kernel.

gates (T, B, 4H) are the input half of each step's gates, x_t @ W_ih.T + b_ih + b_hh (one product
over all steps, done beforehand: it needs no state); weight_hh (4H, H) in torch's layout and gate
order i, f, g, o. Each step, for every row:
    g = gates[t] + h @ weight_hh.T;  c = sig(g_f) * c + sig(g_i) * tanh(g_g);  h = sig(g_o) * tanh(c)
The kernel gives each block TILE_B rows (whole rows: all 4H gates) and keeps their h and c in
registers for all T steps, loading weight_hh.T (L2-resident) every step; a step's latency, not
its arithmetic, is the cost, so the rows of many sequences (blocks of files) should share one call.
The products run at the matmul precision set (tilekernels.precision); a recurrence compounds its
rounding, which is why Silero's VAD calls it at 'highest' (3xTF32).
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import backend, check, inputs_ready, launch
from .activations import fast_div
from .precision import mma, mma_mode
from .interop import any_array

ConstInt = ct.Constant[int]
TILE_B = 16         # rows a block


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def lstm_reference(gates: np.ndarray, weight_hh: np.ndarray, h0: np.ndarray | None = None,
                   c0: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, b, h4 = gates.shape
    hid = h4 // 4
    h = np.zeros((b, hid), np.float32) if h0 is None else h0.astype(np.float32)
    c = np.zeros((b, hid), np.float32) if c0 is None else c0.astype(np.float32)
    w = weight_hh.T.astype(np.float32)
    hs = np.empty((t, b, hid), np.float32)
    with np.errstate(over="ignore"):
        for s in range(t):
            g = gates[s] + h @ w
            c = _sigmoid(g[:, hid:2 * hid]) * c + _sigmoid(g[:, :hid]) * np.tanh(g[:, 2 * hid:3 * hid])
            h = hs[s] = _sigmoid(g[:, 3 * hid:]) * np.tanh(c)
    return hs, h, c


def _gate(G, WT, t, bid, q, j, h0, h1, HALF: int, TB: int, MODE: int):
    """Gate q's output half j of step t, (TB, HALF): the input part plus h @ weight_hh.T, h as
    its two halves (the K chunks of the product)."""
    acc = ct.reshape(ct.load(G, index=(t, bid, 2 * q + j), shape=(1, TB, HALF),
                             padding_mode=ct.PaddingMode.ZERO), (TB, HALF))
    w0 = ct.load(WT, index=(0, 2 * q + j), shape=(HALF, HALF), padding_mode=ct.PaddingMode.ZERO)
    w1 = ct.load(WT, index=(1, 2 * q + j), shape=(HALF, HALF), padding_mode=ct.PaddingMode.ZERO)
    acc = mma(h0, w0, acc, MODE)
    return mma(h1, w1, acc, MODE)


def _sig(x):
    return fast_div(1.0, 1.0 + ct.exp(-x))


def _half(G, WT, t, bid, j, h0, h1, c, HALF: int, TB: int, MODE: int):
    """Output half j of a step: the new (h, c) of hidden units j*HALF...(j+1)*HALF."""
    i = _sig(_gate(G, WT, t, bid, 0, j, h0, h1, HALF, TB, MODE))
    f = _sig(_gate(G, WT, t, bid, 1, j, h0, h1, HALF, TB, MODE))
    g = ct.tanh(_gate(G, WT, t, bid, 2, j, h0, h1, HALF, TB, MODE))
    o = _sig(_gate(G, WT, t, bid, 3, j, h0, h1, HALF, TB, MODE))
    c = f * c + i * g
    return o * ct.tanh(c), c


@kernel
def lstm_kernel(G, WT, H0, C0, HS, HN, CN, steps: int, HALF: ConstInt, TB: ConstInt, MODE: ConstInt):
    """TB rows of an LSTM over `steps` steps; WT is weight_hh.T (H, 4H), H = 2 * HALF; the state
    is kept as two halves of HALF units."""
    bid = ct.bid(0)
    inputs_ready()
    h0 = ct.load(H0, index=(bid, 0), shape=(TB, HALF), padding_mode=ct.PaddingMode.ZERO)
    h1 = ct.load(H0, index=(bid, 1), shape=(TB, HALF), padding_mode=ct.PaddingMode.ZERO)
    c0 = ct.load(C0, index=(bid, 0), shape=(TB, HALF), padding_mode=ct.PaddingMode.ZERO)
    c1 = ct.load(C0, index=(bid, 1), shape=(TB, HALF), padding_mode=ct.PaddingMode.ZERO)
    for t in range(steps):
        n0, c0 = _half(G, WT, t, bid, 0, h0, h1, c0, HALF, TB, MODE)
        n1, c1 = _half(G, WT, t, bid, 1, h0, h1, c1, HALF, TB, MODE)
        h0, h1 = n0, n1
        ct.store(HS, index=(t, bid, 0), tile=ct.reshape(h0, (1, TB, HALF)))
        ct.store(HS, index=(t, bid, 1), tile=ct.reshape(h1, (1, TB, HALF)))
    ct.store(HN, index=(bid, 0), tile=h0)
    ct.store(HN, index=(bid, 1), tile=h1)
    ct.store(CN, index=(bid, 0), tile=c0)
    ct.store(CN, index=(bid, 1), tile=c1)


@any_array
def lstm(gates, weight_hh, h0=None, c0=None):
    """One LSTM layer over T steps of B rows: (hs (T, B, H), h (B, H), c (B, H)), the hidden
    state of every step and the final state, as torch.nn.LSTM's (h_n, c_n). gates (T, B, 4H) is
    the input half of the gates with both biases; weight_hh (4H, H); h0, c0 (B, H), zeros if None.
    H is a power of two from 16 to 256."""
    kind = backend(gates=gates, weight_hh=weight_hh, h0=h0, c0=c0)
    check("gates", gates, ndim=3)
    t, b, h4 = gates.shape
    hid = h4 // 4
    if h4 % 4 or hid < 16 or hid > 256 or hid & (hid - 1):
        raise ValueError(f"gates: the last axis must be 4 * H with H a power of two in [16, 256], got {h4}")
    check("weight_hh", weight_hh, shape=(h4, hid))
    for name, s in (("h0", h0), ("c0", c0)):
        if s is not None:
            check(name, s, shape=(b, hid))
    if kind == "numpy":
        return lstm_reference(gates, weight_hh, h0, c0)
    import cupy

    def state(s):
        return cupy.zeros((b, hid), cupy.float32) if s is None else cupy.ascontiguousarray(s, cupy.float32)

    hs = cupy.empty((t, b, hid), cupy.float32)
    hn, cn = cupy.empty((b, hid), cupy.float32), cupy.empty((b, hid), cupy.float32)
    h0, c0 = state(h0), state(c0)
    if t == 0 or b == 0:
        return hs, h0.copy(), c0.copy()
    launch((-(-b // TILE_B), 1, 1), lstm_kernel,
           (cupy.ascontiguousarray(gates, cupy.float32), cupy.ascontiguousarray(weight_hh.T, cupy.float32), h0, c0,
            hs, hn, cn, t, hid // 2, TILE_B, mma_mode()))
    return hs, hn, cn
