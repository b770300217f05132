"""Value types of one attention call, built once per call by the operators and read by
their checks (flashop._ops) and by the launchers: its score modifiers and its packing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# dropout draws 16 random bits per probability: dropout_p is rounded to a multiple of this
DROPOUT_RESOLUTION = 2.0 ** -16


def round_dropout_p(p):
    """``dropout_p`` as the kernels apply it: rounded to the nearest multiple of 2**-16 (at
    most 1 - 2**-16), since each probability is kept where 16 random bits reach p * 2**16.
    The output is scaled by 1 / (1 - the rounded p), so its expectation stays exact. A value
    that is not a probability comes back as it was, for the checks to reject."""
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p < 1.0):
        return p
    steps = min(round(p / DROPOUT_RESOLUTION), int(1 / DROPOUT_RESOLUTION) - 1)
    return steps * DROPOUT_RESOLUTION


@dataclass(frozen=True)
class Modifiers:
    """Score modifiers of one call, as the operators receive them (docs/modifiers.md)."""

    causal: bool = False
    window_size_left: int = -1  # -1: unbounded
    window_size_right: int = -1
    attention_chunk: int = 0  # 0: off; else each query attends the keys of its chunk only
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # (H,) or (B, H) fp32
    g: Optional[torch.Tensor] = None  # (B, S_k, H) log-decay gate
    attn_mask: Optional[torch.Tensor] = None  # bool keep-mask or additive float bias
    sinks: Optional[torch.Tensor] = None  # (H,) one logit per head in every denominator
    dropout_p: float = 0.0  # as the kernels draw it (round_dropout_p); 0: no dropout
    dropout_seed: Optional[torch.Tensor] = None  # int64 (1,): the Philox key, with dropout
    # derived once, when the call's Modifiers are made (read on every call's hot path)
    dropout: bool = field(init=False, repr=False, compare=False)
    # no modifier but (possibly) causal and dropout
    is_plain_but_dropout: bool = field(init=False, repr=False, compare=False)
    # no modifier but (possibly) causal (modifiers() then gives a shared PLAIN value)
    is_plain: bool = field(init=False, repr=False, compare=False)
    # the keys' (left, right) bounds around each query's diagonal (-1: unbounded): the
    # window's, with right = 0 where causal
    bounds: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        dropout = self.dropout_p > 0
        plain_but_dropout = (
            self.window_size_left == self.window_size_right == -1
            and self.attention_chunk == 0 and self.softcap == 0.0
            and all(x is None for x in (self.alibi_slopes, self.g, self.attn_mask, self.sinks)))
        object.__setattr__(self, "dropout", dropout)
        object.__setattr__(self, "is_plain_but_dropout", plain_but_dropout)
        # (a dropout_p that is not a probability is not plain: the checks refuse it)
        object.__setattr__(self, "is_plain", plain_but_dropout and self.dropout_p == 0.0)
        object.__setattr__(self, "bounds", (self.window_size_left,
                                            0 if self.causal else self.window_size_right))


# Calls without modifiers (but causal) share these, so the plain path adds little host time
PLAIN = {False: Modifiers(), True: Modifiers(causal=True)}


def modifiers(attn_mask=None, alibi_slopes=None, g=None, causal=False, window_size_left=-1,
              window_size_right=-1, softcap=0.0, sinks=None, dropout_p=0.0,
              dropout_seed=None, attention_chunk=0) -> Modifiers:
    """The Modifiers of an operator's arguments, ``dropout_p`` rounded as the kernels draw
    it; the shared PLAIN value where there are none. ``dropout_seed`` is dropped where
    there is no dropout."""
    dropout_p = round_dropout_p(dropout_p)
    if dropout_p == 0.0:
        if (attn_mask is None and alibi_slopes is None and g is None and sinks is None
                and window_size_left == -1 and window_size_right == -1 and softcap == 0.0
                and attention_chunk == 0):
            return PLAIN[bool(causal)]
        dropout_seed = None
    return Modifiers(causal=causal, window_size_left=window_size_left,
                     window_size_right=window_size_right, attention_chunk=attention_chunk,
                     softcap=softcap,
                     alibi_slopes=alibi_slopes, g=g, attn_mask=attn_mask, sinks=sinks,
                     dropout_p=dropout_p, dropout_seed=dropout_seed)


@dataclass(frozen=True)
class Packing:
    """A packed batch (flash_attn_varlen's convention): sequence b holds the query tokens
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` and the key tokens likewise; the longest
    lengths size the grid. With a ``block_table`` (paged prefill, forward only) k and v are
    paged caches and sequence b's keys are its first ``cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]`` keys in the pages of ``block_table[b]``."""

    cu_seqlens_q: torch.Tensor  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: Optional[torch.Tensor] = None  # (batch, max_blocks) int32

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def packing(cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: Optional[int], max_seqlen_k: Optional[int]) -> Optional[Packing]:
    """The Packing of an operator's packing arguments; None for a dense call (no
    ``cu_seqlens_q``)."""
    if cu_seqlens_q is None:
        return None
    return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
