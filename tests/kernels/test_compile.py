"""Compile every kernel, in every specialization the models use, for four GPU generations.

No GPU is needed: export_kernel runs the cuTile front end and tileiras, which catches
typing and lowering errors on a CPU-only machine.
"""
import io
import os

import cuda.tile as ct
import pytest
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                   ScalarConstraint, export_kernel)

from importlib import import_module

from tilekernels._arrays import next_pow2

# the op functions shadow their module names on the package, so import the modules by path
act, argmax, attention, decode_attn, embedding, linear, logprobs, lstm, norm, qkv, rope, sampling, softmax, tiling = (
    import_module(f"tilekernels.{m}")
    for m in ("activations", "argmax", "attention", "decode_attention", "embedding", "linear", "logprobs", "lstm", "norm",
              "qkv", "rope", "sampling", "softmax", "tiling"))

ARCHS = os.environ.get("TK_ARCHS", "sm_80 sm_90 sm_100 sm_120").split()
I32, F32 = ScalarConstraint(ct.int32), ScalarConstraint(ct.float32)


def iarr(ndim):
    return arr(ndim, dtype=ct.int32)


def arr(ndim, contiguous=True, dtype=ct.float32):
    return ArrayConstraint(dtype, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (ndim - 1) + (1,) if contiguous else None)


W32, W16 = ct.float32, ct.uint16    # weight storage: bfloat16 weights reach the kernels as uint16 bits


