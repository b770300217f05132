"""What an attention call runs, and why: the forward's and the backward's choice of kernels,
tiles and options, made once per call from its description (problem.Problem).

``choose_forward`` and ``choose_backward`` are the one place that reads the rules (the Gluon
kernels' in gluon.py, the tile table's in tiles.py, the descriptors' and the warp-specialized
kernel's below); the launchers launch what they return, and ``flashop.explain`` prints it.
Each rule that rules something out says so in the choice's ``why`` (a rule returns
``decline(why, reason)``, which records the reason and is False).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flashop import config
from flashop._launch import cpu, gluon, tiles
from flashop._launch.common import (
    block_dim, decline, head_blocks, is_hopper, is_traced, known_shorter, resolve_scale,
    tma_aligned,
)
from flashop._launch.options import Modifiers, Packing
from flashop._launch.scores import LOG2E
from flashop.kernels import INTERPRETING

# Tensor descriptors (Hopper's copy engine, TMA) for the forward's key and value tiles: by
# default at head dims above 128 over at least TMA_MIN_KEYS keys on Hopper (fewer keys, or
# smaller head dims, measured slower); config.settings.tma forces them on or off.
TMA_MIN_KEYS = 4096


@dataclass
class Choice:
    """What one pass of a call runs: ``path`` (the kernels' family), ``kernels`` (each
    kernel's name and tiles, in launch order), ``options`` (what else was chosen, by name)
    and ``why`` (each rule that ruled something out, in the order they were asked)."""

    path: str
    kernels: list = field(default_factory=list)
    options: dict = field(default_factory=dict)
    why: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.path}"]
        for name, t in self.kernels:
            lines.append(f"  {name}" + (f": {t}" if t is not None else ""))
        for name, value in self.options.items():
            lines.append(f"  {name}: {value}")
        lines += [f"  - {reason}" for reason in self.why]
        return "\n".join(lines)


def _tiles_text(t: tiles.Tiles) -> str:
    text = (f"{t.BLOCK_M}x{t.BLOCK_N} tiles, {t.num_warps} warps, {t.num_stages} "
            f"stage{'s' if t.num_stages > 1 else ''}")
    return text + (", two query tiles per program" if t.split_m else "")


def cpu_path(q, k, v, p, mods: Modifiers, differentiable: bool) -> tuple:
    """(path, kernels, options, why) of a call that the CPU path takes (cpu.serves): SDPA's
    CPU kernels where they compute it (cpu.attention.sdpa_serves: a dense call, or each
    sequence of a packed one, with its inputs as the path computes them: e4m3 ones
    dequantized to fp32), else the path's blocked computation over key tiles.
    ``differentiable``: a backward may follow (the training operators)."""
    from flashop._launch.cpu.attention import sdpa_serves

    why = ["Triton kernels: CPU tensors without Triton's interpreter (the CPU path)"]
    if q.dtype == torch.float8_e4m3fn:
        q = torch.empty(q.shape, dtype=torch.float32, device="meta")
    sdpa = sdpa_serves(q, k, v, mods, p.S_k - p.S_q, differentiable)
    if not sdpa:
        why.append("SDPA's CPU kernels: no modifiers or dropout, causal only where S_q = S_k, "
                   "D = DV" + (", 16-bit inputs where a backward may follow"
                               if differentiable else ""))
    how = ("SDPA's CPU flash-attention kernels" if sdpa
           else "PyTorch's CPU operations, blocked over key tiles")
    if p.packed:
        how = f"each sequence apart: {how}" + (" where its lengths allow" if sdpa else "")
    return "CPU path", [], {"computed by": how}, why


# --- the forward ----------------------------------------------------------------------------


def folds_scale(qk_scale: float, flags: dict, dtype: torch.dtype) -> bool:
    """Whether the kernels fold ``qk_scale`` into their exponent's FMA (FOLD_SCALE): P =
    exp2(fma(q.k, qk_scale, -shift)), one instruction per score (see
    flashop/kernels/forward.py's fwd_fold), where the scale is positive (the row max of the
    unscaled scores then scales to the scaled scores' max), no modifier comes between the
    product and the softmax (softcap, ALiBi, gate, a float attn_mask) and the inputs are
    16-bit or fp8. The forward and both backward kernels take the same rule, as the Gluon
    kernels (16-bit) always fold: the backward recomputes P against the forward's lse.

    fp32 inputs never fold: their scaled products are rounded on their own (common.py's
    rounded_product), in every kernel. With scores in the thousands the fold's exact
    product is not on the fp32 grid of the stored lse: a row whose probability sits on one
    key recomputed it as exp2(s * qk_scale - lse) = 1 - 2e-5, and fp32's dQ left the
    accuracy rule (1.1e-2 against 2.7e-3); rounded, that key's P is exactly 1."""
    return (qk_scale > 0 and dtype != torch.float32
            and not (flags["HAS_SOFTCAP"] or flags["HAS_ALIBI"] or flags["HAS_GATE"]
                     or flags["ATTN_MASK_KIND"] == 1))


def forward_takes_gluon(q, k, v, qk_scale: float, mods: Modifiers, packing: Optional[Packing],
                        traced: bool = False, why: Optional[list] = None) -> bool:
    """Whether the forward launches the Gluon kernel for this call (gluon.serves);
    ``traced``: whether a call traced for a graph compiled here may take it when the graph
    runs (the operator then calls the eager launcher through an opaque operator)."""
    return gluon.serves(q, k, v, mods.causal, qk_scale,
                        mods.is_plain_but_dropout and packing is None, mods.dropout, traced,
                        why)


def forward_runs_opaque(q, k, v, scale: Optional[float], mods: Modifiers,
                        packing: Optional[Packing]) -> bool:
    """Whether a traced forward runs through its opaque operator when the graph runs: on
    the CPU path (which reads values on the host, cpu.serves), or where the Gluon kernel
    takes it in a graph compiled here (forward_takes_gluon with ``traced``). False for an
    eager call, which is_traced tells once."""
    return is_traced(q) and (cpu.serves(q) or forward_takes_gluon(
        q, k, v, resolve_scale(scale, q.shape[-1]) * LOG2E, mods, packing, traced=True))


def backward_runs_opaque(q, k, v, dout, mods: Modifiers, attn_mask_grad: bool,
                         packing: Optional[Packing], deterministic: bool) -> bool:
    """As forward_runs_opaque, for the backward: the CPU path, or the Gluon backward in a
    graph compiled here (gluon_backward_order with ``traced``)."""
    return is_traced(q) and (cpu.serves(q) or gluon_backward_order(
        q, k, v, dout, mods, attn_mask_grad, packing, deterministic, traced=True)
        is not None)


def _tma_by_default(head_dim: int, S_k, device: torch.device, why=None) -> bool:
    """The descriptors' default rule: head dims above 128 and at least TMA_MIN_KEYS keys (the
    longest sequence's where packed) on a Hopper GPU. Where S_k is symbolic (torch.compile
    with dynamic shapes) the rule takes it as long: no guard on it."""
    if head_dim <= 128:
        return decline(why, f"tensor descriptors: by default above head dim 128, not at "
                            f"{head_dim}")
    if known_shorter(S_k, TMA_MIN_KEYS):
        return decline(why, f"tensor descriptors: by default from {TMA_MIN_KEYS} keys, not "
                            f"at {S_k}")
    if device.type != "cuda" or not is_hopper(device):
        return decline(why, "tensor descriptors: by default on Hopper GPUs only")
    return True


def uses_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, S_k,
             why=None) -> bool:
    """Whether the forward reads k and v through tensor descriptors: 16-bit inputs that meet
    their alignment, where the switch (or its default rule) selects them."""
    setting = config.settings.tma
    if setting is False:
        return decline(why, "tensor descriptors: off (FLASHOP_TMA=0)")
    if q.dtype == torch.float32:
        return decline(why, "tensor descriptors: not for float32 inputs")
    if setting is None and not _tma_by_default(head_dim, S_k, q.device, why):
        return False
    if not (tma_aligned(k) and tma_aligned(v)):
        return decline(why, "tensor descriptors: k or v not 16-byte aligned")
    return True


def backward_uses_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      head_dim: int, S_k, head_parts: bool, why=None) -> bool:
    """Whether the tl backward reads its loops' tiles through tensor descriptors (the dQ
    kernel's keys and values, the dK/dV kernel's queries and dO): the forward's rule
    (uses_tma), with q and dout aligned too, and by default not where q's and k's head dim
    is in two tiles (``head_parts``): measured slower there (D = 192), as at head dims up to
    128, and faster at 256."""
    if not uses_tma(q, k, v, head_dim, S_k, why):
        return False
    if head_parts and config.settings.tma is None:
        return decline(why, "tensor descriptors in the backward: by default not where the "
                            "head dim is in two tiles")
    if not (tma_aligned(q) and tma_aligned(dout)):
        return decline(why, "tensor descriptors: q or dout not 16-byte aligned")
    return True


