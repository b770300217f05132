"""Score modifiers (window, softcap, ALiBi, gate, attn_mask) against the fp64 reference:
Hypothesis-drawn combinations and edge cases."""

import pytest
import torch
from hypothesis import example, given, strategies as st

import flashop
from helpers import (
    CPU_PATH_TWIN, DEVICE, TILES, Case, check_case, cpu_path, make_inputs, make_modifiers,
    run_flashop,
)
from modifier_cases import DTYPES, EDGES, modified_cases


@pytest.mark.parametrize("dtype", DTYPES)  # one test per dtype: they run in parallel
@given(case=modified_cases(), seed=st.integers(0, 2**16))
@example(case=EDGES[0], seed=0)
@example(case=EDGES[1], seed=0)
@example(case=EDGES[2], seed=0)
def test_modifiers_match_reference(dtype, case, seed):
    check_case(case.in_dtype(dtype), seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=modified_cases(), seed=st.integers(0, 2**16), tile=st.sampled_from([256, 4096]))
@example(case=EDGES[0], seed=0, tile=256)
@example(case=EDGES[1], seed=0, tile=256)
@example(case=EDGES[2], seed=0, tile=4096)
def test_cpu_path_modifiers_match_reference(dtype, case, seed, tile):
    """The CPU path's blocked forward and backward on the same calls (tiles of 16 keys, parts
    of ``tile`` scores)."""
    with cpu_path(tile):
        check_case(case.in_dtype(dtype), seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_everything_at_once(dtype):
    """Causal + window + softcap + ALiBi + gate + a broadcast float bias with its gradient,
    lengths across several tiles, grouped heads."""
    check_case(Case(B=2, S_q=45, S_k=70, H_kv=1, G=2, D=24, DV=24, dtype=dtype, causal=True,
                    window_size=(20, 0), softcap=5.0, alibi=(2, 2), gate=torch.float32,
                    mask=torch.float32, mask_shape=(1, 2, 45, 1), mask_grad=True))


# Head dims above 128 with the modifiers (the property tests draw 128 at most): their
# kernels take other tiles (tiles._gpu_tiles: the dQ kernel's 128-row tile where the head
# dim is one 256-wide tile, 64 rows under a mask; the dK/dV kernel in two parts; the head
# dim in two tiles at D = 192), and a mask's staged tiles count against the shared memory
# on a GPU. Lengths past one tile of each kernel on a GPU, past several under the
# interpreter.
WIDE_HEADS = [
    Case(B=1, S_q=150, S_k=150, H_kv=1, G=2, D=256, DV=256, dtype=torch.bfloat16,
         causal=True, mask=torch.bool, mask_shape=(150, 150)),
    Case(B=1, S_q=77, S_k=150, H_kv=2, G=1, D=256, DV=256, dtype=torch.float16,
         mask=torch.float32, mask_shape=(1, 2, 77, 150), mask_grad=True),
    Case(B=2, S_q=70, S_k=70, H_kv=1, G=1, D=224, DV=224, dtype=torch.bfloat16,
         mask=torch.float32, mask_shape=(70, 70), alibi=(1,), softcap=5.0),
    Case(B=1, S_q=150, S_k=150, H_kv=1, G=2, D=192, DV=128, dtype=torch.bfloat16,
         causal=True, window_size=(90, 0), gate=torch.float32, mask=torch.bool,
         mask_shape=(1, 1, 150, 150)),
    Case(B=1, S_q=100, S_k=140, H_kv=1, G=2, D=256, DV=128, dtype=torch.bfloat16,
         mask=torch.float32, mask_shape=(100, 140), dq_atomics=True),
]


@pytest.mark.parametrize("case", WIDE_HEADS,
                         ids=lambda c: f"D{c.D}-DV{c.DV}-{'causal' if c.causal else 'full'}")
def test_modifiers_at_head_dims_above_128(case):
    check_case(case)


_T = max(TILES)  # a multiple of every tile in use


@pytest.mark.parametrize("dq_atomics", [False, True], ids=["dq-kernel", "dq-atomics"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("residue", [-2, -1, 0, 1, 2])
def test_window_bound_at_every_residue_of_the_tiles(residue, side, dq_atomics):
    """A window bound that puts the first key of every query tile (left; row i attends from
    i + S_k - S_q - left) or its last key (right; up to i + S_k - S_q + right) at each
    residue from two before a tile edge to two after, for every tile in use (the tiles
    start at multiples of _T), and a key tile's first and last query alike: plain fp32
    inputs, so that one key too many or too few fails the rule, through both backwards."""
    if side == "left":  # 5 to 9 keys a row, from 2 * _T - residue for row _T on
        S_q, S_k, window = _T + _T // 2, 2 * _T + _T // 2 + 4, (4 + residue, -1)
    else:  # up to _T + residue for row 0
        S_q, S_k, window = 3 * _T, 2 * _T + _T // 2, (-1, _T + _T // 2 + residue)
    check_case(Case(B=1, S_q=S_q, S_k=S_k, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32,
                    window_size=window, dq_atomics=dq_atomics))


@pytest.mark.parametrize("window_size", [(0, 0), (3, 7), (-1, 5), (9, -1), (200, 200)])
@pytest.mark.parametrize("lengths", [(33, 71), (71, 33)])
def test_windows(window_size, lengths):
    S_q, S_k = lengths
    check_case(Case(B=1, S_q=S_q, S_k=S_k, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16,
                    window_size=window_size))


@pytest.mark.parametrize("D", [64, 128])
def test_boolean_mask_with_a_two_sided_window(D):
    """A boolean mask of unit key stride under a window bounded on both sides: triton 3.6
    once failed to compile the dQ kernel's mask load there on a GPU (common.py)."""
    check_case(Case(B=2, S_q=77, S_k=256, H_kv=1, G=2, D=D, DV=D, dtype=torch.bfloat16,
                    window_size=(9, 30), mask=torch.bool, mask_shape=(77, 256)))


@pytest.mark.parametrize("lengths", [(20, 50), (50, 20), (40, 40)])
def test_gate_with_other_lengths(lengths):
    """Query i sits at key position i + S_k - S_q, as with a KV cache."""
    S_q, S_k = lengths
    check_case(Case(B=1, S_q=S_q, S_k=S_k, H_kv=2, G=1, D=16, DV=16, dtype=torch.float32,
                    causal=True, gate=torch.float32))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    """A boolean mask that leaves some queries nothing: output 0, lse -inf, zero gradients
    for those rows, finite everywhere."""
    case = Case(B=1, S_q=40, S_k=30, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16,
                mask=torch.bool, mask_shape=(1, 2, 40, 30), softcap=3.0, alibi=(2,))
    inputs, dout, dlse = make_inputs(case)
    mods = make_modifiers(case)
    mods["attn_mask"][:, :, ::3] = False  # every third query attends nothing
    out, lse, (dq, dk, dv) = run_flashop(case, inputs, dout, dlse, mods)
    assert torch.equal(out[:, ::3], torch.zeros_like(out[:, ::3]))
    assert torch.isneginf(lse[:, :, ::3]).all()
    assert torch.equal(dq[:, ::3], torch.zeros_like(dq[:, ::3]))
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("shape", [(30,), (2, 1, 20, 30), (1, 2, 1, 30), (20, 1)])
def test_bias_gradient_has_the_bias_shape(shape):
    case = Case(B=2, S_q=20, S_k=30, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32,
                mask=torch.float32, mask_shape=shape, mask_keep=1.0, mask_grad=True)
    check_case(case)


def test_modifiers_compose_with_attention_op():
    """torch.ops.flashop.attention takes the same modifiers as keyword arguments (and the
    window as its two ints)."""
    case = Case(B=1, S_q=20, S_k=30, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32,
                causal=True, window_size=(8, 0), softcap=2.0, alibi=(2,), gate=torch.float32)
    (q, k, v), _, _ = make_inputs(case)
    mods = make_modifiers(case)
    out = torch.ops.flashop.attention(q, k, v, **mods, **case.op_options())
    assert torch.equal(out, flashop.attention_with_lse(q, k, v, **mods, **case.options())[0])


def test_alibi_slopes_get_no_gradient():
    q = torch.randn(1, 8, 2, 16, device=DEVICE, requires_grad=True)
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)
    out = flashop.attention(q, q, q, alibi_slopes=slopes)
    with pytest.raises(RuntimeError, match="alibi_slopes get no gradient"):
        out.sum().backward()


@pytest.mark.parametrize("modifier",
                         ["alibi", "attn_mask", "gate", "alibi-varlen", "attn_mask-dq-atomics"])
def test_one_attended_key_gives_fp32_gradients_exactly(modifier):
    """Each query attends one key, under a modifier that takes its base-2 score to -150..-300,
    so its softmax is exactly 1: out_i = v_j and d lse_i / d q_i = scale * k_j, both exactly
    (scale = 1/4 is a power of 2). That holds only where the backward recomputes each score
    bit for bit as the forward computed it and reads an lse without a round trip: on an
    H200 a score one ulp off (the compiler fusing a different product into an FMA in the
    backward's kernel) moved P by 1e-5 (docs/notes/gpu-runs.md). With dQ by atomics, the keys past
    S_k of the key tile (P = exp2(0 - lse) = inf there) once made dQ NaN."""
    with flashop.config.override(dq_atomics=modifier.endswith("dq-atomics")):
        _check_one_attended_key(modifier)


def _check_one_attended_key(modifier):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    H, D, S_q = 2, 16, 131
    S_k = S_q if modifier == "gate" else 1
    q, k, v = (torch.randn(1, S, H, D, device=DEVICE, generator=gen, requires_grad=True)
               for S in (S_q, S_k, S_k))
    options = {}
    if modifier.startswith("alibi"):  # distances up to 130
        options["alibi_slopes"] = torch.tensor([1.0, 0.75], device=DEVICE)
    elif modifier.startswith("attn_mask"):
        options["attn_mask"] = -100 - 100 * torch.rand(1, H, S_q, 1, device=DEVICE, generator=gen)
    else:  # causal with window (0, 0): query i attends key i alone; cumsum(g) to ~ -200
        g = -1 - torch.rand(1, S_k, H, device=DEVICE, generator=gen)
        options.update(g=g, causal=True, window_size=(0, 0))
    if modifier == "alibi-varlen":
        cu_q = torch.tensor([0, S_q], device=DEVICE, dtype=torch.int32)
        cu_k = torch.tensor([0, S_k], device=DEVICE, dtype=torch.int32)
        out, lse = flashop.attention_varlen_with_lse(q[0], k[0], v[0], cu_q, cu_k, S_q, S_k,
                                                     **options)
        out, lse = out[None], lse[None]
    else:
        out, lse = flashop.attention_with_lse(q, k, v, **options)
    (dq,) = torch.autograd.grad(lse.sum(), q)
    assert torch.equal(out, v.detach().expand_as(out))
    # (with dQ by atomics, dQ comes from the dK/dV kernel's S^T = K Q^T, which must round
    # each score as the forward's S = Q K^T did: kernels/common.py's score_dot)
    assert torch.equal(dq, 0.25 * k.detach().expand_as(dq))
