"""Dropout's keep mask in Gluon (triton 3.6, imported with the Gluon kernels only): the mask
of flashop/kernels/common.py's dropout_keep, drawn where a Hopper wgmma accumulator holds
the scores, so that no random bit moves between threads.

With query i = 16 a + 8 y + r (r < 8) and key j = 16 c + 8 x + 2 u + z (u < 4), one
Philox4x32-7 draw of the counter (4 c + u, 8 a + r, h, b) decides the pairs (y, x, z) by
half z of word 2 y + x. An accumulator thread holds, per 16 x 16 block of its tile, rows
R and R + 8 and columns 2 C, 2 C + 1, 2 C + 8, 2 C + 9 (R from its lane's bits 2-4, C from
bits 0-1):
- queries on rows (the forward's S): the block's eight scores are one draw's, whole;
- keys on rows (the backward's S^T): the block's keys 2 u + z hold one z, so a draw serves
  four scores, and the thread draws for its two queries 2 C and 2 C + 1 (each draw made
  by the two lanes that differ in z).
Each layout below gives the draws' tensor, whose joins, permutation and reshape land on the
accumulator's layout without moving data (convert_layout(..., assert_trivial=True)).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function


@gluon.jit
def _mul_wide(x, m):
    """(high, low) words of the 64-bit product x * m (uint32 tensor and scalar): one
    ``mul.wide.u32``, which ptxas makes one IMAD.WIDE, where mul.hi and mul.lo make two
    instructions."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b64 t;\n\tmul.wide.u32 t, $2, $3;\n\tmov.b64 {$1, $0}, t;\n\t}",
        "=r,=r,r,r", [x, m], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def philox(k0, k1, c0, c1, c2, c3, WIDE: gl.constexpr):
    """Philox4x32-7 of the counter (c0, c1, c2, c3) (uint32 tensors) under the key (k0, k1)
    (uint32 scalars): its four words. The same function as flashop/kernels/common.py's
    philox, which the tl kernels draw with (Gluon cannot call it). WIDE: each round's two
    products by _mul_wide, one instruction each, else by mul.hi and mul.lo (two; fewer
    registers live, where the draws run beside large accumulators)."""
    m0 = gl.full([], 0xD2511F53, gl.uint32)
    m1 = gl.full([], 0xCD9E8D57, gl.uint32)
    for _ in gl.static_range(7):
        if WIDE:
            hi0, lo0 = _mul_wide(c0, m0)
            hi2, lo2 = _mul_wide(c2, m1)
            c0 = hi2 ^ c1 ^ k0
            c2 = hi0 ^ c3 ^ k1
            c1 = lo2
            c3 = lo0
        else:
            p0, p2 = c0, c2
            c0 = gl.umulhi(m1, p2) ^ c1 ^ k0
            c2 = gl.umulhi(m0, p0) ^ c3 ^ k1
            c1 = m1 * p2
            c3 = m0 * p0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def dropout_args(dropout_seed, dropout_p, DROPOUT: gl.constexpr):
    """(k0, k1, threshold) where DROPOUT (zeros otherwise): Philox's 64-bit key, the int64
    ``dropout_seed[0]``, as two uint32 words, and the 16 bits a kept pair reaches."""
    k0 = gl.full([], 0, gl.uint32)
    k1 = k0
    threshold = k0
    if DROPOUT:
        seed = gl.load(dropout_seed).to(gl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
        threshold = (dropout_p * 65536.0).to(gl.uint32)
    return k0, k1, threshold


@constexpr_function
def _rows_layout(ROWS, BLOCK_N):
    """The forward's draws, [ROWS / 16, 8, BLOCK_N / 16, 4] indexed (a, r, c, u): draw
    (a, r, c, u) in lane 4 r + u of warp a, a register per c."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i, 0] for i in range((BLOCK_N // 16).bit_length() - 1)],
        lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range((ROWS // 16).bit_length() - 1)],
        block_bases=[], shape=[ROWS // 16, 8, BLOCK_N // 16, 4])


@gluon.jit
def draw_rows(start_q, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """[ROWS / 16, 8, 1, 1]: the counter's query word 8 a + r of a consumer group's rows
    [start_q, + ROWS) (start_q a multiple of 16), for keep_rows."""
    layout: gl.constexpr = _rows_layout(ROWS, BLOCK_N)
    ar_layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, layout))
    o_a = gl.arange(0, ROWS // 16, layout=gl.SliceLayout(1, ar_layout))
    o_r = gl.arange(0, 8, layout=gl.SliceLayout(0, ar_layout))
    c_q = ((start_q // 16 + gl.expand_dims(o_a, 1)) * 8 + gl.expand_dims(o_r, 0)).to(gl.uint32)
    return gl.expand_dims(gl.expand_dims(c_q, 2), 3)


@gluon.jit
def keep_rows(k0, k1, c_q, i_b, i_h, start_k, threshold, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The keep mask [ROWS, BLOCK_N] of a consumer group's scores (queries on rows, in
    ``s_layout``, the wgmma accumulator's) against keys [start_k, + BLOCK_N) (start_k a
    multiple of 16) of head i_h of batch entry i_b; ``c_q`` from draw_rows. A pair is kept
    where its 16 bits reach ``threshold``."""
    layout: gl.constexpr = _rows_layout(ROWS, BLOCK_N)
    cu_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, layout))
    o_c = gl.arange(0, BLOCK_N // 16, layout=gl.SliceLayout(1, cu_layout))
    o_u = gl.arange(0, 4, layout=gl.SliceLayout(0, cu_layout))
    # [1, 1, BLOCK_N / 16, 4]: the counter's key word 4 c + u
    c_k = (start_k // 16 * 4 + gl.expand_dims(o_c * 4, 1) + gl.expand_dims(o_u, 0)).to(gl.uint32)
    c_k = gl.expand_dims(gl.expand_dims(c_k, 0), 0)
    zero = c_q * 0 + c_k * 0
    w0, w1, w2, w3 = philox(k0, k1, zero + c_k, zero + c_q, zero + i_h.to(gl.uint32),
                            zero + i_b.to(gl.uint32), True)
    # [a, r, c, u, x, y, z]: half z of word 2 y + x, then [a, y, r, c, x, u, z] = [rows, keys]
    b_w = gl.join(gl.join(w0, w1), gl.join(w2, w3))
    b_half = gl.join(b_w & 0xFFFF, b_w >> 16)
    b_half = gl.reshape(gl.permute(b_half, (0, 5, 1, 2, 4, 3, 6)), (ROWS, BLOCK_N))
    return gl.convert_layout(b_half, s_layout, assert_trivial=True) >= threshold


@constexpr_function
def _keys_layout(KEYS, BLOCK_M):
    """The backward's draws, [KEYS / 16, 4, 2, BLOCK_M / 16, 8] indexed (c, u, z, a, r):
    draw (c, u, a, r) in the lanes 8 u + 4 z + r // 2 (z = 0, 1) of warp c, a register per
    (a, r % 2)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1]]
        + [[0, 0, 0, 1 << i, 0] for i in range((BLOCK_M // 16).bit_length() - 1)],
        lane_bases=[[0, 0, 0, 0, 2], [0, 0, 0, 0, 4], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                    [0, 2, 0, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0, 0] for i in range((KEYS // 16).bit_length() - 1)],
        block_bases=[], shape=[KEYS // 16, 4, 2, BLOCK_M // 16, 8])


@gluon.jit
def keep_keys(k0, k1, i_b, i_h, start_k, start_q, threshold, KEYS: gl.constexpr,
              BLOCK_M: gl.constexpr, st_layout: gl.constexpr, WIDE: gl.constexpr):
    """The keep mask [KEYS, BLOCK_M] of a consumer group's transposed scores (keys
    [start_k, + KEYS) on rows, queries [start_q, + BLOCK_M) on columns, both starts
    multiples of 16, in ``st_layout``, the wgmma accumulator's) of head i_h of batch entry
    i_b. A pair is kept where its 16 bits reach ``threshold``. WIDE: as philox's."""
    layout: gl.constexpr = _keys_layout(KEYS, BLOCK_M)
    l4: gl.constexpr = gl.SliceLayout(4, layout)
    l3: gl.constexpr = gl.SliceLayout(3, l4)
    cu_layout: gl.constexpr = gl.SliceLayout(2, l3)
    o_c = gl.arange(0, KEYS // 16, layout=gl.SliceLayout(1, cu_layout))
    o_u = gl.arange(0, 4, layout=gl.SliceLayout(0, cu_layout))
    # [KEYS / 16, 4, 1, 1, 1]: the counter's key word 4 c + u
    c_k = (start_k // 16 * 4 + gl.expand_dims(o_c * 4, 1) + gl.expand_dims(o_u, 0)).to(gl.uint32)
    c_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(c_k, 2), 3), 4)
    # [1, 1, 2, 1, 1]: z, the half
    o_z = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    o_z = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(o_z, 0), 0), 3), 4)
    # [1, 1, 1, BLOCK_M / 16, 8]: the counter's query word 8 a + r
    ar_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, layout)))
    o_a = gl.arange(0, BLOCK_M // 16, layout=gl.SliceLayout(1, ar_layout))
    o_r = gl.arange(0, 8, layout=gl.SliceLayout(0, ar_layout))
    c_q = ((start_q // 16 + gl.expand_dims(o_a, 1)) * 8 + gl.expand_dims(o_r, 0)).to(gl.uint32)
    c_q = gl.expand_dims(gl.expand_dims(gl.expand_dims(c_q, 0), 0), 0)
    zero = c_k * 0 + c_q * 0 + o_z.to(gl.uint32) * 0
    w0, w1, w2, w3 = philox(k0, k1, zero + c_k, zero + c_q, zero + i_h.to(gl.uint32),
                            zero + i_b.to(gl.uint32), WIDE)
    hi = (zero + o_z.to(gl.uint32)) == 1
    h0 = gl.where(hi, w0 >> 16, w0 & 0xFFFF)
    h1 = gl.where(hi, w1 >> 16, w1 & 0xFFFF)
    h2 = gl.where(hi, w2 >> 16, w2 & 0xFFFF)
    h3 = gl.where(hi, w3 >> 16, w3 & 0xFFFF)
    # [c, u, z, a, r, x, y]: word 2 y + x's half, then [c, x, u, z, a, y, r] = [keys, queries]
    b_half = gl.join(gl.join(h0, h1), gl.join(h2, h3))
    b_half = gl.reshape(gl.permute(b_half, (0, 5, 1, 2, 3, 6, 4)), (KEYS, BLOCK_M))
    return gl.convert_layout(b_half, st_layout, assert_trivial=True) >= threshold
