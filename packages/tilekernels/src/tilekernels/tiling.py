"""How linear's two kernels tile a product (linear_plan): the skinny kernel's tiles, narrow
blocks and K splits for a decode step's rows, the tiles kernel's tile shapes for a sequence's.
Every choice keeps a row's arithmetic the same whatever rows share the product (batch
invariance): tiles and split points depend on the weight's shape and the bucket, never on the
other rows' values."""
from __future__ import annotations

from ._arrays import next_pow2
from .precision import DECODE_ROWS

LARGE_M = (128, 128, 32)     # (TILE_M, TILE_N, TILE_K)
GLU_LARGE_M = (128, 64, 32)  # two accumulators
BF16_LARGE_M = (128, 128, 64)     # bfloat16 operands: half the bytes a tile, twice the K
BF16_GLU_LARGE_M = (128, 64, 64)
# 3xTF32 ('highest'): 128 x 128 tiles spilled registers (the TF32 splits of both operands beside the
# accumulator); 64 x 128 at two blocks an SM holds them (docs/performance.md)
X3_LARGE_M = (64, 128, 32)
# a decode-shaped TF32 product of more rows than DECODE_ROWS whose 128 x 128 tiles leave most SMs idle
# (linear_plan): these tiles where they fill half the SMs, else a few K splits
SMALL_TILES = (64, 64, 32)
# weight rows a skinny block (two weight tiles for a gated unit), the most rows of x it takes, K a chunk;
# twice the rows for bfloat16 weights of at least WIDE_N outputs (faster for wide products such as
# GLM-ASR's gate/up and vocabulary head, slower for narrower ones)
SKINNY_N, SKINNY_GLU_N = 64, 32
WIDE_N = 4096
# half_rows_finish_sooner: the cost of a half tile is an estimate (half the work, less reuse), not a fit
HALF_M, HALF_M_COST = 64, 0.6
SEQ_NARROW_N = 2048     # bf16_sequence_tiles: 64-wide tiles short of a wave up to this many outputs
SKINNY_M = 32           # 64-row tiles summed wrong now and then (tileiras 13.4.92; docs/performance.md)
# K a chunk by the weight's bytes a value: 16 KB weight tiles of float32 (64) and of bfloat16 (128); a
# narrow bfloat16 tile that is not gated takes 256 (32 KB) unless a LayerNorm's two sums ride along
SKINNY_K = {4: 64, 2: 128}
# buckets of up to this many rows launch a product's SKINNY_N-wide tiles in blocks of half the width
# where no norm rides in the kernel (skinny_block_n)
NARROW_ROWS = 16
SKINNY_SPLIT_K = 256                 # K ranges of the split skinny kernel are multiples of this
MIN_SPLIT_UNITS = 2                  # ... and at least this many of them
SPLIT_BELOW = 1 / 3                  # ... where the output tiles cover under this share of the SMs
NARROW_K = 512                       # K a chunk of a narrow block of bfloat16 weights (skinny_block_k)
NARROW_K_F32 = (128, 256)            # ... of float32 weights: K whole, K split
REDUCE_TILE = 256


def skinny_tiles(m: int, n: int, glu: bool, itemsize: int = 4, layer_norm: bool = False) -> tuple[int, int, int]:
    """(TILE_M, TILE_N, TILE_K) of the skinny kernel for m rows against a weight of n outputs
    (a gated unit's: of each half) and `itemsize` bytes a value, a LayerNorm's sums in the
    kernel or not: the batch bucket's rows (16 or 32, an mma's width; 64 and 128 rows run as 2
    and 4 blocks of 32) against the same TILE_N x TILE_K weight tiles at every bucket, so a
    row's products and its norm's sums are added in the same order whatever rows share its
    block."""
    tile_n = (SKINNY_GLU_N if glu else SKINNY_N) * (2 if itemsize == 2 and n >= WIDE_N else 1)
    tile_k = SKINNY_K[itemsize]
    if itemsize == 2 and tile_n == SKINNY_N and not glu and not layer_norm:
        tile_k *= 2
    return min(SKINNY_M, max(16, next_pow2(m))), tile_n, tile_k


