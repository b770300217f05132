"""Paged prefill: flashop.attention_varlen with a block_table (and flash_attn_varlen_func's)
over paged key/value caches, against the reference of the keys gathered from the pages;
the caches left as they were; the page lookups (a tile's one page id and each key's), two
query tiles per program; the operator (opcheck), its refused backward and the errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.library import opcheck

import flashop
from flashop import flash_attn as fa
from flashop.reference import attention_varlen_reference
from flashop.testing import accuracy
from helpers import (
    CPU_PATH_TWIN, DEVICE, TILES, cpu_path, left_bounds_at_edges, right_bounds_at_edges,
    tile_edges,
)
from paged_cases import PagedCase, check_paged, gather_pages, make_paged

ON_GPU = DEVICE == "cuda"


@st.composite
def paged_cases(draw, dtype):
    page = draw(st.sampled_from([16, 32]))
    max_blocks = draw(st.integers(1, 3))
    capacity = page * max_blocks
    B = draw(st.integers(1, 3))
    # key counts from none to the table's capacity, the ends drawn often, and at a page's or
    # a key tile's edge; queries the last of them (a cached prefix and new tokens), or more
    # than the keys
    lens_k = [draw(st.one_of(st.just(0), st.just(capacity), st.integers(0, capacity),
                             tile_edges(0, capacity, TILES + (page,))))
              for _ in range(B)]
    lens_q = [draw(st.one_of(st.integers(0, n), st.integers(0, 24))) for n in lens_k]
    G, H_kv = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 2))
    D = draw(st.sampled_from([16, 40] + ([64, 128] if ON_GPU else [])))
    causal = draw(st.booleans())
    # a few bounds, or bounds at the first sequence's tile edges
    offset = lens_k[0] - lens_q[0]
    left = draw(st.one_of(st.sampled_from([-1, -1, 0, 7, 30]),
                          left_bounds_at_edges(offset, capacity)))
    right = -1 if causal else draw(st.one_of(st.sampled_from([-1, -1, 0, 5]),
                                             right_bounds_at_edges(offset, capacity)))
    return PagedCase(
        tuple(lens_q), tuple(lens_k), H_kv, G, D, draw(st.sampled_from([D, 24])), dtype,
        page=page,
        max_blocks=max_blocks, spare=draw(st.integers(0, 2)), causal=causal,
        window_size=(left, right), softcap=draw(st.sampled_from([0.0, 0.0, 5.0])),
        alibi=draw(st.sampled_from([None, None, (H_kv * G,), (B, H_kv * G)])),
        sinks=draw(st.sampled_from([None, None, torch.float32])), spikes=draw(st.booleans()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@settings(max_examples=settings.default.max_examples // (1 if ON_GPU else 8))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_paged_prefill_matches_reference(dtype, data, seed):
    check_paged(data.draw(paged_cases(dtype)), seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_cpu_path_paged_prefill_matches_reference(dtype, data, seed):
    """The CPU path on the same calls (each sequence's keys gathered from its pages)."""
    with cpu_path():
        check_paged(data.draw(paged_cases(dtype)), seed)


@pytest.fixture
def key_tiles(monkeypatch):
    """Set the forward's key tile (BLOCK_N) for the calls of a test."""
    from flashop._launch import tiles

    forward_tiles = tiles.forward_tiles

    def set_block_n(block_n):
        monkeypatch.setattr(tiles, "forward_tiles",
                            lambda *a, **k: replace(forward_tiles(*a, **k), BLOCK_N=block_n))
    return set_block_n


@pytest.mark.parametrize("page,block_n", [(16, 64), (32, 64), (64, 16)],
                         ids=["each-key-4-pages", "each-key-2-pages", "one-page-per-tile"])
def test_page_ids_per_tile_and_per_key(key_tiles, page, block_n):
    """Both page lookups: each key's page id where a key tile spans pages (BLOCK_N above the
    page size, as GPU tiles over pages of 16 or 32), a tile's one id where it lies in one
    page; causal under a window (edge tiles), lengths ending mid-page, an empty sequence."""
    key_tiles(block_n)
    check_paged(PagedCase((9, 0, 5), (83, 0, 64), 1, 1, 16, 16, torch.float16, page=page,
                          max_blocks=128 // page, causal=True, window_size=(40, 0)))


def test_two_query_tiles_per_program():
    """Head dim 96 takes two query tiles per program (as on Hopper), whose second tile
    reads the key tiles past the first's alone under a causal bound."""
    check_paged(PagedCase((45, 3), (60, 30), 2, 2, 96, 96, torch.bfloat16, page=16,
                          causal=True, sinks=torch.bfloat16))


def test_equals_the_packed_call_bit_for_bit():
    """The same kernel and tiles over the pages as over the gathered keys: the same bits
    (a chunked prefill: 7 new queries after a cached prefix of 30 keys, ALiBi, softcap)."""
    case = PagedCase((7, 12), (37, 12), 2, 2, 32, 32, torch.float16, causal=True,
                     softcap=4.0, alibi=(4,))
    args, mods = make_paged(case)
    q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, table = args
    paged = flashop.attention_varlen_with_lse(*args[:7], **mods, **case.options(),
                                              block_table=table)
    packed = flashop.attention_varlen_with_lse(
        q, gather_pages(k_cache, table, case.lens_k), gather_pages(v_cache, table, case.lens_k),
        cu_q, cu_k, max_q, max_k, **mods, **case.options())
    assert all(torch.equal(a, b) for a, b in zip(paged, packed))


def test_flash_attn_varlen_func_with_block_table():
    """nano-vllm's call: the engine writes the new tokens' keys and values into the pages
    (here by attention_with_kvcache's append), then flash_attn_varlen_func(q, k_cache,
    v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
    block_table=block_table) attends each sequence's cached prefix and new tokens."""
    case = PagedCase((5, 16), (21, 16), 2, 2, 32, 32, torch.bfloat16, causal=True)
    (q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, table), _ = make_paged(case)
    new_k = [torch.randn(1, n, 2, 32, device=DEVICE).to(case.dtype) for n in case.lens_q]
    with torch.no_grad():
        for b, prefix in enumerate((16, 0)):  # each sequence's new tokens after its prefix
            flashop.attention_with_kvcache(q[None, :1], k_cache, v_cache, new_k[b], new_k[b],
                                           cache_seqlens=prefix, block_table=table[b:b + 1])
    out, lse, probs = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k,
                                                causal=True, block_table=table,
                                                return_attn_probs=True)
    assert probs is None
    expected = flashop.attention_varlen_with_lse(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k,
                                                 causal=True, block_table=table)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    k, v = gather_pages(k_cache, table, case.lens_k), gather_pages(v_cache, table, case.lens_k)
    assert torch.equal(k[16:21], new_k[0][0]) and torch.equal(k[21:], new_k[1][0])
    ref, plain = (attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True,
                                             compute_dtype=dtype)[0]
                  for dtype in (torch.float64, None))
    result = accuracy("out", out, ref, plain, 2, case.dtype)
    assert result.ok, str(result)


def test_backward_raises():
    """Forward only, as in flash-attn: the output of inputs requiring grad carries a graph
    whose backward raises, eager and through the operator."""
    case = PagedCase((4,), (9,), 1, 1, 16, 16, torch.float32)
    args, _ = make_paged(case)
    q = args[0].requires_grad_()
    expected = flashop.attention_varlen(*args[:7], block_table=args[7])
    out = flashop.attention_varlen(q, *args[1:7], block_table=args[7])
    assert out.requires_grad and torch.equal(out.detach(), expected)
    with pytest.raises(RuntimeError, match="no backward over paged keys and values"):
        out.sum().backward()
    with flashop.config.override(direct_eager=False):
        out = flashop.attention_varlen(q, *args[1:7], block_table=args[7])
    with pytest.raises(RuntimeError, match="paged prefill is forward-only, as in flash-attn"):
        out.sum().backward()


def test_opcheck():
    case = PagedCase((6, 0, 5), (20, 3, 17), 1, 2, 16, 24, torch.float16, causal=True,
                     window_size=(12, 0), softcap=3.0, alibi=(3, 2), sinks=torch.float32,
                     max_blocks=2)
    args, mods = make_paged(case)
    opcheck(torch.ops.flashop.attention_varlen_paged.default,
            (*args, mods["alibi_slopes"], mods["sinks"]),
            dict(causal=True, window_size_left=12, softcap=3.0))


def test_schema():
    assert str(torch.ops.flashop.attention_varlen_paged.default._schema) == (
        "flashop::attention_varlen_paged(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        "Tensor block_table, Tensor? alibi_slopes=None, Tensor? sinks=None, *, "
        "bool causal=False, float? scale=None, SymInt window_size_left=-1, "
        "SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0.) -> "
        "(Tensor, Tensor)")


# --- bad input ------------------------------------------------------------------------------

OP = "flashop.attention_varlen: "


def _error(**changes) -> str:
    case = PagedCase((3, 5), (20, 9), 2, 2, 16, 16, torch.float16, max_blocks=2)
    args, _ = make_paged(case)
    call = dict(zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                     "max_seqlen_k", "block_table"), args))
    call.update(changes)
    with pytest.raises(ValueError) as info:
        flashop.attention_varlen(**call)
    return str(info.value)


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, device=DEVICE, dtype=dtype)


