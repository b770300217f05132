"""Helpers shared by the forward and backward attention kernels.

Vocabulary (docs/design.md): ``B`` batch, ``S_q``/``S_k`` query/key lengths, ``H`` query
heads, ``G`` query heads per key/value head, ``D``/``DV`` head dims of q,k and of v,o;
prefixes ``i_`` program ids, ``o_`` offsets, ``m_`` masks, ``p_`` pointers, ``b_`` blocks.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Triton reads module-level globals in kernels only when they are tl.constexpr
LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log units -> base-2 units
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): base-2 units -> natural-log units
# Philox's products by inline PTX (philox), on NVIDIA GPUs: not under Triton's interpreter,
# which cannot run PTX (it takes the same products from mul.hi and mul.lo)
PTX_PRODUCTS = tl.constexpr(not triton.knobs.runtime.interpret and torch.version.hip is None)
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32) rounded to the nearest ``float8_e4m3fn`` value, ties to even, saturating
    at +-448: the value the GPU's conversion gives, in fp32, so that ``.to(tl.float8e4nv)``
    of it is exact. Adding and subtracting 2^(E + 20) (E: x's exponent, at least -6, the
    smallest normal one) rounds x to a multiple of 2^(E - 3), e4m3's spacing there.
    triton<=3.9: the interpreter's conversion to fp8 neither rounds to even nor carries into
    the exponent (-127.99 converts to -64); kernels that must match the GPU's bits under it
    round here first."""
    b_a = tl.minimum(tl.abs(x), 448.0)
    b_e = tl.maximum((b_a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    b_magic = ((b_e + 20) << 23).to(tl.float32, bitcast=True)
    b_r = (b_a + b_magic) - b_magic
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -b_r, b_r)  # -0.0 keeps its sign


@triton.jit
def to_e4m3(x):
    """``x`` (fp32) as ``float8_e4m3fn``: round_to_e4m3, then converted, keeping the sign of a
    zero (Hopper's saturating conversion gives -0.0 as +0.0; torch's keeps it)."""
    b_y = round_to_e4m3(x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    b_sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0).to(tl.uint8)
    return (b_y | b_sign).to(tl.float8e4nv, bitcast=True)


@triton.jit
def dot_operand(x, UPCAST: tl.constexpr):
    """Operand of ``tl.dot``: as loaded, or in fp32 where ``UPCAST``.

    ``UPCAST`` is set only under Triton's CPU interpreter for bf16 inputs, whose bf16
    ``tl.dot`` is wrong there; the launcher never sets it on a GPU, so GPU code is unchanged.
    The values are bf16 either way (an exact cast), so the products are the same.
    """
    if UPCAST:
        x = x.to(tl.float32)
    return x


# Under Triton's interpreter tl.dot is numpy's matmul, whose fp32 sums run in an order that
# depends on the operands' shapes and layout: the dK/dV kernel's S^T = K Q^T and the
# forward's S = Q K^T round a score differently there (on a GPU the FMA chain over the head
# dim runs in one order in both). P recomputed from the forward's lse is then off by about
# |score| * 2^-23, which takes fp32 gradients outside the accuracy rule at scores of 100.
# There (INTERPRETED) the scores are summed in fp64 and rounded to fp32 once: the same in
# every kernel. The operands go to fp64 through fp32 (exact): triton<=3.9's interpreter
# cannot convert e4m3 to fp64 directly (a numpy shift of uint64 by int32 raises).


@triton.jit
def score_dot(a, b, DOT_PRECISION: tl.constexpr):
    """The scores' product ``a @ b`` (Q K^T, or K Q^T transposed), fp32; operands as
    dot_operand gives them."""
    if INTERPRETED:
        s = tl.dot(a.to(tl.float32).to(tl.float64), b.to(tl.float32).to(tl.float64))
        s = s.to(tl.float32)
    else:
        s = tl.dot(a, b, input_precision=DOT_PRECISION)
    return s


@triton.jit
def score_dot_parts(a, b, a_tail, b_tail, DOT_PRECISION: tl.constexpr):
    """score_dot over head dims held in two parts, ``a @ b + a_tail @ b_tail``, summed as
    one product over the whole head dim: in one fp32 accumulator, the tail's terms after
    the first part's (the order of one product over the dims), or under the interpreter in
    fp64 rounded to fp32 once (as score_dot)."""
    if INTERPRETED:
        s = tl.dot(a.to(tl.float32).to(tl.float64), b.to(tl.float32).to(tl.float64))
        s += tl.dot(a_tail.to(tl.float32).to(tl.float64), b_tail.to(tl.float32).to(tl.float64))
        s = s.to(tl.float32)
    else:
        s = tl.dot(a_tail, b_tail, tl.dot(a, b, input_precision=DOT_PRECISION),
                   input_precision=DOT_PRECISION)
    return s


@triton.jit
def to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as a GPU's cast rounds.
    triton<=3.9: the interpreter's fp32 -> bf16 cast truncates; this one rounds there by
    hand (finite values)."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` in ``dtype`` (a matmul's operand, P or dS; a stored output, gradient or
    rotated key), rounded to nearest as a GPU's cast rounds. triton<=3.9: the interpreter's
    cast to bf16 truncates (to_bf16)."""
    if INTERPRETED and dtype == tl.bfloat16:
        return to_bf16(x)
    return x.to(dtype)


@triton.jit
def rounded_product(a, b):
    """``a * b`` rounded to fp32 before whatever follows: on a GPU a multiply with an explicit
    rounding (mul.rn), which the compiler does not fuse into an FMA with the next add."""
    if INTERPRETED:
        return a * b
    return libdevice.mul_rn(a, b)


@triton.jit
def exp2_shifted(b_s, qk_scale, b_shift, FOLD_SCALE: tl.constexpr):
    """exp2(s - shift) of scaled scores; where ``FOLD_SCALE`` (choice.folds_scale), of
    unscaled ones, exp2(s * qk_scale - shift) as one FMA: the forward's P and the backward's
    recomputed P, rounded alike. On a GPU the compiler fuses the expression (an explicit
    tl.fma compiled 3-5% slower at D = 64 and 128); the interpreter rounds each operation,
    so it is told."""
    if not FOLD_SCALE:
        return tl.math.exp2(b_s - b_shift)
    if INTERPRETED:
        return tl.math.exp2(tl.fma(b_s, qk_scale, -b_shift))
    return tl.math.exp2(b_s * qk_scale - b_shift)


@triton.jit
def load_tile(p, m_rows, m_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where the flags say it can overflow.

    ``m_rows`` and ``m_cols`` broadcast against ``p`` ([R, 1] and [1, C] or the transposes).
    Masked-out elements read as 0.
    """
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(p, mask=m_rows & m_cols, other=0.0)
    elif CHECK_ROWS:
        x = tl.load(p, mask=m_rows, other=0.0)
    elif CHECK_COLS:
        x = tl.load(p, mask=m_cols, other=0.0)
    else:
        x = tl.load(p)
    return x


