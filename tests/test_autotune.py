"""Autotuning (FLASHOP_AUTOTUNE=1): the candidates' shared-memory pruning and the lengths'
buckets everywhere; the autotuned kernels themselves on a GPU (the interpreter runs one
config only)."""

import functools
from dataclasses import replace

import pytest
import torch
import triton

import flashop
from flashop import config
from flashop._launch.problem import PLAIN_FLAGS
from flashop._launch import tiles as tile_table
from flashop.kernels import INTERPRETING
from flashop.kernels.backward import attention_bwd_dkdv_kernel
from flashop.kernels.backward_dq import attention_bwd_dq_kernel
from flashop.kernels.forward import attention_fwd_kernel
from flashop._launch.common import block_dim
from flashop._launch.tiles import Tiles
from flashop.testing import check_attention
from helpers import DEVICE, Case, check_case, make_inputs

H200_SHARED_MEMORY = 232448  # bytes a program may take on an H100 / H200 (Triton's report)


def test_shared_memory_counts_one_buffer_per_stage_of_loop_operands():
    # forward at D=128, 128x128 tiles, 3 stages: Q once, K and V three times, 2-byte elements;
    # Triton compiled this tile (229376 bytes) and refused one needing 262144
    assert tile_table.shared_memory_bytes("fwd", Tiles(128, 128, 8, 3), 128, 128, 2) == \
        2 * (128 * 128 + 3 * 128 * 256)
    # dK/dV: K and V once, Q and dO per stage; dQ: Q and dO once, K and V per stage
    assert tile_table.shared_memory_bytes("dkdv", Tiles(64, 32, 4, 2), 64, 128, 2) == \
        2 * (32 * 192 + 2 * 64 * 192)
    assert tile_table.shared_memory_bytes("dq", Tiles(64, 32, 4, 2), 64, 128, 2) == \
        2 * (64 * 192 + 2 * 32 * 192)
    # the dK/dV kernel's dV part: K once, Q and dO per stage (Triton: 196864 bytes at D=256)
    assert tile_table.shared_memory_bytes("dv", Tiles(64, 128, 8, 2), 256, 256, 2) == \
        2 * (128 * 256 + 2 * 64 * 512)


def test_shared_memory_counts_the_staged_fp32_dq_tile_of_the_atomic_backward():
    # Triton needed 262656 bytes for this tile at D=256 on an H200, over its 232448
    t = Tiles(64, 64, 8, 2)
    assert tile_table.shared_memory_bytes("dkdv_atomic", t, 256, 256, 2) == \
        2 * (64 * 512 + 2 * 64 * 512) + 4 * 64 * 256
    assert tile_table.shared_memory_bytes("dkdv_atomic", t, 256, 256, 2) > H200_SHARED_MEMORY


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", sorted(tile_table.TILE_CANDIDATES))
@pytest.mark.parametrize("block", [64, 128, 256])
def test_the_tables_tiles_fit_a_hopper_gpu(kind, block, causal, short):
    t = tile_table._gpu_tiles(kind, block, hopper=True, causal=causal, short=short)
    assert tile_table.shared_memory_bytes(kind, t, block, block, 2) <= H200_SHARED_MEMORY, t


@pytest.mark.parametrize("value_dim", [64, 128, 160, 192, 256])
@pytest.mark.parametrize("head_dim", [160, 192, 256])
def test_the_forward_above_128_takes_a_third_stage_where_the_values_leave_room(head_dim,
                                                                              value_dim):
    """Head dims above 128 on Hopper: three stages of key and value tiles where the values'
    are at most 128 wide (DeepSeek's prefill, D = 192 and DV = 128), two where they are
    wider; either fits the shared memory."""
    t = tile_table._gpu_tiles("fwd", head_dim, hopper=True, value_dim=value_dim)
    assert t.num_stages == (3 if value_dim <= 128 else 2)
    # an attn_mask's tiles are pipelined too: two stages (a float mask's took 233 KiB)
    assert tile_table._gpu_tiles("fwd", head_dim, hopper=True, value_dim=value_dim,
                                 masked=True).num_stages == 2
    block_dv = tile_table.next_power_of_2(value_dim)
    assert tile_table.shared_memory_bytes("fwd", t, 256, block_dv, 2) <= H200_SHARED_MEMORY
    assert tile_table.shared_memory_bytes("fwd", replace(t, num_stages=3), 256, 256, 2) > \
        H200_SHARED_MEMORY