def ws_query_layout(q: torch.Tensor) -> Optional[bool]:
    """How attention_fwd_ws_kernel reads ``q`` (B, S_q, H, D) as one 2-D array of rows:
    True where its (batch, head) slices of S_q rows follow one another (a head-major
    layout), False where its (batch, seq) rows hold the H heads side by side and D is a
    block width (the tile's columns stay in one head), None where neither holds."""
    B, S_q, H, D = q.shape
    sb, ss, sh = q.stride()[:3]
    if (H == 1 or sh == D) and (B == 1 or sb == S_q * ss) and D == block_dim(D):
        return False
    if (H == 1 or sh == S_q * ss) and (B == 1 or sb == H * S_q * ss):
        return True
    return None


def uses_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: dict, head_dim: int,
            S_k, packed: bool, why=None) -> bool:
    """Whether the forward runs the warp-specialized attention_fwd_ws_kernel: 16-bit dense
    inputs without modifiers or bounds, S_k a known multiple of its BLOCK_N (that kernel has
    no masked key tile; a symbolic S_k under torch.compile gets no guard: the split kernel),
    rows that descriptors can address, q in one of its layouts; and, unless the switch
    forces it, Hopper at head dims in (64, 128]."""
    what = "warp-specialized forward"
    setting = config.settings.warp_specialize
    if setting is False:
        return decline(why, f"{what}: off (FLASHOP_WS=0)")
    if packed or q.dtype == torch.float32:
        return decline(why, f"{what}: dense 16-bit or fp8 inputs only")
    if any(flags.values()):
        return decline(why, f"{what}: no modifier, causal or window bound")
    block_n = tiles.tiles_for("fwd_ws", head_dim, q.dtype, q.device).BLOCK_N
    if not isinstance(S_k, int) or S_k == 0 or S_k % block_n:
        return decline(why, f"{what}: the key length must be a known multiple of {block_n}")
    if setting is None and not (64 < head_dim <= 128 and q.device.type == "cuda"
                                and is_hopper(q.device)):
        return decline(why, f"{what}: by default at head dims 65-128 on Hopper GPUs")
    if q.dtype == torch.float8_e4m3fn:  # v keys-last (attention._fp8_values): its rows
        v_aligned = v.stride(-3) == 1 and tma_aligned(v.transpose(-3, -1))
    else:
        v_aligned = tma_aligned(v)
    if not (tma_aligned(q) and tma_aligned(k) and v_aligned):
        return decline(why, f"{what}: q, k or v not 16-byte aligned")
    if ws_query_layout(q) is None:
        return decline(why, f"{what}: q's layout is neither (B, S, H, D) nor head-major")
    return True


