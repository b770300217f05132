"""Value types of one attention call, shared by the validation, launch and op layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# dropout draws 16 random bits per probability: dropout_p is rounded to a multiple of this
DROPOUT_RESOLUTION = 2.0 ** -16


def round_dropout_p(p):
    """``dropout_p`` as the kernels apply it: rounded to the nearest multiple of 2**-16 (at
    most 1 - 2**-16), since each probability is kept where 16 random bits reach p * 2**16.
    The output is scaled by 1 / (1 - the rounded p), so its expectation stays exact. A value
    that is not a probability comes back as it was, for validation to reject."""
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p < 1.0):
        return p
    steps = min(round(p / DROPOUT_RESOLUTION), int(1 / DROPOUT_RESOLUTION) - 1)
    return steps * DROPOUT_RESOLUTION


@dataclass(frozen=True)
class Modifiers:
    """Score modifiers of one call, as the ops receive them (docs/modifiers.md)."""

    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # (H,) or (B, H) fp32
    g: Optional[torch.Tensor] = None  # (B, S_k, H) log-decay gate
    attn_mask: Optional[torch.Tensor] = None  # bool keep-mask or additive float bias
    sinks: Optional[torch.Tensor] = None  # (H,) one logit per head in every denominator
    dropout_p: float = 0.0  # dropout on the probabilities (0: none)
    dropout_seed: Optional[torch.Tensor] = None  # int64 (1,): the Philox key, dropout_p > 0

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def is_plain(self) -> bool:
        """No modifier but (possibly) causal: one of the shared PLAIN values."""
        return self is PLAIN[self.causal]

    @property
    def is_plain_but_dropout(self) -> bool:
        """No modifier but (possibly) causal and dropout."""
        return self.is_plain or (
            self.dropout and self.window_size == (-1, -1) and self.softcap == 0.0
            and all(x is None for x in (self.alibi_slopes, self.g, self.attn_mask, self.sinks)))


# Calls without modifiers (but causal) share these, so the plain path adds little host time
PLAIN = {False: Modifiers(), True: Modifiers(causal=True)}


def modifiers(attn_mask=None, alibi_slopes=None, g=None, causal=False, window_size=None,
              softcap=0.0, sinks=None, dropout_p=0.0, dropout_seed=None) -> Modifiers:
    """The Modifiers of an op's arguments (``window_size=None`` is (-1, -1)); the shared
    PLAIN value where there are none. ``dropout_seed`` is dropped where ``dropout_p`` is 0."""
    window_size = (-1, -1) if window_size is None else tuple(window_size)
    if (attn_mask is None and alibi_slopes is None and g is None and window_size == (-1, -1)
            and softcap == 0.0 and sinks is None and dropout_p == 0.0):
        return PLAIN[bool(causal)]
    return Modifiers(causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, g=g, attn_mask=attn_mask, sinks=sinks,
                     dropout_p=dropout_p,
                     dropout_seed=dropout_seed if dropout_p != 0.0 else None)


@dataclass(frozen=True)
class Packing:
    """A packed batch (flash_attn_varlen's convention): sequence b holds the query tokens
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` and the key tokens likewise; the longest
    lengths size the grid."""

    cu_seqlens_q: torch.Tensor  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1
