"""Drawing the next token from logits on the device: repetition penalty (HF's), presence and
frequency penalties and a logit bias (OpenAI's), temperature, top-k, top-p (nucleus) and min-p
filtering, then a draw by inverse CDF from a given uniform, as HF's generate does, with no sort
and nothing read back to the host.

The filters keep every value at or above a threshold: top-k's is the k-th largest value,
top-p's the largest value t whose filtered mass at or above t still reaches p (ties are kept
together). Each threshold is found exactly by a WAYS-ary search over the 32-bit order-preserving
keys of the float32 values (16 splits a pass, 8 passes: 16^8 = 2^32), every pass one launch in
which each block sums its chunk at all splits and the row's last block narrows the interval.
The draw then takes the first index (in vocabulary order) at which the running sum of the kept
weights exceeds u times their total, which is what numpy's
Generator.choice(p=...) does with the same uniform, so a seeded run draws the same tokens
on the CPU and the GPU. The draw's last block ends the step as argmax's does (positions,
counters, the next input's embedding), so sampled steps chain in a CUDA graph too.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, last_block_counters, last_in_group, launch, \
    next_pow2, reset_count
from .argmax import argmax, check_tail, chunk_tile, step_tail, tail_args, tail_arrays, tail_reference
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ConstFloat = ct.Constant[float]
# splits of a search pass (a power of two: 32 / log2(WAYS) passes a search) and elements a block compares
# with all of them at once: 16 x 64 the fastest of the settings tried (docs/performance.md)
WAYS = 16
SUB = 64
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


# ---------------------------------------------------------------------- reference
def penalized(x: np.ndarray, seen: np.ndarray | None, penalty: float) -> np.ndarray:
    """CTRL's repetition penalty: seen tokens' logits divided by penalty where positive, else
    multiplied (float32, as the kernel computes it)."""
    if seen is None:
        return x
    p = np.float32(penalty)
    hit = seen != 0
    return np.where(hit & (x > 0), x / p, np.where(hit, x * p, x)).astype(np.float32)


def adjusted(x: np.ndarray, seen: np.ndarray | None, penalty: float, counts: np.ndarray | None = None,
             presence: float = 0.0, frequency: float = 0.0, bias: np.ndarray | None = None) -> np.ndarray:
    """The logits every filter and the draw see (float32, in the kernel's order): the repetition
    penalty on seen tokens, then minus frequency x each token's count so far and presence where
    it is above 0 (counts: float32 (rows, V), generated tokens), plus bias (float32 (rows, V))."""
    x = penalized(x, seen, penalty)
    if counts is not None:
        x = (x - counts * np.float32(frequency)) - np.where(counts > 0, np.float32(presence), np.float32(0))
    if bias is not None:
        x = x + bias
    return x.astype(np.float32)


def kept(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Which logits (rows, V) survive top-k, top-p then min-p: top-k keeps values >= the k-th
    largest; top-p keeps each value whose strictly larger values hold less than p of the mass
    left by top-k (softmax at `temperature`, float64); min-p keeps values whose probability is
    at least min_p times the largest's (x >= max + temperature ln min_p, in float32). At least
    the largest value survives."""
    keep = np.ones(x.shape, bool)
    n = x.shape[-1]
    if 0 < top_k < n:
        keep &= x >= np.partition(x, n - top_k, axis=-1)[:, n - top_k, None]
    if top_p < 1:
        w = np.where(keep, np.exp((x.astype(np.float64) - x.max(-1, keepdims=True)) / temperature), 0)
        for r in range(x.shape[0]):
            order = np.argsort(-x[r], kind="stable")
            xs = x[r, order]
            before = np.concatenate([[0.0], np.cumsum(w[r, order])[:-1]])
            above = before[np.searchsorted(-xs, -xs, side="left")]      # mass of strictly larger values
            keep[r, order] &= above < top_p * w[r].sum()
    if min_p > 0:
        keep &= x >= x.max(-1, keepdims=True) + np.float32(temperature) * np.log(np.float32(min_p))
    return keep


def sample_reference(x: np.ndarray, uniforms: np.ndarray | None, temperature: float, top_k: int, top_p: float,
                     penalty: float, seen: np.ndarray | None, min_p: float = 0.0, presence: float = 0.0,
                     frequency: float = 0.0, counts: np.ndarray | None = None,
                     bias: np.ndarray | None = None) -> np.ndarray:
    """int64 token (rows,) of each row of logits x (rows, V), uniforms (rows,) in [0, 1); the
    chosen tokens are marked in seen and counted in counts."""
    x = adjusted(x, seen, penalty, counts, presence, frequency, bias)
    if temperature == 0:
        y = np.argmax(x, -1)
    else:
        w = np.where(kept(x, temperature, top_k, top_p, min_p),
                     np.exp((x.astype(np.float64) - x.max(-1, keepdims=True)) / temperature), 0)
        cdf = np.cumsum(w, -1)
        last = x.shape[-1] - 1 - np.argmax(w[:, ::-1] > 0, -1)      # where u rounds up to 1
        y = np.minimum((cdf <= uniforms[:, None] * cdf[:, -1:]).sum(-1), last)
    if seen is not None:
        seen[np.arange(len(y)), y] = 1
    if counts is not None:
        counts[np.arange(len(y)), y] += 1
    return y.astype(np.int64)


# ---------------------------------------------------------------------- kernels
def order_key(x):
    """Tile helper: int32 keys of float32 values, in the same order (-0 and +0 the same key, as
    they compare equal in the reference)."""
    b = ct.bitcast(x, ct.int32)
    key = ct.where(b < 0, ct.bitwise_xor(b, INT32_MAX), b)
    return ct.where(key == -1, 0, key)                  # -0's key (-1: no other value's) is +0's


def _chunk(X, r, c, TILE):
    """Tile helper: chunk c of row r (1, TILE), -inf past the row's end, and which are in it."""
    x = ct.load(X, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
    return x, (c * TILE + ct.arange(TILE, dtype=ct.int32))[None, :] < X.shape[1]


def _row(A, r):
    """Tile helper: row r's setting (0-d) from a per-row array."""
    return ct.load(A, index=(r,), shape=(), allow_tma=False)


def _inv_t(TEMP, r):
    """Tile helper: 1 / temperature of row r (1 for a greedy row, whose weights only rank)."""
    t = _row(TEMP, r)
    return 1.0 / ct.where(t > 0, t, 1.0)


@kernel
def prepare_kernel(X, SEEN, NSEEN, BIAS, XP, PV, PK, C, M, LO, HI, TEMP, TOPK, PEN, PRES, FREQ, TILE: ConstInt,
                   CHUNKS: ConstInt, ADJUST: ConstBool):
    """Chunk bid(0) of row bid(1): the row's adjusted logits into XP (ADJUST: the repetition
    penalty on SEEN, presence and frequency penalties on the counts NSEEN, the bias BIAS), the
    chunk's largest value and smallest key; the row's last block writes the row's largest value M and
    the search interval [LO, HI]: [smallest key, largest key] for a row with top-k, the largest
    value's key twice for a greedy row (temperature 0), the smallest key twice otherwise (no
    top-k search: everything stays in)."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    x, valid = _chunk(X, r, c, TILE)
    if ADJUST:
        penalty = _row(PEN, r)
        hit = ct.load(SEEN, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.ZERO) != 0
        x = ct.where(hit, ct.where(x > 0, x / penalty, x * penalty), x)
        n = ct.load(NSEEN, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.ZERO)
        x = (x - n * _row(FREQ, r)) - ct.where(n > 0, _row(PRES, r), 0.0)
        x = x + ct.load(BIAS, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.ZERO)
        ct.store(XP, index=(r, c), tile=x)
    ct.store(PV, index=(r, c), tile=ct.max(x, axis=1, keepdims=True), allow_tma=False)
    ct.store(PK, index=(r, c), tile=ct.min(ct.where(valid, order_key(x), INT32_MAX), axis=1, keepdims=True),
             allow_tma=False)
    if last_in_group(C, r, ct.num_blocks(0)):
        m = ct.max(ct.load(PV, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.NEG_INF,
                           allow_tma=False))
        k = ct.load(PK, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
        hi = order_key(ct.reshape(m, (1,)))
        lo = ct.reshape(ct.min(ct.where(ct.arange(CHUNKS, dtype=ct.int32)[None, :] < ct.num_blocks(0), k, INT32_MAX)),
                        (1,))
        top_k = _row(TOPK, r)
        greedy = _row(TEMP, r) <= 0
        lo = ct.where(greedy, hi, lo)
        hi = ct.where(greedy | ((top_k > 0) & (top_k < X.shape[1])), hi, lo)
        ct.store(M, index=(r,), tile=ct.reshape(m, (1,)), allow_tma=False)
        ct.store(LO, index=(r,), tile=lo, allow_tma=False)
        ct.store(HI, index=(r,), tile=hi, allow_tma=False)
        reset_count(C, r)


@kernel
def search_kernel(X, M, LO, HI, TARGET, PF, C, TOPK, TOPP, TEMP, TILE: ConstInt, CHUNKS: ConstInt, WAYS: ConstInt,
                  SUB: ConstInt, MASS: ConstBool, FIRST: ConstBool):
    """One pass of the search for the largest key t in [LO, HI] of row bid(1) with F(t) >= its
    target, F(t) the count (top-k: target TOPK[row]) or the weight exp((x - M) / TEMP[row])
    (MASS, top-p: target TOPP[row] times F(LO), taken in the FIRST pass, whose HI is the
    largest value's key for a row that samples with top_p < 1 and LO for the others) of the
    row's values with keys >= t. Block bid(0) sums its chunk at WAYS splits of the interval;
    the row's last block keeps the sub-interval holding the answer. A converged row
    (LO == HI) does nothing."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    m = ct.load(M, index=(r,), shape=())
    lo = ct.load(LO, index=(r,), shape=())
    hi = ct.load(HI, index=(r,), shape=())
    top_p = _row(TOPP, r)
    inv_t = _inv_t(TEMP, r)
    if FIRST:
        hi = ct.where((top_p < 1.0) & (_row(TEMP, r) > 0), ct.reshape(order_key(ct.reshape(m, (1,))), ()), lo)
    ways = ct.arange(WAYS, dtype=ct.int64)
    span = ct.astype(hi, ct.int64) - ct.astype(lo, ct.int64) + 1
    splits = ct.astype(ct.astype(lo, ct.int64) + span * ways // WAYS, ct.int32)
    # F at every split for the chunk's SUB-wide slices, element-wise (counts are exact in float32 below
    # 2^24), reduced across the slice once at the end; unrolled and outside the branch below, so every
    # slice's load is issued at once, alongside the interval's
    f = ct.zeros((WAYS, SUB), ct.float32)
    for j in ct.static_iter(range(TILE // SUB)):
        x, valid = _chunk(X, r, c * (TILE // SUB) + j, SUB)
        above = ct.where(valid, order_key(x), INT32_MIN) >= ct.reshape(splits, (WAYS, 1))
        if MASS:
            f = f + ct.where(above, ct.exp((x - m) * inv_t), 0.0)
        else:
            f = f + ct.where(above, 1.0, 0.0)
    if hi > lo:
        ct.store(PF, index=(r, c, 0), tile=ct.reshape(ct.sum(f, axis=1), (1, 1, WAYS)), allow_tma=False)
        if last_in_group(C, r, ct.num_blocks(0)):
            f = ct.sum(ct.load(PF, index=(r, 0, 0), shape=(1, CHUNKS, WAYS), padding_mode=ct.PaddingMode.ZERO,
                               allow_tma=False), axis=1)
            target = ct.astype(_row(TOPK, r), ct.float32)
            if MASS:
                if FIRST:
                    target = top_p * ct.sum(ct.where(ways[None, :] == 0, f, 0.0))
                    ct.store(TARGET, index=(r,), tile=ct.reshape(target, (1,)), allow_tma=False)
                else:
                    target = ct.load(TARGET, index=(r,), shape=())
            ok = f >= target
            # the first split is LO, at or below the answer by the last pass (even if its sum rounds lower now)
            best = ct.max(ct.where(ok | (ways[None, :] == 0), ways[None, :], 0))
            new_lo = ct.sum(ct.where(ways == best, splits, 0))
            new_hi = ct.where(best < WAYS - 1, ct.sum(ct.where(ways == best + 1, splits - 1, 0)), hi)
            ct.store(LO, index=(r,), tile=ct.reshape(new_lo, (1,)), allow_tma=False)
            ct.store(HI, index=(r,), tile=ct.reshape(new_hi, (1,)), allow_tma=False)
            reset_count(C, r)


@kernel
def draw_kernel(X, M, LO, U, PS, C, SEEN, OUT, POS, CNT, T, P, Y, TILE_CNT: ConstInt, TILE_C: ConstInt,
                ADVANCE: ConstBool, COUNT: ConstBool, EMBED: ConstBool, HAS_P: ConstBool, TEMP, MINP, NSEEN,
                TILE: ConstInt, CHUNKS: ConstInt, MARK: ConstBool):
    """Chunk bid(0) of row bid(1): the weight of its values with keys >= LO and, for a row that
    samples with min-p, >= M + TEMP ln MINP; the row's last block takes the first index whose
    running weight exceeds U[r] times the row's (0 for a greedy row: the first largest), marks
    it in SEEN and counts it in NSEEN (MARK) and ends the step (argmax.step_tail)."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    m = ct.load(M, index=(r,), shape=())
    t, min_p = _row(TEMP, r), _row(MINP, r)
    floor = m + t * ct.log(ct.where(min_p > 0, min_p, 1.0))
    floor_key = ct.reshape(order_key(ct.reshape(floor, (1,))), ())
    lo = ct.load(LO, index=(r,), shape=())
    lo = ct.where((t > 0) & (min_p > 0), ct.maximum(lo, floor_key), lo)
    inv_t = _inv_t(TEMP, r)
    x, _ = _chunk(X, r, c, TILE)
    w = ct.where(order_key(x) >= lo, ct.exp((x - m) * inv_t), 0.0)
    ct.store(PS, index=(r, c), tile=ct.sum(w, axis=1, keepdims=True), allow_tma=False)
    if last_in_group(C, r, ct.num_blocks(0)):
        chunks = ct.arange(CHUNKS, dtype=ct.int32)[None, :]
        s = ct.load(PS, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
        s = ct.where(chunks < ct.num_blocks(0), s, 0.0)
        run = ct.cumsum(s, axis=1)
        target = ct.where(_row(TEMP, r) > 0, ct.load(U, index=(r,), shape=()), 0.0) * ct.max(run)
        # the chunk where the running weight first exceeds the target (the last one holding weight if
        # rounding lets the target reach the total), then the index within it
        at = ct.minimum(ct.sum(ct.where(run <= target, 1, 0)), ct.max(ct.where(s > 0, chunks, 0)))
        target = target - ct.sum(ct.where(chunks == at - 1, run, 0.0))
        x, _ = _chunk(X, r, at, TILE)
        w = ct.where(order_key(x) >= lo, ct.exp((x - m) * inv_t), 0.0)
        inner = ct.arange(TILE, dtype=ct.int32)[None, :]
        i = ct.minimum(ct.sum(ct.where(ct.cumsum(w, axis=1) <= target, 1, 0)), ct.max(ct.where(w > 0, inner, 0)))
        token = at * TILE + i
        if MARK:
            ct.store(SEEN, index=(r, token), tile=ct.full((1, 1), 1, ct.uint8), allow_tma=False)
            n = ct.load(NSEEN, index=(r, token), shape=(1, 1), allow_tma=False)
            ct.store(NSEEN, index=(r, token), tile=n + 1.0, allow_tma=False)
        step_tail(r, token, OUT, POS, CNT, T, P, Y, TILE_CNT, TILE_C, ADVANCE, COUNT, EMBED, HAS_P)
        reset_count(C, r)


# ---------------------------------------------------------------------- op
def _per_row(name: str, v, rows: int, kind: str, dtype, valid, why: str):
    """A setting given once or per row: a checked scalar, or a (rows,) array of the backend
    (values checked on the CPU; on the GPU they stay where they are)."""
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
        if np.dtype(dtype).kind == "i" and not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an integer, got {v!r}")
        if not valid(np.asarray(v)).all():
            raise ValueError(f"{name}: expected {why}, got {v}")
        return v
    backend(**{name: v})
    if (kind == "numpy") != isinstance(v, np.ndarray):
        raise TypeError(f"{name}: a per-row array must be on the logits' device")
    check(name, v, shape=(rows,), dtype=dtype)
    if kind == "numpy" and not valid(v).all():
        raise ValueError(f"{name}: expected {why} in every row")
    return v


@any_array
def sample(x, uniforms=None, *, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, seen=None, min_p=0.0,
           presence=0.0, frequency=0.0, counts=None, bias=None, out=None, positions=None, counters=None, embed=None):
    """int64 token ids (rows,) drawn from logits x (rows, V) float32.

    Each setting is one number for every row or a (rows,) array (float32; top_k int32) on the
    logits' device, so a batch can mix greedy and sampled rows with filters of their own.
    The logits are adjusted first (sampling.adjusted): the logits of tokens marked in seen
    (uint8 (rows, V); needed when a penalty != 1) get the repetition penalty; minus frequency
    times each token's count in counts (float32 (rows, V); needed when presence or frequency
    != 0) and presence where it is above 0; plus bias (float32 (rows, V)). Each chosen token is
    marked in seen and counted in counts. temperature 0 is greedy (the first largest adjusted
    logit; its uniform unused), else softmax(x / temperature) restricted by top_k (0: off),
    top_p (1: off) and min_p (0: off) is sampled with uniforms (float32 (rows,), in [0, 1)) by
    inverse CDF in vocabulary order. A filter given as an array runs its search for every row (a
    row turns it off with top_k 0 or top_p 1); given as a number, only where it filters. out,
    positions, counters, embed: as argmax's, the rest of a decode step in the same launches.
    """
    kind = backend(x=x, uniforms=uniforms, seen=seen, counts=counts, bias=bias,
                   **tail_arrays(out, positions, counters, embed))
    check("x", x, ndim=2)
    rows, n = x.shape
    if n == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {tuple(x.shape)}")
    temperature = _per_row("temperature", temperature, rows, kind, np.float32, lambda t: t >= 0, ">= 0")
    top_k = _per_row("top_k", top_k, rows, kind, np.int32, lambda k: k >= 0, ">= 0")
    top_p = _per_row("top_p", top_p, rows, kind, np.float32, lambda p: (p > 0) & (p <= 1), "0 < top_p <= 1")
    penalty = _per_row("penalty", penalty, rows, kind, np.float32, lambda p: p > 0, "> 0")
    min_p = _per_row("min_p", min_p, rows, kind, np.float32, lambda p: (p >= 0) & (p <= 1), "0 <= min_p <= 1")
    presence = _per_row("presence", presence, rows, kind, np.float32, np.isfinite, "a finite number")
    frequency = _per_row("frequency", frequency, rows, kind, np.float32, np.isfinite, "a finite number")
    scalar = {k: np.isscalar(v) for k, v in (("t", temperature), ("k", top_k), ("p", top_p), ("pen", penalty))}
    draws = not scalar["t"] or temperature > 0
    if draws:
        if uniforms is None:
            raise ValueError("uniforms: needed when temperature > 0")
        check("uniforms", uniforms, shape=(rows,))
    penalizes = not scalar["pen"] or penalty != 1
    if penalizes and seen is None:
        raise ValueError("seen: needed when penalty != 1")
    counted = not np.isscalar(presence) or not np.isscalar(frequency) or presence != 0 or frequency != 0
    if counted and counts is None:
        raise ValueError("counts: needed when presence or frequency != 0")
    if seen is not None:
        check("seen", seen, shape=(rows, n), dtype=np.uint8)
    for name, a in (("counts", counts), ("bias", bias)):
        if a is not None:
            check(name, a, shape=(rows, n), dtype=np.float32)
    if out is not None:
        check("out", out, shape=(rows,), dtype=np.int64)
    check_tail(rows, positions, counters, embed)
    if kind == "numpy":
        y = np.empty(rows, np.int64)
        u = np.zeros(rows) if uniforms is None else uniforms.astype(np.float64)
        at = lambda v, r: v if np.isscalar(v) else v[r].item()      # noqa: E731
        row = lambda a, r: None if a is None else a[r:r + 1]        # noqa: E731
        for r in range(rows):
            y[r] = sample_reference(x[r:r + 1], u[r:r + 1], at(temperature, r), at(top_k, r), at(top_p, r),
                                    at(penalty, r), row(seen, r), at(min_p, r), at(presence, r), at(frequency, r),
                                    row(counts, r), row(bias, r))[0]
        return tail_reference(y, out, positions, counters, embed)
    adjusts = seen is not None or counts is not None or bias is not None
    if not draws and not adjusts:
        return argmax(x, out, positions=positions, counters=counters, embed=embed)
    xp = array_module(x)
    y = xp.empty(rows, dtype=np.int64) if out is None else out
    if rows == 0:
        return y
    temp, k_rows, p_rows, pen, mp, pres, freq = (
        v if not np.isscalar(v) else xp.full(rows, v, dt)
        for v, dt in ((temperature, np.float32), (top_k, np.int32), (top_p, np.float32), (penalty, np.float32),
                      (min_p, np.float32), (presence, np.float32), (frequency, np.float32)))
    if adjusts:         # the adjusting kernels read all three: absent ones are neutral
        seen = xp.zeros((rows, n), np.uint8) if seen is None else seen
        counts = xp.zeros((rows, n), np.float32) if counts is None else counts
        bias = xp.zeros((rows, n), np.float32) if bias is None else bias
    tile = chunk_tile(n)
    chunks = -(-n // tile)
    grid, span = (chunks, rows, 1), (tile, next_pow2(chunks))
    done = last_block_counters(rows)
    m, target = xp.empty(rows, np.float32), xp.empty(rows, np.float32)
    lo, hi = xp.empty(rows, np.int32), xp.empty(rows, np.int32)
    xa = xp.empty_like(x) if adjusts else x
    launch(grid, prepare_kernel, (x, seen if adjusts else x, counts if adjusts else x, bias if adjusts else x, xa,
                                  xp.empty((rows, chunks), np.float32), xp.empty((rows, chunks), np.int32), done, m,
                                  lo, hi, temp, k_rows, pen, pres, freq, *span, adjusts))
    partial = xp.empty((rows, chunks, WAYS), np.float32)
    searches = [] if not draws else ([False] * (not scalar["k"] or 0 < top_k < n)
                                     + [True] * (not scalar["p"] or top_p < 1))
    for mass in searches:
        for i in range(-(-32 // (WAYS.bit_length() - 1))):
            launch(grid, search_kernel, (xa, m, lo, hi, target, partial, done, k_rows, p_rows, temp, *span, WAYS,
                                         min(SUB, tile), mass, mass and i == 0))
    launch(grid, draw_kernel, (xa, m, lo, xp.zeros(rows, np.float32) if uniforms is None else uniforms,
                               xp.empty((rows, chunks), np.float32), done, seen if adjusts else xa,
                               *tail_args(y, positions, counters, embed, x), temp, mp, counts if adjusts else xa,
                               *span, adjusts))
    return y
