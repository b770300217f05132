"""Padded batches <-> packed batches (cu_seqlens and indices)."""

import pytest
import torch
from hypothesis import given, strategies as st

from flashop.padding import pad_input, unpad_input


@st.composite
def masks(draw):
    B = draw(st.integers(1, 4))
    S = draw(st.integers(1, 12))
    rows = draw(st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=B,
                         max_size=B))
    return torch.tensor(rows, dtype=torch.bool)


@given(mask=masks())
def test_round_trip_and_offsets(mask):
    B, S = mask.shape
    x = torch.randn(B, S, 3, 5, requires_grad=True)
    packed = unpad_input(x, mask)
    lengths = mask.sum(1)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert packed.max_seqlen == int(lengths.max())
    # sequence b is the real tokens of row b, in order of position
    for b in range(B):
        start, end = packed.cu_seqlens[b].item(), packed.cu_seqlens[b + 1].item()
        assert torch.equal(packed.values[start:end], x[b][mask[b]])
    padded = pad_input(packed.values, packed.indices, B, S)
    assert torch.equal(padded, torch.where(mask[:, :, None, None], x, 0.0))
    # gradients flow to the real tokens only
    padded.sum().backward()
    assert torch.equal(x.grad, mask[:, :, None, None].expand_as(x).float())


def test_empty_sequences():
    mask = torch.tensor([[False, False], [True, False], [False, False]])
    packed = unpad_input(torch.arange(6.0).view(3, 2), mask)
    assert packed.values.tolist() == [2.0]
    assert packed.cu_seqlens.tolist() == [0, 0, 1, 1]
    assert packed.max_seqlen == 1


def test_bad_masks():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"must be \(batch, seqlen\) matching"):
        unpad_input(x, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool or an integer tensor"):
        unpad_input(x, torch.ones(2, 4))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_masks_as_tokenizers_give_them(dtype):
    """An integer mask (a tokenizer's int64 attention_mask) packs as its boolean form:
    nonzero = token."""
    keep = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    x = torch.randn(3, 4, 8)
    packed, expected = unpad_input(x, (keep * 2).to(dtype)), unpad_input(x, keep.bool())
    assert torch.equal(packed.values, expected.values)
    assert torch.equal(packed.indices, expected.indices)
    assert torch.equal(packed.cu_seqlens, expected.cu_seqlens)
    assert packed.max_seqlen == expected.max_seqlen == 4
    with pytest.raises(ValueError, match="values has 3 tokens but indices has 2"):
        pad_input(torch.randn(3, 8), torch.tensor([0, 1]), 2, 4)