@dataclass
class ForwardChoice(Choice):
    tiles: Optional[tiles.Tiles] = None
    tma: bool = False
    fold: bool = False
    autotune: bool = False
    head_in_parts: bool = False


def head_in_parts(head_dim: int, device: torch.device, why=None) -> bool:
    """Whether the tl kernels, forward and backward, read q's and k's head dim as two tiles,
    a 128-wide one and a narrower one (common.head_blocks: D = 192 as 128 + 64 rather than
    256, a third of it padding; 128 < D <= 192): on Hopper GPUs, where that measured faster
    than one tile (forward 1.03-1.10x, backward 1.16-1.19x at D = 160 and 192 on an H200;
    performance notes, entry 116), and under the interpreter, so that CI runs the form;
    other GPUs keep one tile (unmeasured there)."""
    blocks = head_blocks(head_dim)
    if not blocks[1]:
        return False
    if not (INTERPRETING or (device.type == "cuda" and is_hopper(device))):
        return decline(why, f"q's and k's head dim in tiles of {blocks[0]} + {blocks[1]}: "
                            f"measured on Hopper GPUs only")
    return True


def _head_tiles_text(head_dim: int) -> str:
    """The option explain shows where head_in_parts takes a call: "128 + 64"."""
    return " + ".join(map(str, head_blocks(head_dim)))


