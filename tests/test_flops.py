"""FLOP counting: torch.utils.flop_counter.FlopCounterMode counts flashop's operators with
SDPA's formula (the products over every (query, key) pair, causal or windowed or not; the
backward 2.5x the forward), per sequence of a packed batch (paged or not) and over each
cached sequence's keys."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import flashop
from helpers import DEVICE


def _counts(fn) -> dict:
    with FlopCounterMode(display=False) as mode:
        fn()
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_flop_counts()["Global"].items()}


def _randn(*shape, grad=False):
    return torch.randn(*shape, device=DEVICE, requires_grad=grad)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_and_backward(causal):
    """GQA and a value head dim apart from the queries': 2·B·H·S_q·S_k·(D + DV) forward."""
    B, S_q, S_k, H, H_kv, D, DV = 2, 40, 33, 4, 2, 16, 24
    q, k, v = _randn(B, S_q, H, D, grad=True), _randn(B, S_k, H_kv, D, grad=True), \
        _randn(B, S_k, H_kv, DV, grad=True)
    counts = _counts(lambda: flashop.attention(q, k, v, causal=causal).sum().backward())
    forward = 2 * B * H * S_q * S_k * (D + DV)
    assert counts == {"attention_forward": forward,
                      "attention_backward": 2 * B * H * S_q * S_k * (3 * D + 2 * DV)}
    assert _counts(lambda: torch.ops.flashop.attention(q, k, v)) == {
        "attention_forward": forward}


def test_packed_batches_count_each_sequence():
    lengths_q, lengths_k, H, D = [5, 0, 30], [17, 4, 30], 2, 16
    cu_q, cu_k = (torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
                  for lens in (lengths_q, lengths_k))
    q, k = _randn(sum(lengths_q), H, D, grad=True), _randn(sum(lengths_k), H, D)
    counts = _counts(lambda: flashop.attention_varlen(q, k, k, cu_q, cu_k, 30, 30,
                                                      causal=True).sum().backward())
    pairs = sum(a * b for a, b in zip(lengths_q, lengths_k))
    assert counts == {"attention_forward": 4 * H * pairs * D,
                      "attention_backward": 10 * H * pairs * D}


def test_paged_prefill_counts_each_sequence():
    """The paged prefill as the packed forward: each sequence's queries times its keys."""
    lengths_q, lengths_k, H, D = [5, 0, 30], [17, 4, 30], 2, 16
    cu_q, cu_k = (torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
                  for lens in (lengths_q, lengths_k))
    q, cache = _randn(sum(lengths_q), H, D), _randn(6, 16, H, D)
    table = torch.arange(6, device=DEVICE, dtype=torch.int32).view(3, 2)
    counts = _counts(lambda: flashop.attention_varlen(q, cache, cache, cu_q, cu_k, 30, 30,
                                                      causal=True, block_table=table))
    pairs = sum(a * b for a, b in zip(lengths_q, lengths_k))
    assert counts == {"attention_varlen_paged": 4 * H * pairs * D}


def test_decoding_counts_each_sequences_keys():
    """cache_seqlens[b] + the appended keys per sequence, within the cache's capacity."""
    q, new = _randn(3, 2, 4, 16), _randn(3, 2, 2, 16)
    cache = torch.zeros(3, 40, 2, 16, device=DEVICE)
    lens = torch.tensor([0, 10, 39], device=DEVICE, dtype=torch.int32)
    counts = _counts(lambda: flashop.attention_with_kvcache(q, cache, cache, new, new,
                                                            cache_seqlens=lens))
    keys = 2 + 12 + 40  # the last sequence's second new key falls past the capacity
    assert counts == {"attention_with_kvcache": 4 * 4 * 2 * keys * 16}