@triton.jit
def row_descriptors(x, y, n_rows, stride_x, stride_y, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    """Tensor descriptors of ``n_rows`` rows (one at least: a sequence without rows loads
    no tile) of ``x``, D wide, and ``y``, DV wide, read in tiles of BLOCK_R rows: x's first
    BLOCK_D columns, its columns from BLOCK_D on where ``BLOCK_DT`` (else ``x`` again, a
    placeholder), y's BLOCK_DV. Rows past n_rows and columns past D or DV read as 0. (For
    loads only: a helper's results offsetting a store would make torch count its arguments
    as written, see below.)"""
    n_rows = tl.maximum(n_rows, 1)
    x_tail = x
    if BLOCK_DT > 0:
        x_tail = tl.make_tensor_descriptor(x, shape=[n_rows, D], strides=[stride_x, 1],
                                           block_shape=[BLOCK_R, BLOCK_DT])
    return (tl.make_tensor_descriptor(x, shape=[n_rows, D], strides=[stride_x, 1],
                                      block_shape=[BLOCK_R, BLOCK_D]),
            x_tail,
            tl.make_tensor_descriptor(y, shape=[n_rows, DV], strides=[stride_y, 1],
                                      block_shape=[BLOCK_R, BLOCK_DV]))


@triton.jit
def lse_rows(lse_log2):
    """The forward's base-2 lse of a tile of rows; a row that attended nothing (-inf)
    becomes +inf, so its recomputed probabilities exp2(s - lse) are exactly 0."""
    return tl.where(lse_log2 == float("-inf"), float("inf"), lse_log2)


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice call, so it also runs under the interpreter); saturates
    to +-1 without NaN for large |x|."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def heaviest_tiles_first():
    """This program's (query tile, head, batch) on a grid (query tiles, heads, batch) whose
    programs take the query tiles of every (head, batch) heaviest first under a causal-like
    bound, in launch order: the last query tile of all heads and batches, then the one
    before.

    Where few programs fit an SM, the grid's last programs otherwise run alone at the end.
    It pays in the forward with two query tiles per program, not elsewhere (the one-tile
    forward, the dQ and dK/dV kernels measured slower with it)."""
    n_t = tl.num_programs(0)
    n_h = tl.num_programs(1)
    n_hb = n_h * tl.num_programs(2)
    pid = tl.program_id(0) + n_t * (tl.program_id(1) + n_h * tl.program_id(2))
    i_t = n_t - 1 - pid // n_hb
    return i_t, (pid % n_hb % n_h).to(tl.int64), (pid % n_hb // n_h).to(tl.int64)


@triton.jit
def chunk_start(pos, chunk):
    """The first position of the chunk of ``chunk`` positions that holds ``pos``:
    floor(pos / chunk) * chunk, and -chunk for every position before 0 (a query before the
    first key, whose chunk holds no key). Integer division truncates on a GPU and floors
    under the interpreter, so the dividend is made >= 0 first."""
    return (tl.maximum(pos + chunk, 0) // chunk) * chunk - chunk


@triton.jit
def key_start(pos, left, chunk, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """The first key the query at position ``pos`` may attend: ``pos - left`` under a left
    bound, the chunk's start under a chunk, the later of the two under both (one of them
    is set). It grows with ``pos``. With ``left`` a right bound it is, by symmetry, the
    first query position that may attend the key at ``pos``."""
    if HAS_CHUNK:
        start = chunk_start(pos, chunk)
        if HAS_LEFT:
            start = tl.maximum(start, pos - left)
    else:
        start = pos - left
    return start


@triton.jit
def key_end(pos, right, chunk, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """One past the last key the query at position ``pos`` may attend: ``pos + right + 1``
    under a right bound, the chunk's end under a chunk, the earlier of the two under both
    (one of them is set). It grows with ``pos``. With ``right`` a left bound it is, by
    symmetry, one past the last query position that may attend the key at ``pos``."""
    if HAS_CHUNK:
        end = chunk_start(pos, chunk) + chunk
        if HAS_RIGHT:
            end = tl.minimum(end, pos + right + 1)
    else:
        end = pos + right + 1
    return end


@triton.jit
def key_range(p_first, p_last, S_k, left, right, chunk, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys that the queries at positions ``p_first .. p_last`` attend, in tiles of
    BLOCK_N: ``(lo, u_lo, u_hi, hi)``.

    Query position ``p`` attends key ``j`` iff ``key_start(p) <= j < key_end(p)`` (the
    window's bounds ``p - left <= j <= p + right`` where ``HAS_LEFT`` / ``HAS_RIGHT``; causal
    is ``right = 0``; the chunk ``j // chunk == p // chunk`` where ``HAS_CHUNK``) and
    ``j < S_k``. Both bounds grow with ``p``, so the rows' keys run from the first row's
    start to the last row's end, and a key tile is attended by every row where it starts
    at or after the last row's start and ends at or before the first row's end. Tiles in
    ``[u_lo, u_hi)`` are such tiles, whole (before S_k), and need no mask; tiles in
    ``[lo, u_lo)`` and ``[u_hi, hi)`` need the bounds' and/or the key length's mask; tiles
    outside ``[lo, hi)`` are never visited. Tile starts are multiples of BLOCK_N; ``x //
    BLOCK_N`` truncates, so x is clamped to >= 0 first.
    """
    n_full = (S_k // BLOCK_N) * BLOCK_N  # keys in whole tiles
    if HAS_RIGHT or HAS_CHUNK:
        hi = tl.minimum(S_k, tl.maximum(key_end(p_last, right, chunk, HAS_RIGHT, HAS_CHUNK), 0))
        end_first = key_end(p_first, right, chunk, HAS_RIGHT, HAS_CHUNK)
        u_hi = tl.minimum((tl.maximum(end_first, 0) // BLOCK_N) * BLOCK_N, n_full)
    else:
        hi = S_k
        u_hi = n_full
    if HAS_LEFT or HAS_CHUNK:
        start_first = key_start(p_first, left, chunk, HAS_LEFT, HAS_CHUNK)
        lo = tl.minimum((tl.maximum(start_first, 0) // BLOCK_N) * BLOCK_N, hi)
        start_last = key_start(p_last, left, chunk, HAS_LEFT, HAS_CHUNK)
        u_lo = tl.cdiv(tl.maximum(start_last, 0), BLOCK_N) * BLOCK_N
        u_lo = tl.minimum(tl.maximum(u_lo, lo), hi)
        u_hi = tl.minimum(tl.maximum(u_hi, u_lo), hi)
    else:
        lo = 0
        u_lo = 0
    return lo, u_lo, u_hi, hi


@triton.jit
def key_tile_range(start_m, S_q, S_k, left, right, chunk, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Keys that the query tile [start_m, start_m + BLOCK_M) attends: key_range's ``(lo,
    u_lo, u_hi, hi)`` for its rows, query ``i`` at position ``i + S_k - S_q``."""
    off = S_k - S_q
    return key_range(start_m + off, start_m + BLOCK_M - 1 + off, S_k, left, right, chunk,
                     HAS_LEFT, HAS_RIGHT, HAS_CHUNK, BLOCK_N)


@triton.jit
def query_tile_range(start_n, S_q, S_k, left, right, chunk, HAS_LEFT: tl.constexpr,
                     HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Queries that attend some key of the tile [start_n, start_n + BLOCK_N):
    ``(lo, u_lo, u_hi, hi)`` as in :func:`key_range`, with query tiles of BLOCK_M.

    Key ``j`` is attended by the query positions ``key_start(j, right) <= p < key_end(j,
    left)`` (the bounds swapped: ``j - right <= p <= j + left``, and the chunk of ``j``),
    query ``i`` at position ``i + S_k - S_q``; both grow with ``j``: the tile's first key
    gives its first query and the end of the queries that attend every key of the tile,
    its last key gives its last query and the start of those queries. Query tiles past S_q
    need no mask here: their rows load zeros and add nothing; nor do keys past S_k.
    """
    off = S_k - S_q
    n_last = start_n + BLOCK_N - 1
    if HAS_RIGHT or HAS_CHUNK:
        first = key_start(start_n, right, chunk, HAS_RIGHT, HAS_CHUNK) - off
        lo = tl.minimum((tl.maximum(first, 0) // BLOCK_M) * BLOCK_M, S_q)
        # the first query that attends every key of the tile, rounded up to a tile start
        first_all = key_start(n_last, right, chunk, HAS_RIGHT, HAS_CHUNK) - off
        u_lo = tl.cdiv(tl.maximum(first_all, 0), BLOCK_M) * BLOCK_M
        u_lo = tl.maximum(tl.minimum(u_lo, S_q), lo)
    else:
        lo = 0
        u_lo = 0
    if HAS_LEFT or HAS_CHUNK:
        hi = tl.minimum(S_q, tl.maximum(key_end(n_last, left, chunk, HAS_LEFT, HAS_CHUNK) - off,
                                        0))
        # tiles whose last row still attends the tile's first key
        end_all = key_end(start_n, left, chunk, HAS_LEFT, HAS_CHUNK) - off
        u_hi = (tl.maximum(end_all, 0) // BLOCK_M) * BLOCK_M
        lo = tl.minimum(lo, hi)
        u_lo = tl.minimum(u_lo, hi)
        u_hi = tl.minimum(tl.maximum(u_hi, u_lo), hi)
    else:
        hi = S_q
        u_hi = S_q
    return lo, u_lo, u_hi, hi


@triton.jit
def attention_scores(
    b_qk, qk_scale, o_q, o_k, m_q, m_k, S_q, S_k, left, right, chunk, softcap_log2, alibi_log2,
    b_gk, p_attn_mask, stride_amq, stride_amk,
    EDGE_TILE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ATTN_MASK_KIND: tl.constexpr, SCALED: tl.constexpr,
):
    """Scores in base-2 units of one tile of ``q . k`` products ``b_qk``, -inf where masked;
    also ``t = tanh(...)`` for the softcap's derivative (``b_qk`` where there is no softcap).

    The tile may be [queries, keys] or transposed: ``o_q``/``m_q`` (query indices and their
    bound) and ``o_k``/``m_k`` broadcast against ``b_qk``, as does the gate block ``b_gk`` (the
    keys' cumulative gates, natural-log units). The queries' gate ``G_i`` is constant along a
    row, so it is not added here: the forward adds it to the natural-log lse it returns, and
    the base-2 lse it keeps for the backward goes without it. ``qk_scale`` is ``scale *
    log2 e``, or ``scale / softcap`` when ``HAS_SOFTCAP``. In order (docs/modifiers.md):
    softcap, ALiBi (``alibi_log2 = -slope * log2 e``), gate, additive ``attn_mask``
    (``ATTN_MASK_KIND`` 1), then the masks: window/causal, chunk and key length where
    ``EDGE_TILE`` (a tile crossing a bound or the keys' end), boolean ``attn_mask``
    (``ATTN_MASK_KIND`` 2).

    Every kernel must round a score alike: the backward recomputes P = exp2(s - lse) against
    the forward's lse. So the additive terms are summed by explicit FMAs, and the scaled
    product is one more FMA onto their sum. Written as multiplies and adds, the compiler
    fused one product or another into an FMA depending on how many of a thread's scores
    shared it, which differs between kernels of different tiles; the backward's score then
    missed the forward's in its last bit, and with one key at an ALiBi distance of 130
    (base-2 scores near -190) P missed 1 by 1e-5. With no additive term the scaled product
    is rounded on its own (rounded_product), unless not ``SCALED``: then the scores are
    returned unscaled, for a caller that folds the scale into its exponent's FMA
    (choice.folds_scale).
    """
    t = b_qk
    if HAS_SOFTCAP:
        t = tanh(b_qk * qk_scale)
        f1, f2 = t, softcap_log2
    else:
        f1, f2 = b_qk, qk_scale
    if HAS_ALIBI or HAS_GATE or ATTN_MASK_KIND == 1:
        b_add = 0.0
        if HAS_ALIBI:
            b_add = tl.fma(alibi_log2, tl.abs(o_q + (S_k - S_q) - o_k).to(tl.float32), b_add)
        if HAS_GATE:
            b_add = tl.fma(b_gk, -LOG2E, b_add)
        if ATTN_MASK_KIND == 1:
            b_bias = tl.load(p_attn_mask + o_q * stride_amq + o_k * stride_amk, mask=m_q & m_k,
                             other=0.0)
            b_add = tl.fma(b_bias.to(tl.float32), LOG2E, b_add)
        b_s = tl.fma(f1, f2, b_add)
    elif SCALED:
        b_s = rounded_product(f1, f2)
    else:
        b_s = f1
    if ATTN_MASK_KIND == 2:
        # a boolean mask is read as bytes (int8): triton<=3.6 could not lower its pipelined
        # 1-bit loads. triton<=3.6: no ``other`` either: with it, triton pipelined this 1-byte
        # load into copies it then could not lower, under a two-sided window with unit key
        # stride (a compile error)
        m_qk = m_q & m_k
        p_keep = (p_attn_mask + o_q * stride_amq + o_k * stride_amk).to(tl.pointer_type(tl.int8))
        b_keep = tl.where(m_qk, tl.load(p_keep, mask=m_qk), 0)
        b_s = tl.where(b_keep != 0, b_s, float("-inf"))
    if EDGE_TILE:
        m_keep = m_k
        o_pos = o_q + (S_k - S_q)  # the queries' positions among the keys
        if HAS_RIGHT:
            m_keep = m_keep & (o_k <= o_pos + right)
        if HAS_LEFT:
            m_keep = m_keep & (o_k >= o_pos - left)
        if HAS_CHUNK:
            m_keep = m_keep & (chunk_start(o_k, chunk) == chunk_start(o_pos, chunk))
        b_s = tl.where(m_keep, b_s, float("-inf"))
    return b_s, t


# torch<=2.13: packed sequences: each kernel loads its sequence's offsets from cu_seqlens
# inline, not through a helper. torch 2.11 to 2.13 (their Triton mutation analysis) follow a
# helper call's results back to all of the call's arguments, so store pointers offset by a
# helper's return values made it count cu_seqlens (or the tensor standing in for them) as
# written: Inductor then cloned them on every call, and with dynamic shapes failed an
# assertion while doing so. (It also counts stores through helpers precisely, so only
# pointer offsets matter.)


@triton.jit
def dropout_keep(seed, i_b, i_h, o_q, start_k, dropout_p, BLOCK_K: tl.constexpr,
                 KEYS_ON_ROWS: tl.constexpr):
    """Dropout's keep mask of one tile: True where the pair (query ``o_q[r]``, key
    ``start_k + c``) of head ``i_h`` of batch entry (or packed sequence) ``i_b`` keeps its
    probability. The tile is [queries, BLOCK_K keys], or [BLOCK_K keys, queries] where
    ``KEYS_ON_ROWS``; ``o_q`` holds consecutive rows from a multiple of 16 (a multiple of 16
    of them) and ``start_k`` is a multiple of 16.

    A pure function of (seed, b, h, i, j), so every kernel and tile (the forward, both
    backward kernels, transposed or not, the Gluon forward and backward) draws the same mask
    whatever its tiles. With i = 16 a + 8 y + r (r < 8) and j = 16 c + 8 x + 2 u + z
    (u < 4), one Philox4x32-7 draw (``seed`` its 64-bit key) of the counter (4 c + u,
    8 a + r, h, b) gives four 32-bit words; the pair takes half z (the low one first) of
    word 2 y + x. These eight pairs are the eight scores one thread of a Hopper wgmma
    accumulator holds in a 16-key column block, so a kernel holding its scores that way
    draws in place (flashop/kernels/dropout_gluon.py). A pair is
    kept where its 16 bits are at least ``dropout_p * 65536``; the ops round dropout_p to a
    multiple of 2**-16 first (_launch.options.round_dropout_p), so the keep rate is exactly
    1 - dropout_p."""
    BLOCK_Q: tl.constexpr = o_q.shape[0]
    tl.static_assert(BLOCK_Q % 16 == 0 and BLOCK_K % 16 == 0,
                     "dropout_keep: tiles of multiples of 16 queries and keys")
    o_q = o_q.to(tl.uint32)
    # [BLOCK_Q // 16, 8]: the counter's row word (8 a + r), alike for rows i and i + 8
    c_q = tl.max(tl.reshape((o_q // 16) * 8 + o_q % 8, (BLOCK_Q // 16, 2, 8)), axis=1)
    # [BLOCK_K // 16, 4]: its key word (4 c + u)
    c_k = (start_k // 16 * 4 + tl.arange(0, BLOCK_K // 4)).to(tl.uint32)
    c_k = tl.reshape(c_k, (BLOCK_K // 16, 4))
    # [BLOCK_Q // 16, 8, BLOCK_K // 16, 4]
    zero = c_q[:, :, None, None] * 0 + c_k[None, None, :, :] * 0
    w0, w1, w2, w3 = philox(seed, zero + c_k[None, None, :, :], zero + c_q[:, :, None, None],
                            zero + i_h.to(tl.uint32), zero + i_b.to(tl.uint32))
    # [a, r, c, u, x, y, z]: half z of word 2 y + x
    b_w = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    b_keep = tl.join(b_w & 0xFFFF, b_w >> 16) >= (dropout_p * 65536.0).to(tl.uint32)
    if KEYS_ON_ROWS:
        # [c, x, u, z, a, y, r] = [keys, queries]
        return tl.reshape(tl.permute(b_keep, (2, 4, 3, 6, 0, 5, 1)), (BLOCK_K, BLOCK_Q))
    else:
        # [a, y, r, c, x, u, z] = [queries, keys]
        return tl.reshape(tl.permute(b_keep, (0, 5, 1, 2, 4, 3, 6)), (BLOCK_Q, BLOCK_K))


@triton.jit
def _mul_wide(x, m):
    """(high, low) words of the 64-bit product x * m (uint32 block and scalar): one
    ``mul.wide.u32``, which ptxas makes one IMAD.WIDE, where mul.hi and mul.lo make two."""
    # torch<=2.11: the PTX stays on one line: Inductor copies a kernel's source into its
    # generated module, where a backslash escape in this string ended the string literal
    return tl.inline_asm_elementwise(
        "{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }",
        "=r,=r,r,r", [x, m], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """Philox4x32-7 (Salmon et al., SC'11; 7 rounds, as FlashAttention-2's and PyTorch's
    fused dropout draw) of the counter (c0, c1, c2, c3) (uint32 blocks) under
    the 64-bit key ``seed``: its four 32-bit words. Written here rather than taken
    from triton.language.random: Inductor copies a user kernel's helpers into its generated
    code, and that module's helpers read a module global it does not copy. Each round's two
    products come from one ``mul.wide.u32`` each on NVIDIA GPUs (PTX_PRODUCTS), else from
    mul.hi and mul.lo: the same words."""
    seed = seed.to(tl.uint64)  # a loaded scalar
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    m0 = tl.full([], 0xD2511F53, tl.uint32)
    m1 = tl.full([], 0xCD9E8D57, tl.uint32)
    w0 = tl.full([], 0x9E3779B9, tl.uint32)
    w1 = tl.full([], 0xBB67AE85, tl.uint32)
    for _ in tl.static_range(7):
        if PTX_PRODUCTS:
            hi0, lo0 = _mul_wide(c0, m0)
            hi2, lo2 = _mul_wide(c2, m1)
            c0 = hi2 ^ c1 ^ k0
            c2 = hi0 ^ c3 ^ k1
            c1 = lo2
            c3 = lo0
        else:
            p0, p2 = c0, c2
            c0 = tl.umulhi(m1, p2) ^ c1 ^ k0
            c2 = tl.umulhi(m0, p0) ^ c3 ^ k1
            c1 = m1 * p2
            c3 = m0 * p0
        k0 = k0 + w0
        k1 = k1 + w1
    return c0, c1, c2, c3
