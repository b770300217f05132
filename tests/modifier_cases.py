"""The calls the modifiers' property tests draw (tests/test_modifiers.py, and with sinks or
dropout added tests/test_sinks.py and tests/test_dropout.py): random modifiers, lengths and
bounds at tile edges, and the edge cases each test runs as @examples."""

import torch
from hypothesis import strategies as st

from helpers import (
    DEVICE, INPUTS, TWO_KEY_TILES, TWO_QUERY_TILES, Case, edge_offset_keys, head_counts,
    input_scales, left_bounds_at_edges, lengths, right_bounds_at_edges, window_bound,
)

ON_GPU = DEVICE == "cuda"
MAX_SEQ = 400 if ON_GPU else 64
MAX_HEADS = 8 if ON_GPU else 3  # batch entries times heads
# the cases of the tests that add sinks or dropout to every modifier, more of them
SMALLER = {} if ON_GPU else dict(most_heads=2, most_seq=48)
HEAD_DIMS = [16, 24, 64, 128] if ON_GPU else [8, 16, 24, 40]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def modified_cases(draw, most_heads=MAX_HEADS, most_seq=MAX_SEQ):
    """A call in the test's dtype (Case.in_dtype) with random modifiers: lengths up to
    ``most_seq``, past two tiles of every kernel in most draws, up to ``most_heads`` batch
    entries times heads, scales and large scores, dQ by its kernel or by atomics. Lengths,
    the causal offset S_k - S_q and the window's bounds fall at tile edges in many draws
    (tests/helpers.py)."""
    B, H_kv, G = head_counts(draw, most_heads, groups=(1, 2))
    S_q = draw(lengths(TWO_QUERY_TILES, most_seq))
    S_k = draw(st.one_of(lengths(TWO_KEY_TILES, most_seq),
                         edge_offset_keys(S_q, TWO_KEY_TILES, most_seq)))
    H = H_kv * G
    D = draw(st.sampled_from(HEAD_DIMS))
    causal = draw(st.booleans())
    left = draw(st.one_of(window_bound(S_k), left_bounds_at_edges(S_k - S_q, S_k + 4)))
    right = draw(st.sampled_from([-1, 0])) if causal else draw(
        st.one_of(window_bound(S_k), right_bounds_at_edges(S_k - S_q, S_k + 4)))
    mask = draw(st.sampled_from([None, torch.bool, torch.float32, INPUTS]))
    mask_shape = None
    if mask is not None:
        full = (B, H, S_q, S_k)
        mask_shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        mask_shape = mask_shape[draw(st.integers(0, 2)):]  # 4, 3 or 2 dims
    return Case(
        B=B, S_q=S_q, S_k=S_k, H_kv=H_kv, G=G, D=D, DV=draw(st.sampled_from([D, 16])),
        dtype=None, causal=causal, window_size=(left, right),
        softcap=draw(st.one_of(st.just(0.0), st.floats(0.5, 8.0))),
        alibi=draw(st.sampled_from([None, (H,), (B, H)])),
        gate=draw(st.sampled_from([None, torch.float32, INPUTS])) if causal else None,
        mask=mask, mask_shape=mask_shape,
        # a sparse mask leaves some queries nothing to attend
        mask_keep=draw(st.sampled_from([0.05, 0.5, 0.9])),
        mask_grad=mask not in (None, torch.bool) and draw(st.booleans()),
        dq_atomics=draw(st.booleans()),
        **input_scales(draw, D),
    )


# the edges: one query, one key, no key (every modifier that applies)
EDGES = [
    Case(B=2, S_q=1, S_k=50, H_kv=1, G=2, D=16, DV=16, dtype=None, causal=True,
         window_size=(20, 0), softcap=3.0, alibi=(2, 2), gate=torch.float32,
         mask=torch.float32, mask_shape=(2, 1, 1, 50), mask_grad=True),
    Case(B=1, S_q=40, S_k=1, H_kv=2, G=1, D=8, DV=16, dtype=None, window_size=(3, 3),
         alibi=(2,), mask=torch.bool, mask_shape=(40, 1)),
    Case(B=1, S_q=20, S_k=0, H_kv=1, G=2, D=8, DV=8, dtype=None, causal=True, alibi=(2,),
         gate=INPUTS),
]