@pytest.mark.parametrize("value_dim", [128, 160, 192])
@pytest.mark.parametrize("kind", ["dv", "dk"])
def test_the_dkdv_parts_take_a_third_stage_where_the_head_dim_is_in_two_tiles(kind,
                                                                              value_dim):
    """The dK/dV kernel's parts above head dim 128 on Hopper: three stages where q's and k's
    head dim is in two tiles (D = 192: 128 + 64 wide) and the values' at most 128 wide, with
    no attn_mask; two otherwise. The three fit the shared memory at those widths."""
    parts = tile_table._gpu_tiles(kind, 256, hopper=True, value_dim=value_dim,
                                  head_in_parts=True)
    one = tile_table._gpu_tiles(kind, 256, hopper=True, value_dim=value_dim)
    masked = tile_table._gpu_tiles(kind, 256, hopper=True, value_dim=value_dim,
                                   head_in_parts=True, masked=True)
    assert parts.num_stages == (3 if value_dim <= 128 else 2)
    assert one.num_stages == masked.num_stages == 2
    block_dv = tile_table.next_power_of_2(value_dim)
    assert tile_table.shared_memory_bytes(kind, parts, 192, block_dv, 2) <= H200_SHARED_MEMORY


def test_the_dkdv_kernel_runs_in_one_pass_where_the_head_dim_is_in_two_tiles(monkeypatch):
    """Hopper, 16-bit inputs above head dim 128: the dK/dV kernel in one pass where q's and
    k's head dim is in two tiles (D = 192: 128 + 64) and the values' at most 128 wide
    (DeepSeek's prefill), its 32-row tile with 8 warps, three stages (two with an attn_mask);
    in two parts otherwise (one program holding both accumulators spills there)."""
    monkeypatch.setattr(tile_table, "is_hopper", lambda device: True)
    gpu, bf16 = torch.device("cuda", 0), torch.bfloat16
    splits = functools.partial(tile_table.splits_dkdv, dtype=bf16, device=gpu)
    assert not splits(192, head_in_parts=True, value_dim=128)
    assert not splits(160, head_in_parts=True, value_dim=64)
    assert splits(192, head_in_parts=True, value_dim=192)
    assert splits(192, head_in_parts=False, value_dim=128)
    assert splits(256, head_in_parts=False, value_dim=256)
    t = tile_table._gpu_tiles("dkdv", 192, hopper=True, value_dim=128, head_in_parts=True)
    assert t == Tiles(32, 128, 8, 3)
    assert tile_table._gpu_tiles("dkdv", 192, hopper=True, value_dim=128, head_in_parts=True,
                                 masked=True) == Tiles(32, 128, 8, 2)
    assert tile_table.shared_memory_bytes("dkdv", t, 256, 128, 2) <= H200_SHARED_MEMORY
    assert tile_table._gpu_tiles("dkdv", 256, hopper=True) == Tiles(64, 64, 8, 2)


def test_the_dq_kernel_takes_128_rows_where_the_head_dim_is_one_tile_above_128():
    """Hopper, head dims above 128: the dQ kernel's 128 x 32 tile with 8 warps where q's and
    k's head dim is one 256-wide tile, 64 x 32 with 4 warps where it is two (D = 192: 128 +
    64) or where an attn_mask's tiles are staged too (the 128 rows' then need 232-256 KiB:
    tests/compile_for_hopper.py compiles that call); both fit the shared memory."""
    one = tile_table._gpu_tiles("dq", 256, hopper=True)
    parts = tile_table._gpu_tiles("dq", 192, hopper=True, head_in_parts=True)
    assert (one, parts) == (Tiles(128, 32, 8, 3), Tiles(64, 32, 4, 3))
    assert tile_table._gpu_tiles("dq", 256, hopper=True, masked=True) == Tiles(64, 32, 4, 3)
    assert tile_table.shared_memory_bytes("dq", one, 256, 256, 2) <= H200_SHARED_MEMORY
    assert tile_table._gpu_tiles("dq", 256, hopper=False) == Tiles(64, 32, 4, 1)


@pytest.mark.parametrize("kind", sorted(tile_table.TILE_CANDIDATES))
@pytest.mark.parametrize("block", [64, 128, 256])
def test_prune_keeps_exactly_the_candidates_that_fit(kind, block):
    kept = tile_table.prune_tiles(kind, block, block, 2, H200_SHARED_MEMORY)
    for t in tile_table.TILE_CANDIDATES[kind]:
        fits = tile_table.shared_memory_bytes(kind, t, block, block, 2) <= H200_SHARED_MEMORY
        assert (t in kept) == fits, t
    assert kept, f"no {kind} candidate fits head-dim block {block}"


def test_prune_drops_big_tiles_at_head_dim_256():
    kept = tile_table.prune_tiles("fwd", 256, 256, 2, H200_SHARED_MEMORY)
    assert Tiles(128, 128, 8, 3) not in kept and Tiles(128, 64, 8, 2) in kept