def choose_forward(q, k, v, p, mods: Modifiers, fp8: bool = False) -> ForwardChoice:
    """The forward's kernel for the call ``p`` (problem.Problem) of q, k, v (as the
    launcher reads them): the Gluon kernel where its rule takes the call, else the
    warp-specialized kernel where its rule does (no sinks, no dropout), else the general
    kernel with its tiles (tiles.forward_tiles), its key and value tiles through tensor
    descriptors where their rule selects them (not over pages, and v with unit stride).
    The kernels' choice: a call of CPU tensors on the CPU path has cpu_path's."""
    why: list = []
    qk_scale = p.modifier_args["qk_scale"]
    if fp8:
        decline(why, "Gluon forward: not for float8_e4m3fn inputs")
    elif forward_takes_gluon(q, k, v, qk_scale, mods, p.packing, why=why):
        block_m, block_n, stages = gluon.forward_tiles(p.head_dim, mods.dropout)
        options = {}
        if gluon.forward_head_tiles(p.D)[1]:
            options["q's and k's head dim in tiles of"] = _head_tiles_text(p.D)
        return ForwardChoice(
            "Gluon forward", [("attention_fwd_gluon_kernel",
                               f"{block_m}x{block_n} tiles, {stages} stages, a load warp and "
                               f"{block_m // gluon.FWD_GROUP_ROWS} consumer groups")],
            options, why)
    fold = folds_scale(qk_scale, p.flags, q.dtype)
    if mods.sinks is not None or mods.dropout:
        decline(why, "warp-specialized forward: no sinks or dropout")
    elif uses_ws(q, k, v, p.flags, p.head_dim, p.S_k, p.packed, why):
        t = tiles.tiles_for("fwd_ws", p.head_dim, q.dtype, q.device)
        return ForwardChoice("tl forward, warp-specialized",
                             [("attention_fwd_ws_kernel", _tiles_text(t))],
                             {"scale folded into the exponent": fold}, why, tiles=t, fold=fold)
    paged = p.packing is not None and p.packing.block_table is not None
    if paged:
        tma = decline(why, "tensor descriptors: not over pages")
    elif v.stride(-1) != 1:
        tma = decline(why, "tensor descriptors: v is read keys-last")
    else:
        tma = uses_tma(q, k, v, p.head_dim, p.S_k, why)
    t = tiles.forward_tiles(p.head_dim, q.dtype, q.device, p.flags, p.S_k, why, p.DV)
    autotune = tiles.autotunes(q.dtype)
    parts = head_in_parts(p.D, q.device, why)
    options = {"tensor descriptors": tma, "scale folded into the exponent": fold}
    if parts:
        options["q's and k's head dim in tiles of"] = _head_tiles_text(p.D)
    if autotune:
        options["tiles"] = "autotuned (FLASHOP_AUTOTUNE=1)"
    return ForwardChoice("tl forward", [("attention_fwd_kernel", _tiles_text(t))], options,
                         why, tiles=t, tma=tma, fold=fold, autotune=autotune,
                         head_in_parts=parts)