def specializations():
    """(name, kernel, parameters) for each specialization the two models launch."""
    out = []
    for n in (768, 1024, 1280, 1600, 2048):          # GPT-2 sizes, GLM encoder, GLM decoder
        rows, tile = norm.norm_config(n)
        for rms in (False, True):
            for affine in (False, True):
                out.append((f"norm-{n}-rms{rms}-affine{affine}", norm.norm_kernel,
                            [arr(2), arr(1), arr(1), arr(2), F32, F32, rows, tile, rms, affine]))
    for code in (act.GELU_TANH, act.GELU_ERF, act.SILU, act.RELU, act.SIGMOID):
        for gated in (False, True):
            out.append((f"act-{code}-{gated}", act.activation_kernel,
                        [arr(1), arr(1), arr(1), act.ELEMENTWISE_TILE, code, gated]))
    out.append(("cast-bf16", act.activation_kernel, [arr(1), arr(1), arr(1, dtype=W16), act.ELEMENTWISE_TILE, act.NONE,
                                                     False]))
    # (bias, act, glu, residual, norm) of the models' decode projections
    # (bias, act, glu, residual, norm, scale, weight dtype): GPT-2 (norms folded), GLM-ASR (RMSNorm
    # weights applied in the kernel, bfloat16 weights)
    decode = [(True, 0, False, False, linear.LAYER, False, W32), (True, 0, False, True, linear.NO_NORM, False, W32),
              (True, act.GELU_TANH, False, False, linear.LAYER, False, W32),
              (False, 0, False, False, linear.LAYER, False, W32), (False, 0, False, False, linear.RMS, True, W16),
              (False, 0, False, True, linear.NO_NORM, False, W16), (False, act.SILU, True, False, linear.RMS, True, W16),
              (False, act.SILU, True, False, linear.RMS, False, W32), (False, 0, False, False, linear.NO_NORM, False, W32)]
    for bias, code, glu, res, nrm, scale, wt in decode:
        name = f"{bias}-{code}-glu{glu}-res{res}-norm{nrm}-scale{scale}-{wt}"
        w = arr(2, dtype=wt)
        cases = [(0, 1, False, W32, 768), (0, 8, False, W32, 768), (1, 8, True, W32, 768), (0, 64, True, W32, 768),
                 (0, 128, True, W32, 768)]
        if wt == W16:       # precision 'medium': bfloat16 MMA, x float32 or bfloat16, narrow and wide weight tiles
            cases += [(2, 1, True, W32, 6144), (2, 64, True, W16, 2048), (2, 1, True, W16, 2048)]
        for precise, m, split, xt, n in cases:
            kernel = linear.skinny_kernel_one_an_sm if m == 8 else linear.skinny_kernel
            tm, tn, tk = tiling.skinny_tiles(m, n, glu, 2 if wt == W16 else 4, nrm == linear.LAYER)
            # 512 for a narrow bfloat16 block; float32: 256 split, 128 whole
            tk = tiling.skinny_block_k(m, 2048, tk, 4, nrm != linear.NO_NORM, 4 if split else 1, glu, precise == 1)[0]
            two = res and wt == W16     # a residual stream stored in float32 and in bfloat16 (and scaled)
            xs_in = nrm == linear.RMS and scale and wt == W16 and m > tiling.NARROW_ROWS    # GLM-ASR's, scaled ahead
            out.append((f"skinny-{name}-p{precise}-m{m}-split{split}-x{xt}-n{n}", kernel,
                        [arr(2, dtype=xt), w, w, arr(1), arr(1), arr(2), arr(2), arr(2, dtype=W16 if two else W32),
                         arr(2, dtype=W16), arr(3), arr(3), arr(3), iarr(1), F32, I32,
                         tm, tiling.skinny_block_n(m, tn, nrm != linear.NO_NORM), tk, bias, code, glu,
                         res, nrm, scale, precise, 4 if split else 1, two, xs_in, two]))
    for bias, code, glu, res, wt in ((True, 0, False, False, W32), (True, 0, False, True, W32),
                                     (True, act.GELU_ERF, False, False, W32), (True, act.GELU_TANH, False, False, W32),
                                     (False, 0, False, False, W32), (False, 0, False, True, W32),
                                     (False, act.SILU, True, False, W32), (True, 0, False, True, W16),
                                     (True, act.GELU_ERF, False, False, W16), (False, 0, False, True, W16),
                                     (False, act.SILU, True, False, W16)):
        tiles = tiling.GLU_LARGE_M if glu else tiling.LARGE_M
        w = arr(2, dtype=wt)
        for precise in (False, True):
            out.append((f"linear-{bias}-{code}-glu{glu}-res{res}-{wt}-p{precise}", linear.linear_kernel,
                        [arr(2), w, w, arr(1), arr(2), arr(2), I32, *tiles, bias, code, glu, res, False, precise]))
    # precision 'medium': bfloat16 inputs and weights on BF16 tensor cores (the encoder's and a prefill's products),
    # the first MLP projection storing its output in bfloat16 for the second
    for bias, code, glu, res, out_w in ((True, 0, False, False, W32), (True, act.GELU_ERF, False, False, W16),
                                        (True, 0, False, True, W32), (False, act.SILU, True, False, W16),
                                        (False, 0, False, True, W32)):
        full = tiling.BF16_GLU_LARGE_M if glu else tiling.BF16_LARGE_M
        w16 = arr(2, dtype=W16)
        out_arrays = [w16, w16, w16, arr(1), arr(2), arr(2, dtype=out_w), I32]
        narrow = () if glu else ((128, 64, full[2]),)              # short of a wave, N <= SEQ_NARROW_N
        for tiles in (full, (tiling.HALF_M, *full[1:]), *narrow):  # half rows: a wide prompt product
            out.append((f"linear-bf16-{bias}-{code}-glu{glu}-res{res}-out{out_w}-m{tiles[0]}-n{tiles[1]}",
                        linear.linear_kernel_occupancy2, [*out_arrays, *tiles, bias, code, glu, res, False, 2]))
    for n in (1280, 2048):
        rows, tile = norm.norm_config(n)
        out.append((f"norm-{n}-bf16-out", norm.norm_kernel,
                    [arr(2), arr(1), arr(1), arr(2, dtype=W16), F32, F32, rows, tile, n == 2048, True]))
        out.append((f"norm-{n}-bf16-in", norm.norm_kernel,       # a residual stream's bfloat16 copy
                    [arr(2, dtype=W16), arr(1), arr(1), arr(2, dtype=W16), F32, F32, rows, tile, n == 2048, True]))
    out.append(("linear-small-tiles", linear.linear_kernel,      # few 128 x 128 tiles of many rows (linear_plan)
                [*[arr(2)] * 3, arr(1), arr(2), arr(2), I32, *tiling.SMALL_TILES, True, 0, False, False, False, False]))
    out.append(("linear-partial", linear.linear_kernel,
                [*[arr(2)] * 3, arr(1), arr(2), arr(3), I32, *tiling.LARGE_M, False, 0, False, False, True, False]))
    for bias, code, res in ((False, 0, False), (True, 0, False), (True, 0, True), (True, act.GELU_TANH, False),
                            (True, act.GELU_ERF, False), (False, 0, True)):
        out.append((f"splitk-{bias}-{code}-res{res}", linear.splitk_reduce_kernel,
                    [arr(3), arr(1), arr(2), arr(2), tiling.REDUCE_TILE, bias, code, res]))
    out.append(("softmax", softmax.softmax_kernel, [arr(2), arr(2), softmax.MAX_TILE]))
    out.append(("softmax-stats", softmax.softmax_stats_kernel, [arr(2), arr(2), arr(2), 2, softmax.SPLIT_TILE]))
    out.append(("softmax-split", softmax.softmax_split_kernel,
                [arr(2), arr(2), arr(2), arr(2), 2, softmax.SPLIT_TILE, 32]))
    for code in (act.RELU, act.SIGMOID):      # Silero VAD's convs and head (3xTF32)
        out.append((f"linear-{code}-highest", linear.linear_kernel,
                    [arr(2), arr(2), arr(2), arr(1), arr(2), arr(2), I32, *tiling.LARGE_M, True, code, False, False,
                     False, 1]))
    for hid, mode in ((128, 1), (128, 0), (32, 1)):     # Silero VAD's (3xTF32), TF32, a small one
        out.append((f"lstm-{hid}-mode{mode}", lstm.lstm_kernel,
                    [arr(3), arr(2), arr(2), arr(2), arr(3), arr(2), arr(2), I32, hid // 2, lstm.TILE_B, mode]))
    # the two vocabularies: a plain argmax, and a decode graph's step tail (positions, the cache span
    # (2 counters), the next token's embedding: GPT-2 tokens + positions, GLM decoder tokens in bfloat16)
    i64 = arr(1, dtype=ct.int64)
    for v, c, pos, wt in ((50257, 768, True, W32), (59264, 2048, False, W16)):
        tile = argmax.chunk_tile(v)
        for tail in (False, True):
            out.append((f"argmax-{v}-tail{tail}", argmax.argmax_kernel,
                        [arr(2), arr(2), iarr(2), iarr(1), i64, i64, iarr(1) if tail else i64, arr(2, dtype=wt),
                         arr(2, dtype=wt), arr(2), 2 if tail else 1, min(next_pow2(c), argmax.EMBED_TILE), tail,
                         tail, tail, tail and pos, tile, next_pow2(-(-v // tile))]))
    # sampling over GPT-2's vocabulary: with and without the penalty (prepare), count and mass passes (search),
    # the draw alone and with a decode graph's step tail
    tile = argmax.chunk_tile(50257)
    span = (tile, next_pow2(-(-50257 // tile)))
    u8 = arr(2, dtype=ct.uint8)
    for adjust in (False, True):
        out.append((f"sample-prepare-a{adjust}", sampling.prepare_kernel,
                    [arr(2), u8 if adjust else arr(2), arr(2), arr(2), arr(2), arr(2), iarr(2), iarr(1), arr(1),
                     iarr(1), iarr(1), arr(1), iarr(1), arr(1), arr(1), arr(1), *span, adjust]))
    for mass, first in ((False, False), (True, True), (True, False)):
        out.append((f"sample-search-m{mass}-f{first}", sampling.search_kernel,
                    [arr(2), arr(1), iarr(1), iarr(1), arr(1), arr(3), iarr(1), iarr(1), arr(1), arr(1), *span,
                     sampling.WAYS, sampling.SUB, mass, first]))
    for tail, mark in ((False, False), (True, True)):
        out.append((f"sample-draw-tail{tail}-mark{mark}", sampling.draw_kernel,
                    [arr(2), arr(1), iarr(1), arr(1), arr(2), iarr(1), u8 if mark else arr(2), i64, i64,
                     iarr(1) if tail else i64, arr(2), arr(2), arr(2), 2 if tail else 1, 1024, tail, tail, tail, tail,
                     arr(1), arr(1), arr(2), *span, mark]))
    for top in (0, 1, logprobs.MAX_TOP):          # log-probabilities: the chosen token's alone, and with alternatives
        width = next_pow2(max(top, 1))
        out.append((f"logprobs-top{top}", logprobs.logprobs_kernel,
                    [arr(2), i64, arr(2), arr(2), arr(3), iarr(3), iarr(1), arr(1), arr(2), arr(2, dtype=ct.int64),
                     *span, top, width]))
    for c, pos, wt in ((768, True, W32), (2048, False, W16)):      # GPT-2 tokens + positions, GLM decoder tokens
        ids = arr(1, dtype=ct.int64)
        out.append((f"embedding-{c}-pos{pos}-{wt}", embedding.embedding_kernel,
                    [ids, ids, arr(2, dtype=wt), arr(2, dtype=wt), arr(2), pos, min(next_pow2(c), embedding.MAX_TILE)]))
    for d in (64, 128):
        for causal, precise in ((False, False), (True, False), (False, True)):
            tm, tn, kernel = attention.flash_plan(d, causal)
            out.append((f"flash-{d}-{causal}-p{precise}", kernel,
                        [arr(4), arr(4, False), arr(4, False), arr(4), iarr(1), F32, I32, d, tm, tn, causal, precise]))
        for new, rope_on, kv in ((False, False, ct.float32), (True, d == 128, ct.float32),
                                 (True, d == 128, ct.uint16), (False, False, ct.uint16)):
            for rows in (False, True) if new else (False,):     # rows: the engine's slots, lengths (B,) int64
                lengths = arr(1, dtype=ct.int64) if rows else iarr(1)
                itemsize = 2 if kv == ct.uint16 else 4
                # one block an SM (a few sequences), the copy for full grids (64 sequences of 12 KV heads)
                kernels = list(dict.fromkeys(decode_attn.decode_kernel_for(itemsize, d, pairs, 132)
                                             for pairs in (4, 64 * 12)))
                halves = ((d // 2, 24) if rows else (d // 2,)) if rope_on else (0,)   # 24: gathered partners
                modes = (0, 2) if itemsize == 2 else (0,)     # a bfloat16 cache at 'medium': bfloat16 products
                for i, (kernel, half, mode) in enumerate((k, h, m) for k in kernels for h in halves for m in modes):
                    out.append((f"decode-{d}-new{new}-rope{rope_on}-{kv}-rows{rows}-{i}", kernel,
                                [arr(4, False), arr(4, False, kv), arr(4, False, kv), arr(4, False), arr(4, False),
                                 arr(4), arr(5), arr(4), arr(4), iarr(1), iarr(1), lengths, arr(3), arr(3), F32, I32,
                                 I32, d, half, decode_attn.group_rows(4 if d == 128 else 1),
                                 decode_attn.tile_keys(d, itemsize, mode), mode, new, rope_on, rows]))
    tm, tn, kernel = attention.flash_plan(64, False, bf16=True)      # GLM-ASR's encoder at precision bf16
    out.append(("flash-64-bf16", kernel, [arr(4, dtype=W16), arr(4, False, W16), arr(4, False, W16), arr(4, dtype=W16),
                                          iarr(1), F32, I32, 64, tm, tn, False, 2]))
    for heads, d in ((20, 64), (16, 128), (4, 128)):   # GLM encoder q/k, decoder q, decoder k
        out.append((f"rope-{heads}-{d}", rope.rope_kernel,
                    [arr(4), arr(3), arr(3), arr(4), I32, next_pow2(heads), d]))
    for d, rope_on, kv in ((64, False, ct.float32), (128, True, ct.float32), (64, True, ct.float32),
                           (64, False, ct.uint16), (128, True, ct.uint16), (64, True, ct.uint16)):
        # GPT-2, GLM decoder, GLM encoder (float32, and bfloat16 projection, q, k, v at precision bf16)
        q = arr(4, dtype=ct.uint16) if (d, rope_on, kv) == (64, True, ct.uint16) else arr(4)
        out.append((f"split-qkv-{d}-rope{rope_on}-{kv}", qkv.split_qkv_kernel,
                    [q, arr(4, dtype=kv), arr(4, dtype=kv), q, iarr(1), iarr(1), arr(3), arr(3),
                     qkv.split_tile_t(d), d, (d // 4 if d == 64 else d // 2) if rope_on else 0]))
    out.append(("split-qkv-64-rope24", qkv.split_qkv_kernel,      # a rotary width not a power of two gathers
                [arr(4), arr(4), arr(4), arr(4), iarr(1), iarr(1), arr(3), arr(3), qkv.split_tile_t(64), 64, 12]))
    return out


SPECS = specializations()


@pytest.mark.parametrize("name,kernel,params", SPECS, ids=[s[0] for s in SPECS])
def test_kernel_compiles(name, kernel, params):
    sig = KernelSignature(params, CallingConvention.cutile_python_v1())
    for arch in ARCHS:
        buf = io.BytesIO()
        export_kernel(kernel, [sig], buf, gpu_code=arch, output_format="cubin")
        assert len(buf.getvalue()) > 1000, f"{name} {arch}: empty cubin"


# the models' decode products: (outputs of a half for swiglu, K, swiglu)
DECODE_SHAPES = {"glm qkv": (3072, 2048, False), "glm o": (2048, 2048, False), "glm gate/up": (6144, 2048, True),
                 "glm down": (2048, 6144, False), "glm head": (59264, 2048, False), "gpt2 qkv": (2304, 768, False),
                 "gpt2 o": (768, 768, False), "gpt2 fc1": (3072, 768, False), "gpt2 fc2": (768, 3072, False),
                 "gpt2 head": (50257, 768, False)}


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=list(DECODE_SHAPES))
def test_skinny_splits_cut_k_the_same_way_at_every_batch(shape, itemsize):
    """The split-K plan of a decode product covers K once, keeps every split at least
    MIN_SPLIT_UNITS x SKINNY_SPLIT_K long and a row block's blocks within the SMs, and is the same in
    K (not in K tiles: they differ by weight dtype) for every batch bucket, which keeps a row's
    sums in one order whatever decodes beside it."""
    n, k, glu = DECODE_SHAPES[shape]
    plans = set()
    for m in (1, 2, 8, 16, 32, 64, 128):
        _, tile_n, tile_k = tiling.skinny_tiles(m, n, glu, itemsize)
        per, splits = tiling.skinny_splits(n, k, tile_n, tile_k, glu, 132)
        span = per * tile_k                         # K a split covers
        assert (splits - 1) * span < k <= splits * span
        assert span % tiling.SKINNY_SPLIT_K == 0
        if splits > 1:
            assert span >= tiling.MIN_SPLIT_UNITS * tiling.SKINNY_SPLIT_K
            assert -(-n // tile_n) * (2 if glu else 1) * splits <= 132
        plans.add((span, splits))
    assert len(plans) == 1


def test_skinny_splits_of_the_models():
    """What the sweep chose (docs/performance.md): gpt2's K = 768 products and GLM-ASR's gated
    unit, qkv and head take no split; GLM-ASR's o and down projections 4, gpt2's fc2 6."""
    def splits(name):
        n, k, glu = DECODE_SHAPES[name]
        _, tile_n, tile_k = tiling.skinny_tiles(1, n, glu, 2)
        return tiling.skinny_splits(n, k, tile_n, tile_k, glu, 132)[1]

    assert {name: splits(name) for name in DECODE_SHAPES} == {
        "glm qkv": 1, "glm o": 4, "glm gate/up": 1, "glm down": 4, "glm head": 1,
        "gpt2 qkv": 1, "gpt2 o": 1, "gpt2 fc1": 1, "gpt2 fc2": 6, "gpt2 head": 1}


def test_narrow_blocks_only_where_no_norm_rides_along():
    """At up to NARROW_ROWS rows a product without a norm in the kernel (o, down, gpt2's c_proj
    and fc2) runs its 64-wide tiles as 32-wide blocks; normed products (whose row sums add in the
    mma's register order) and wide tiles keep theirs, and so does every larger bucket."""
    for m in (1, 2, 8, 16):
        assert tiling.skinny_block_n(m, tiling.SKINNY_N, False) == tiling.SKINNY_N // 2
        assert tiling.skinny_block_n(m, tiling.SKINNY_N, True) == tiling.SKINNY_N
        assert tiling.skinny_block_n(m, 2 * tiling.SKINNY_N, False) == 2 * tiling.SKINNY_N
    for m in (17, 32, 64, 128):
        assert tiling.skinny_block_n(m, tiling.SKINNY_N, False) == tiling.SKINNY_N


def test_narrow_blocks_take_long_chunks_where_the_splits_hold_them():
    """At up to NARROW_ROWS rows GLM-ASR's o and down projections and gpt2's fc2 (bfloat16, no
    norm in the kernel, split ranges of an even count of 256-wide chunks) fold 512 of K a chunk,
    covering each split's range as before; float32 weights 256 where K is split and 128 where it
    is whole (gpt2's c_proj), a gated unit's its 64; normed products, gpt2's bfloat16 c_proj (768
    a split) and every larger bucket keep their chunks."""
    def block_k(name, m, itemsize=2, norm=False):
        n, k, glu = DECODE_SHAPES[name]
        _, tile_n, tile_k = tiling.skinny_tiles(m, n, glu, itemsize)
        per, split = tiling.skinny_splits(n, k, tile_n, tile_k, glu, 132)
        got = tiling.skinny_block_k(m, k, tile_k, per, norm, split, glu)
        assert got[0] * got[1] == tile_k * per          # the same K a split
        return got[0]

    for m in (1, 7, 16):
        assert {name: block_k(name, m) for name in ("glm o", "glm down", "gpt2 fc2", "gpt2 o")} == {
            "glm o": 512, "glm down": 512, "gpt2 fc2": 512, "gpt2 o": 256}
        assert block_k("glm qkv", m, norm=True) == block_k("glm o", m, norm=True) == 256
        assert {name: block_k(name, m, itemsize=4) for name in ("glm o", "glm down", "gpt2 o", "glm gate/up")} == {
            "glm o": 256, "glm down": 256, "gpt2 o": 128, "glm gate/up": 64}
        assert block_k("glm o", m, itemsize=4, norm=True) == 64
        n, k, _ = DECODE_SHAPES["glm o"]
        assert tiling.skinny_block_k(m, k, 64, 8, False, 4, x3=True) == (64, 8)      # 3xTF32 keeps its tiles
    for m in (17, 32, 64, 128):
        assert block_k("glm o", m) == block_k("glm down", m) == 256
        assert block_k("glm o", m, itemsize=4) == 64


@pytest.mark.parametrize("rows,n", [(1, 4097), (8, 50257), (4, 59264), (64, 8191), (66, 50257), (7, 769)])
def test_softmax_splits_cover_every_chunk_once(rows, n):
    """Few long rows are cut into splits of at least two chunks covering the row exactly; rows
    filling half the SMs, or short ones, stay a block each."""
    from tilekernels.softmax import SPLIT_TILE, softmax_splits

    per, splits = softmax_splits(rows, n, 132)
    chunks = -(-n // SPLIT_TILE)
    if 2 * rows >= 132 or chunks < 4:
        assert splits == 1
    else:
        assert per >= 2 and (splits - 1) * per < chunks <= splits * per and rows * splits <= 4 * 132


def test_few_tiles_of_many_rows_take_small_tiles_or_a_few_splits():
    """A decode-shaped TF32 product of more than DECODE_ROWS rows whose 128 x 128 tiles leave most
    SMs idle takes 64 x 64 tiles where they fill half of them, else at most sms // tiles K splits
    covering K once; bfloat16, sequences and 3xTF32 keep their tiles."""
    assert tiling.linear_plan(512, 768, 3072) == ("tiles", tiling.SMALL_TILES, 96, 1)
    kind, tiles, per, split = tiling.linear_plan(512, 1280, 5120)
    assert tiles == tiling.LARGE_M and split == 3 and per * split >= 5120 // 32 > per * (split - 1)
    seq = tiling.linear_plan(512, 768, 3072, sequence=True)
    assert seq[1] != tiling.SMALL_TILES and seq[3] == 1
    assert tiling.linear_plan(512, 768, 3072, bf16_mma=True)[1] == tiling.BF16_LARGE_M
    assert tiling.linear_plan(4096, 768, 3072) == ("tiles", tiling.LARGE_M, 96, 1)