def test_seq_bucket_rounds_the_longest_length_up_to_a_power_of_two():
    assert [tile_table.seq_bucket(s, 1) for s in (1, 2, 3, 1000, 1024, 1025)] == \
        [1, 2, 4, 1024, 1024, 2048]
    assert tile_table.seq_bucket(5, 300) == 512
    assert tile_table.seq_bucket(0, 0) == 1


def test_each_kernels_autotuning_key_names_its_arguments():
    """The key starts with the lengths' bucket and holds only the kernel's own arguments
    (triton.autotune refuses other names in newer Tritons)."""
    kernels = {"fwd": attention_fwd_kernel, "dkdv": attention_bwd_dkdv_kernel,
               "dq": attention_bwd_dq_kernel}
    for kind, kernel in kernels.items():
        key = tile_table.autotune_key(kernel)
        assert key[0] == "seq_bucket" and set(key) <= set(kernel.arg_names), (kind, key)
        assert "TMA" in key, (kind, key)  # (the backward reads descriptors too)
        triton.autotune(configs=[triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})], key=key)(kernel)
    assert len(tile_table.autotune_key(kernels["fwd"])) == len(tile_table._AUTOTUNE_KEY)


needs_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


@pytest.fixture
def autotuning():
    tile_table.autotuned.cache_clear()
    with config.override(autotune=True):
        yield
    tile_table.autotuned.cache_clear()


@pytest.mark.parametrize("case", [
    Case(B=2, S_q=300, S_k=300, H_kv=2, G=2, D=64, DV=64, dtype=torch.bfloat16, causal=True),
    Case(B=1, S_q=77, S_k=513, H_kv=1, G=3, D=96, DV=96, dtype=torch.float16),
    Case(B=1, S_q=200, S_k=200, H_kv=2, G=1, D=128, DV=128, dtype=torch.bfloat16,
         window_size=(50, 0), softcap=20.0),
])
@pytest.mark.gpu
@needs_gpu
def test_autotuned_kernels_pass_the_accuracy_rule(autotuning, case):
    check_case(case)
    tuned = {kind: tile_table.autotuned(kernel, kind, block_dim(case.D),
                                     block_dim(case.DV), 2, torch.cuda.current_device())
             for kind, kernel in [("fwd", attention_fwd_kernel),
                                  ("dkdv", attention_bwd_dkdv_kernel),
                                  ("dq", attention_bwd_dq_kernel)]}
    for kind, kernel in tuned.items():
        assert len(kernel.cache) == 1, f"{kind} tuned {len(kernel.cache)} keys"


@pytest.mark.gpu
@needs_gpu
def test_autotuning_is_keyed_by_the_lengths_bucket(autotuning):
    tuned = tile_table.autotuned(attention_fwd_kernel, "fwd", 64, 64, 2,
                              torch.cuda.current_device())
    for S in (520, 700, 1024, 1025):  # buckets 1024, 1024, 1024, 2048
        q = torch.randn(1, S, 2, 64, device="cuda", dtype=torch.bfloat16)
        flashop.attention(q, q, q)
    assert sorted(key[0] for key in tuned.cache) == [1024, 2048]


@pytest.mark.gpu
@needs_gpu
def test_autotuned_kernels_compile_fullgraph(autotuning):
    """Inductor sees into the autotuned kernels too, and the compiled op passes the rule."""
    from torch._inductor.utils import run_and_get_code

    case = Case(B=2, S_q=256, S_k=256, H_kv=2, G=2, D=64, DV=64, dtype=torch.bfloat16,
                causal=True)
    (q, k, v), dout, dlse = make_inputs(case)

    compiled = torch.compile(lambda q, k, v: flashop.attention_with_lse(q, k, v, causal=True),
                             fullgraph=True)

    def step():
        out, lse = compiled(q, k, v)
        return out, lse, torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))

    torch._dynamo.reset()
    (out, lse, grads), code = run_and_get_code(step)
    code = "\n".join(code)
    for kernel in ("attention_fwd_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"):
        assert kernel in code, f"{kernel} not in Inductor's code"
    for result in check_attention(q, k, v, dout, dlse, out, lse, grads, causal=True):
        assert result.ok, str(result)