# --- the backward ---------------------------------------------------------------------------


def deterministic_backward(requested: bool = False) -> bool:
    """Whether the backward must be bitwise reproducible (dQ summed in a fixed order: the dQ
    kernel sums each row in one program; the Gluon backward adds its key tiles' shares in
    order): where the caller asks for it (``deterministic=True``), under
    torch.use_deterministic_algorithms (warn_only too: a deterministic kernel exists), or
    with the atomics switched off (config.settings.dq_atomics False). Otherwise the fastest
    backward runs, which adds dQ by fp32 atomics where that measured faster (PyTorch's
    convention, as FlashAttention's and cuDNN's backwards)."""
    return (requested or torch.are_deterministic_algorithms_enabled()
            or config.settings.dq_atomics is False)


def gluon_backward_order(q, k, v, dout, mods: Modifiers, attn_mask_grad: bool,
                         packing: Optional[Packing], deterministic: bool,
                         traced: bool = False, why: Optional[list] = None) -> Optional[bool]:
    """Whether the backward launches the Gluon backward for this call, and how it adds dQ:
    None (it does not), False (by atomics: unless ``deterministic``, where
    gluon.serves_backward's rule takes the call), True (in key-tile order, where its rule
    takes the call). Plain dense calls only (dropout allowed). ``traced``: as in
    forward_takes_gluon."""
    missing = gluon.unavailable(q.device)
    if missing is not None:
        return decline(why, f"Gluon backward: {missing}") or None
    if packing is not None:
        return decline(why, "Gluon backward: dense calls only") or None
    if mods.g is not None or attn_mask_grad or not mods.is_plain_but_dropout:
        return decline(why, "Gluon backward: no modifier but causal and dropout") or None
    call = (q, k, v, dout, mods.causal, True)
    if deterministic:
        decline(why, "Gluon backward with dQ by atomics: the backward must be reproducible")
    elif gluon.serves_backward(*call, False, mods.dropout, traced, why):
        return False
    if gluon.serves_backward(*call, True, mods.dropout, traced, why):
        return True
    return None


@dataclass
class BackwardChoice(Choice):
    ordered: Optional[bool] = None  # the Gluon backward's dQ in a fixed order, or None
    rotated: bool = False  # that order rotated (gluon.backward_rotates), else key-tile order
    split: int = 1  # the Gluon backward's split of each group's query heads
    dq_atomic: bool = False  # the tl dK/dV kernel adds dQ by atomics (no dQ kernel)
    parts: tuple = ()  # the tl dK/dV kernel's launches: (kind, PARTS)
    tiles: dict = field(default_factory=dict)  # kind -> Tiles
    autotune: bool = False
    head_in_parts: bool = False  # head_in_parts: q's and k's head dim in two tiles
    tma: bool = False  # the tl kernels read their loops' tiles through tensor descriptors


