"""The kernels' score arguments, built in one place for the forward, backward and decoding
kernels: the scale in base-2 units, the softcap, the keys' bounds, ALiBi's and the sinks'
strides, and the compile-time flags, each flag derived from the modifier's value (a tensor
from whether it is None). The tensors themselves are passed beside these, by name."""

from __future__ import annotations

from typing import Optional

import torch

from flashop._launch.common import TensorMeta
from flashop._launch.options import Modifiers
from flashop.kernels.common import LOG2E as _LOG2E

LOG2E = _LOG2E.value  # log2(e): natural-log units to base 2, as the kernels define it
# log2(e) as the kernels multiply by it, rounded to fp32 (a Python float, as traced graphs
# take constants)
LOG2E_FP32 = torch.tensor(LOG2E, dtype=torch.float32).item()

_PLAIN = {causal: dict(softcap_log2=0.0, left=0, right=0, chunk=0, stride_ab=0, stride_ah=0,
                       HAS_LEFT=False, HAS_RIGHT=causal, HAS_CHUNK=False, HAS_SOFTCAP=False,
                       HAS_ALIBI=False)
          for causal in (False, True)}

# A chunk longer than every sequence is one chunk from key 0 on: kernels take at most this
# many keys per chunk, so that a position plus a chunk stays within int32
MAX_CHUNK = 2 ** 30


def score_args(mods: Modifiers, sm_scale: float, alibi: Optional[TensorMeta]) -> dict:
    """``qk_scale`` and ``softcap_log2`` (scores in base 2: ``qk_scale = scale * log2 e``,
    or ``scale / softcap`` under a softcap, whose ``softcap * log2 e`` then multiplies the
    tanh), the bounds ``left`` and ``right`` (0 where unbounded) with HAS_LEFT / HAS_RIGHT
    (causal is a right bound of 0), the ``chunk`` length with HAS_CHUNK, HAS_SOFTCAP, and
    the (batch, head) strides of the ALiBi slopes ``alibi`` (the slopes' meta, None without
    them) with HAS_ALIBI. (A decode plan's ``mods`` come without their tensors, ALiBi's
    slopes then in ``alibi`` alone: plain Modifiers with slopes are not plain here.)"""
    if mods.is_plain and alibi is None:
        return dict(_PLAIN[mods.causal], qk_scale=sm_scale * LOG2E)
    left, right = mods.bounds
    if mods.softcap > 0:
        qk_scale, softcap_log2 = sm_scale / mods.softcap, mods.softcap * LOG2E
    else:
        qk_scale, softcap_log2 = sm_scale * LOG2E, 0.0
    stride_ab = stride_ah = 0
    if alibi is not None:  # (H,) or (B, H)
        stride_ab, stride_ah = (alibi.stride[0] if len(alibi.shape) == 2 else 0,
                                alibi.stride[-1])
    chunk = mods.attention_chunk
    return dict(qk_scale=qk_scale, softcap_log2=softcap_log2, left=max(left, 0),
                right=max(right, 0), chunk=min(chunk, MAX_CHUNK), stride_ab=stride_ab,
                stride_ah=stride_ah, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                HAS_CHUNK=chunk > 0, HAS_SOFTCAP=mods.softcap > 0, HAS_ALIBI=alibi is not None)


def sink_args(sinks: Optional[TensorMeta]) -> dict:
    """The forward's and the decoding kernel's sink arguments but the tensor: its head
    stride and HAS_SINK (None: no sinks)."""
    if sinks is None:
        return dict(stride_sh=0, HAS_SINK=False)
    return dict(stride_sh=sinks.stride[0], HAS_SINK=True)


def sink_log2(sinks: torch.Tensor, g_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sinks in the forward's frame of base-2 scores: ``sinks * log2 e`` (H, 1),
    broadcasting against lse_log2 in both layouts, (B, H, S_q) and (H, total_q); where
    there is a gate, less each query's gate ``G_i * log2 e`` (``g_rows``, lse's layout),
    rounded once as the forward's FMA rounds it (the fp64 product is exact)."""
    frame = (sinks.float() * LOG2E_FP32)[:, None]
    if g_rows is not None:
        frame = (frame.double() - g_rows.double() * LOG2E_FP32).float()
    return frame