def test_the_forward_splits_its_query_tile_only_where_it_measured_faster():
    """Two query tiles per program at 64 < D <= 128 on Hopper (docs/notes/performance-notes.md,
    entry 22), but one of half the rows with an attn_mask, a window's left bound, or a
    causal bound over fewer than 4096 keys (known ones: symbolic lengths keep two)."""
    assert [tile_table._gpu_tiles("fwd", d, hopper=True).split_m for d in (64, 96, 128, 256)] == \
        [False, True, True, False]
    assert not tile_table._gpu_tiles("fwd", 128, hopper=False).split_m
    if not INTERPRETING:
        return
    cpu = torch.device("cpu")
    flags = dict(PLAIN_FLAGS[False])
    t = tile_table.forward_tiles(128, torch.float16, cpu, flags, 100)
    assert t.split_m and t.constexprs("fwd") == dict(BLOCK_M=32, BLOCK_N=16, SPLIT_M=True)
    assert tile_table.forward_tiles(64, torch.float16, cpu, flags, 100) == Tiles(32, 16)
    one = Tiles(16, 16)
    for change, S_k in ((dict(ATTN_MASK_KIND=1), 10**5), (dict(ATTN_MASK_KIND=2), 10**5),
                        (dict(HAS_LEFT=True), 10**5), (dict(HAS_RIGHT=True), 4095)):
        assert tile_table.forward_tiles(128, torch.float16, cpu, dict(flags, **change), S_k) == one
    causal = PLAIN_FLAGS[True]
    assert tile_table.forward_tiles(128, torch.float16, cpu, causal, 4096).split_m
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    assert tile_table.forward_tiles(128, torch.float16, cpu, causal,
                                ShapeEnv().create_unbacked_symint()).split_m
    assert tile_table.tiles_for("dq", 128, torch.float16, cpu).constexprs("dq") == \
        dict(BLOCK_M=32, BLOCK_N=16)


def test_the_backward_takes_its_tiles_for_the_causal_bound(monkeypatch):
    """Under a causal-like bound the dK/dV and dQ kernels take the table's causal tiles
    (smaller at D <= 64 on Hopper: docs/notes/performance-notes.md, entry 29); without one, the
    others."""
    assert tile_table._gpu_tiles("dkdv", 64, hopper=True, causal=True) == Tiles(32, 64, 4, 3)
    assert tile_table._gpu_tiles("dq", 64, hopper=True, causal=True) == Tiles(64, 64, 4, 3)
    assert tile_table._gpu_tiles("dkdv", 64, hopper=True) == Tiles(32, 128, 4, 3)
    assert tile_table._gpu_tiles("dq", 64, hopper=True) == Tiles(128, 64, 8, 3)
    asked = []
    tiles_for = tile_table.tiles_for

    def recording(kind, *args, **kwargs):
        asked.append((kind, kwargs.get("causal", False), kwargs.get("short", False)))
        return tiles_for(kind, *args, **kwargs)

    monkeypatch.setattr(tile_table, "tiles_for", recording)
    for causal, window, bounded in ((True, (-1, -1), True), (False, (-1, 3), True),
                                    (False, (3, -1), False), (False, (-1, -1), False)):
        asked.clear()
        case = Case(1, 40, 40, 1, 2, 16, 16, torch.float32, causal, window_size=window)
        (q, k, v), dout, _ = make_inputs(case)
        out = flashop.attention(q, k, v, causal=causal, window_size=window)
        out.backward(dout)
        assert sorted(asked) == [(kind, bounded, True) for kind in ("dkdv", "dq", "fwd")], asked


def test_short_causal_calls_take_the_tables_short_tiles():
    """Under a causal-like bound over fewer than SHORT_KEYS keys, the Hopper table takes
    64-row forward tiles with 4 warps and smaller backward tiles (docs/notes/performance-notes.md,
    entry 36); from SHORT_KEYS keys on, or where the length is symbolic, the others."""
    tiles = tile_table._gpu_tiles
    for d in (64, 128):
        assert tiles("fwd", d, hopper=True, causal=True, short=True) == Tiles(64, 64, 4, 3)
    assert tiles("fwd", 128, hopper=True, short=True).split_m  # no bound: as long ones
    assert tiles("fwd", 128, hopper=True, causal=True).split_m
    assert tiles("fwd", 256, hopper=True, causal=True, short=True) == tiles("fwd", 256, True)
    assert tiles("fwd", 128, hopper=False, causal=True, short=True) == \
        tiles("fwd", 128, hopper=False)
    assert tiles("dkdv", 128, hopper=True, causal=True, short=True) == Tiles(32, 64, 4, 3)
    assert tiles("dkdv", 128, hopper=True, causal=True) == Tiles(64, 128, 8, 3)
    assert tiles("dkdv", 128, hopper=True, short=True) == Tiles(64, 128, 8, 3)
    assert tiles("dkdv", 64, hopper=True, short=True) == Tiles(32, 64, 4, 3)
    assert tiles("dq", 64, hopper=True, causal=True, short=True) == Tiles(64, 32, 4, 3)
    assert tiles("dq", 128, hopper=True, causal=True, short=True) == Tiles(128, 64, 8, 3)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    assert [tile_table.is_short(n) for n in (1, 4095, 4096)] == [True, True, False]
    assert not tile_table.is_short(ShapeEnv().create_unbacked_symint())