def choose_backward(q, k, v, dout, p, mods: Modifiers, attn_mask_grad: bool,
                    deterministic: bool) -> BackwardChoice:
    """The backward's kernels for the call ``p`` (problem.Problem): the Gluon backward
    where its rule takes the call (dQ by atomics unless the backward must be reproducible,
    else in a fixed order: rotated where gluon.backward_rotates says so, else key-tile
    order); else the tl kernels: the dQ kernel, then the dK/dV kernel (in
    two parts above head dim 128, tiles.splits_dkdv), or, where the atomics are forced
    (config.settings.dq_atomics) and there is no gate and no mask gradient, the dK/dV kernel
    adding dQ by fp32 atomics alone. ``deterministic`` as deterministic_backward gives it.
    The kernels' choice: a call of CPU tensors on the CPU path has cpu_path's."""
    why: list = []
    causal = p.flags["HAS_RIGHT"]
    ordered = gluon_backward_order(q, k, v, dout, mods, attn_mask_grad, p.packing,
                                   deterministic, why=why)
    if ordered is not None:
        split = gluon.backward_split(q, k, causal, ordered)
        rotated = ordered and gluon.backward_rotates(causal, p.D, q.shape[1], k.shape[1],
                                                     q.device)
        adds = ("in a rotated order" if rotated else "in key-tile order" if ordered
                else "by atomics")
        return BackwardChoice(
            f"Gluon backward, dQ added {adds}",
            [("attention_bwd_preprocess_kernel", None),
             ("attention_bwd_gluon_kernel",
              f"{gluon.BWD_BLOCK_M}x{gluon.BWD_BLOCK_N} tiles, {gluon.BWD_STAGES} stages, a "
              f"load warp and two consumer groups"),
             ("attention_bwd_cast_kernel", None)],
            {"query heads of a group split between programs": split}, why,
            ordered=ordered, rotated=rotated, split=split)
    has_gate = mods.g is not None
    dq_atomic = config.settings.dq_atomics is True
    if dq_atomic and deterministic:
        dq_atomic = decline(why, "dQ by atomics: the backward must be reproducible")
    elif dq_atomic and (has_gate or attn_mask_grad):
        dq_atomic = decline(why, "dQ by atomics: not with a gate or a mask's gradient")
    elif not dq_atomic:
        decline(why, "tl dQ by atomics: only where FLASHOP_DQ_ATOMICS=1 (slower at most "
                     "shapes)")
    short = tiles.is_short(p.S_k)
    head_parts = head_in_parts(p.D, q.device, why)
    masked = p.flags["ATTN_MASK_KIND"] != 0
    found = {}
    if not dq_atomic:
        found["dq"] = tiles.tiles_for("dq", p.head_dim, q.dtype, q.device,
                                      mask_grad=attn_mask_grad, causal=causal, short=short,
                                      head_in_parts=head_parts, masked=masked)
    if dq_atomic:
        parts = (("dkdv_atomic", 3),)
    elif tiles.splits_dkdv(p.head_dim, q.dtype, q.device, why, head_parts, p.DV):
        parts = (("dv", 1), ("dk", 2))
    else:
        parts = (("dkdv", 3),)
    for kind, _ in parts:
        found[kind] = tiles.tiles_for(kind, p.head_dim, q.dtype, q.device, causal=causal,
                                      short=short, value_dim=p.DV, head_in_parts=head_parts,
                                      masked=masked)
    names = {"dq": "attention_bwd_dq_kernel", "dkdv": "attention_bwd_dkdv_kernel",
             "dkdv_atomic": "attention_bwd_dkdv_kernel, dQ by atomics",
             "dv": "attention_bwd_dkdv_kernel, dV part", "dk": "attention_bwd_dkdv_kernel, "
                                                              "dK part"}
    kernels = [(names[kind], _tiles_text(t)) for kind, t in found.items()]
    if dq_atomic:
        kernels = ([("attention_bwd_preprocess_kernel", None)] + kernels
                   + [("attention_bwd_cast_kernel", None)])
    autotune = tiles.autotunes(q.dtype)
    tma = backward_uses_tma(q, k, v, dout, p.head_dim, p.S_k, head_parts, why)
    options = {"bitwise reproducible": not dq_atomic, "tensor descriptors": tma}
    if head_parts:
        options["q's and k's head dim in tiles of"] = _head_tiles_text(p.D)
    if autotune:
        options["tiles"] = "autotuned (FLASHOP_AUTOTUNE=1)"
    return BackwardChoice("tl backward", kernels, options, why, dq_atomic=dq_atomic,
                          parts=parts, tiles=found, autotune=autotune,
                          head_in_parts=head_parts, tma=tma)