def skinny_block_n(m: int, tile_n: int, in_kernel_norm: bool) -> int:
    """Output columns a skinny block computes for m rows: half of a SKINNY_N-wide tile at up to
    NARROW_ROWS rows where no norm rides in the kernel, else the tile's. The weight tiles' K chunks
    and split points (skinny_splits, from tile_n) stay, and a 32-row tile's mma (HMMA) adds each
    output's products in the same order as a 64-row one's (HGMMA): the same bits at 1-128
    rows. Twice the blocks at one row keep more weight loads in flight. A norm's row sums add in
    the register layout's order, which the two mmas lay out differently: normed products keep
    their tiles."""
    return tile_n // 2 if m <= NARROW_ROWS and tile_n == SKINNY_N and not in_kernel_norm else tile_n


def skinny_block_k(m: int, k: int, tile_k: int, per: int, in_kernel_norm: bool, split: int = 1,
                   glu: bool = False, x3: bool = False) -> tuple[int, int]:
    """(K a chunk, chunks a split) of a skinny block for m rows: at up to NARROW_ROWS rows where no
    norm rides in the kernel, and the split ranges and K hold whole chunks of it, NARROW_K for
    bfloat16 weight tiles of 256 (twice theirs) and NARROW_K_F32 for float32 ones of 64 in a
    TF32 product not gated (two or four of theirs: 256 where K is split, 128 where it is whole;
    3xTF32 splits each tile in two more, measured at 64 only). An mma adds a slice of K
    at a time, in order, however long the chunk: the same bits. One round trip for a long chunk
    rather than several for short ones (faster at 1 row, slower at 64: wider blocks keep theirs);
    float32 at 1 and 16 rows, e.g. K = 6144 -> N = 2048 0.031 -> 0.020 ms (H100)."""
    if m > NARROW_ROWS or in_kernel_norm:
        return tile_k, per
    if tile_k == SKINNY_K[4] and not glu and not x3:
        chunk = NARROW_K_F32[split > 1]
    elif 2 * tile_k == NARROW_K:
        chunk = NARROW_K
    else:
        return tile_k, per
    f = chunk // tile_k
    return (chunk, per // f) if per % f == 0 and k % chunk == 0 else (tile_k, per)


def skinny_splits(n: int, k: int, tile_n: int, tile_k: int, glu: bool = False, sms: int = 132) -> tuple[int, int]:
    """(K tiles per split, splits) of the skinny kernel: K is cut only where the output tiles
    cover under SPLIT_BELOW of the SMs (a gated unit's block streams two weight tiles: it counts
    twice), and only as far as every split keeps MIN_SPLIT_UNITS x SKINNY_SPLIT_K of it and the
    blocks of one row block fit the SMs, one each (a split's partial sums cost a store, a count
    and a reload: GLM-ASR's qkv takes K whole, its o and down 4 splits). K is cut at multiples
    of SKINNY_SPLIT_K, so every batch bucket adds the same partial sums in the same order: a
    row's result does not depend on the rows beside it."""
    k_units = -(-k // SKINNY_SPLIT_K)
    tiles = -(-n // tile_n) * (2 if glu else 1)
    want = 1 if tiles >= SPLIT_BELOW * sms else max(1, min(k_units // MIN_SPLIT_UNITS, sms // tiles))
    per_units = -(-k_units // want)
    return per_units * (SKINNY_SPLIT_K // tile_k), -(-k_units // per_units)


def half_rows_finish_sooner(m: int, n_tiles: int, slots: int) -> bool:
    """Whether HALF_M-row tiles end a sequence product of m rows and n_tiles column tiles in less
    time than full ones on `slots` resident blocks, counting rounds of the slots and a half tile
    as HALF_M_COST of a full one: a 30 s window's encoder (1,500 rows) and prompt (~400) leave
    most slots idle in 128-row tiles. A row's result is the same in either (the same K chunks
    added in the same order), so a prompt's does not depend on the prompts beside it."""
    full, half = -(-m // LARGE_M[0]) * n_tiles, -(-m // HALF_M) * n_tiles
    return -(-half // slots) * HALF_M_COST < -(-full // slots)


def bf16_sequence_tiles(m: int, n: int, glu: bool, sms: int) -> tuple[int, int]:
    """(TILE_M, TILE_N) of a sequence's bfloat16 product: 128 x 128 from a wave of them (SMs) up;
    short of it 128 x 64 where N <= SEQ_NARROW_N, else half rows where they finish sooner; a gated
    unit's halves 128 x 64.
    A row's bits are the same in every tile (the same K chunks added in the same order)."""
    rows, wide = BF16_LARGE_M[:2]
    narrow = BF16_GLU_LARGE_M[1]
    if glu:
        return rows, narrow
    if -(-m // rows) * -(-n // wide) >= sms:
        return rows, wide
    if n <= SEQ_NARROW_N:
        return rows, narrow
    return (HALF_M if half_rows_finish_sooner(m, -(-n // wide), 2 * sms) else rows), wide


def linear_plan(m: int, n: int, k: int, glu: bool = False, sms: int = 132, bf16_mma: bool = False,
                sequence: bool = False, itemsize: int = 4, layer_norm: bool = False, x3: bool = False):
    """Which kernel and tiles for an (M, N outputs, K) product: ('skinny', tiles) or
    ('tiles', tiles, K tiles per split, splits).

    A decode step's products (one token a sequence: sequence False) of up to DECODE_ROWS rows,
    batch 1 included, take the skinny kernel, whose arithmetic for a row is the same at every
    batch size, so a request's logits do not depend on what decodes beside it. A sequence's
    products (prompts, encoders) take the tiles kernel without split-K, whose arithmetic for a
    row is likewise the same whatever rows share the product. Split-K serves only the
    decode-shaped products of more than DECODE_ROWS rows whose output tiles cover under a
    quarter of the SMs (its partial sums cost a pass over memory and a reduce kernel,
    slower from half a wave up; TF32 ones take SMALL_TILES where those fill half the SMs, and
    sms // tiles splits where the tiles cover a quarter to a third of them). x3: the product
    runs in 3xTF32 (X3_LARGE_M tiles but for a gated unit)."""
    if not sequence and m <= DECODE_ROWS:
        return "skinny", skinny_tiles(m, n, glu, itemsize, layer_norm)
    tm, tn, tk = (BF16_GLU_LARGE_M if glu else BF16_LARGE_M) if bf16_mma else GLU_LARGE_M if glu else LARGE_M
    if x3 and not glu:
        tm, tn, tk = X3_LARGE_M
    elif sequence and bf16_mma:
        tm, tn = bf16_sequence_tiles(m, n, glu, sms)
    elif sequence and half_rows_finish_sooner(m, -(-n // tn), sms):
        tm = HALF_M
    out_tiles = -(-m // tm) * -(-n // tn)
    k_tiles = -(-k // tk)
    if not (glu or sequence or bf16_mma or x3) and 3 * out_tiles <= sms:
        small = -(-m // SMALL_TILES[0]) * -(-n // SMALL_TILES[1])
        if 4 * out_tiles <= sms and 2 * small >= sms:       # TF32 M=512 K=3072 N=768: 0.025 -> 0.016 ms
            return "tiles", SMALL_TILES, -(-k // SMALL_TILES[2]), 1
        if 4 * out_tiles > sms:                             # ... K=5120 N=1280 in 3 splits: 0.054 -> 0.038 ms
            per = -(-k_tiles // (sms // out_tiles))
            return "tiles", (tm, tn, tk), per, -(-k_tiles // per)
    split = 1 if glu or sequence or 4 * out_tiles > sms else min(k_tiles, -(-2 * sms // out_tiles), 64)
    per = -(-k_tiles // split)
    return "tiles", (tm, tn, tk), per, -(-k_tiles // per)