ERRORS = {
    "packed keys": (dict(k=_t(29, 2, 16), v=_t(29, 2, 16)),
                    "with a block_table, q must be packed (total_q, heads, head_dim) and k, v "
                    "paged caches (num_blocks, page_size, kv_heads, head_dim), got q (8, 4, "
                    "16), k (29, 2, 16), v (29, 2, 16)"),
    "dtype": (dict(v=_t(5, 16, 2, 16, dtype=torch.bfloat16)),
              "q, k and v must have the same dtype, got q torch.float16, k torch.float16, v "
              "torch.bfloat16; cast them to one of float16, bfloat16, float32"),
    "heads": (dict(q=_t(8, 3, 16)),
              "the number of query heads (3) must be a multiple of the cache's number of "
              "key/value heads (2) for grouped-query attention, got q (8, 3, 16), k (5, 16, "
              "2, 16), v (5, 16, 2, 16)"),
    "pages": (dict(v=_t(5, 32, 2, 16)),
              "k and v must be pages of one shape (num_blocks, page_size, kv_heads) with q's "
              "head dim in k, got q (8, 4, 16), k (5, 16, 2, 16), v (5, 32, 2, 16)"),
    "block table": (dict(block_table=_t(2, 2, dtype=torch.int64)),
                    "block_table must be a 2-D int32 tensor (batch, max_blocks) = (2, ...) of "
                    "page indices into the caches' first dim, got torch.int64 of shape (2, 2)"),
    "block table rows": (dict(block_table=_t(3, 2, dtype=torch.int32)),
                         "block_table must be a 2-D int32 tensor (batch, max_blocks) = (2, ...) "
                         "of page indices into the caches' first dim, got torch.int32 of shape "
                         "(3, 2)"),
    "page size": (dict(k=_t(5, 24, 2, 16), v=_t(5, 24, 2, 16)),
                  "the paged cache's page size (k_cache dim 1) must be a power of two from 16 "
                  "to 256, got 24 (q (8, 4, 16), k (5, 24, 2, 16), v (5, 24, 2, 16))"),
    "capacity": (dict(max_seqlen_k=33),
                 "max_seqlen_k = 33 keys do not fit the block table's 2 pages of 16 (32 keys "
                 "per sequence); give each sequence enough pages"),
    "offsets": (dict(cu_seqlens_k=_t(3, dtype=torch.int64)),
                "cu_seqlens_k must be a 1-D int32 tensor of batch + 1 cumulative offsets (0, "
                "len_0, len_0 + len_1, ...), got torch.int64 of shape (3,)"),
    "gate": (dict(g=_t(29, 4), causal=True),
             "the gate g is not supported with a block_table: attention over paged keys and "
             "values is forward-only (as in flash-attn), for inference; pass k and v packed "
             "(total_k, kv_heads, head_dim) for training"),
    "dropout": (dict(dropout_p=0.1),
                "dropout_p=0.1 is not supported with a block_table: attention over paged keys "
                "and values is forward-only (as in flash-attn), for inference; pass k and v "
                "packed (total_k, kv_heads, head_dim) for training"),
    "window": (dict(causal=True, window_size=(3, 2)),
               "causal=True attends no key after the query, but window_size=(3, 2) asks for 2 "
               "after it; pass window_size=(3, 0) (or -1) with causal=True, or causal=False "
               "for a two-sided window"),
    "sinks": (dict(sinks=_t(3, dtype=torch.float32)),
              "sinks must have shape (H,) = (4,): one logit per query head, got (3,)"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_messages(name):
    changes, message = ERRORS[name]
    assert _error(**changes) == OP + message


# --- GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16_chunked_prefill(page, D):
    """bf16 on the GPU's tiles (each key's page id over pages of 16, a tile's one id over
    256): prefills of up to 1500 queries over cached prefixes up to 2048 keys, GQA 4."""
    check_paged(PagedCase((1, 700, 1500, 0), (2048, 1400, 1500, 0), 2, 4, D, D,
                          torch.bfloat16, page=page, max_blocks=2048 // page, spare=3,
                          causal=True))
