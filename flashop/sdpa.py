"""flashop as PyTorch SDPA's flash-attention implementation.

Importing flashop registers the implementation ``"flashop"`` with PyTorch's flash-attention
registry (``torch.nn.attention.register_flash_attention_impl``; torch >= 2.11, skipped on
older torches) without activating it. After::

    torch.nn.attention.activate_flash_attention_impl("flashop")

the CUDA kernels of ``aten::_scaled_dot_product_flash_attention`` (SDPA's flash backend),
its backward, and ``aten::_flash_attention_forward`` / ``_backward`` (also behind
``torch.nn.attention.varlen.varlen_attn``) run flashop's operators;
``torch.nn.attention.restore_flash_attention_impl()`` puts PyTorch's kernels back.

The overrides convert layouts and conventions only: SDPA's (B, H, S, D) views become
flashop's (B, S, H, D) views (no copies), the natural-log logsumexp is aten's, and the
backward derives flashop's base-2 lse from it. They never call the aten operators they
replace.

Dropout (``dropout_p > 0``) is flashop's: the forward draws flashop's seed from torch's
generator of the query's device and returns it in aten's ``rng_state`` slot (the (2,) uint64
tensor aten's meta functions declare, the seed's bits in element 0, 0 in element 1; the
``unused`` offset is 0), and autograd hands that tensor back to the backward as
``philox_seed`` / ``rng_state``, which regenerates the same mask from it. Such a state
belongs to flashop's kernels: a backward of PyTorch's kernels cannot use it, nor flashop's
backward theirs.

What flashop cannot do raises ``NotImplementedError`` naming the argument:
``return_debug_mask``, dropout in ``_flash_attention_forward_no_dropout_inplace`` (which
returns no rng state), ``alibi_slopes`` / ``seqused_k`` / ``block_table`` / ``num_splits``
on the low-level operator, and SDPA's ``is_causal`` with different query and key lengths
(SDPA aligns that mask to the top-left corner, flashop to the bottom-right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from flashop._launch.scores import LOG2E
from flashop._ops.attention import dropout_seed
from flashop._ops.checks import unbounded_if_negative

IMPL_NAME = "flashop"

# the aten operators overridden, each with its flashop implementation below
_OVERRIDES = ("_flash_attention_forward", "_flash_attention_forward_no_dropout_inplace",
              "_flash_attention_backward", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_backward")


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"flashop's SDPA implementation ({op}): {what} is not supported; call "
        f"torch.nn.attention.restore_flash_attention_impl() to use PyTorch's kernels for it")


def _check_forward(op, return_debug_mask=False, **extra) -> None:
    if return_debug_mask:
        raise _unsupported(op, "return_debug_mask=True")
    for name, value in extra.items():
        if value is not None and not (name == "num_splits" and value <= 1):
            raise _unsupported(op, name)


def _packing(cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int,
             max_k: int) -> tuple:
    """The operators' packing arguments: none for a dense batch (``cum_seq_q`` None)."""
    return (None,) * 4 if cum_seq_q is None else (cum_seq_q, cum_seq_k, max_q, max_k)


def _options(is_causal: bool, scale: Optional[float], window: tuple[int, int],
             dropout_p: float) -> dict:
    return dict(causal=is_causal, scale=scale, window_size_left=window[0],
                window_size_right=window[1], dropout_p=dropout_p)


def flash_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                  cum_seq_k: Optional[Tensor], max_q: int, max_k: int, is_causal: bool,
                  scale: Optional[float], window: tuple[int, int], dropout_p: float = 0.0,
                  seed: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """flashop's forward in flash-attn's layouts: dense (B, S, H, D) with lse (B, H, S_q),
    or packed (total, H, D) with lse (H, total_q), dropout from ``seed`` (int64, one element)
    where ``dropout_p > 0``; returns (out, lse)."""
    if cum_seq_q is not None and cum_seq_k is None:
        raise _unsupported("_flash_attention_forward", "cum_seq_k=None")
    out, lse, _ = torch.ops.flashop.attention_forward(
        query, key, value, *_packing(cum_seq_q, cum_seq_k, max_q, max_k), dropout_seed=seed,
        **_options(is_causal, scale, window, dropout_p))
    return out, lse


def flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                   logsumexp: Tensor, cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor],
                   max_q: int, max_k: int, is_causal: bool, scale: Optional[float],
                   window: tuple[int, int], dropout_p: float = 0.0,
                   seed: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """flashop's backward for :func:`flash_forward`'s results (the forward's ``seed``
    where ``dropout_p > 0``); (dq, dk, dv)."""
    lse_log2 = logsumexp * LOG2E  # aten keeps the natural-log lse; flashop's kernels use base 2
    dlse = torch.zeros_like(logsumexp)
    if cum_seq_q is not None and cum_seq_q.numel() == 0:  # aten's dense backward passes these
        cum_seq_q = None
    dq, dk, dv, _, _ = torch.ops.flashop.attention_backward(
        grad_out, dlse, query, key, value, out, lse_log2,
        *_packing(cum_seq_q, cum_seq_k, max_q, max_k), dropout_seed=seed,
        **_options(is_causal, scale, window, dropout_p))
    return dq, dk, dv


def _aux(query: Tensor, seed: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """rng_state (aten's (2,) uint64: flashop's seed in element 0; zeros without dropout),
    the unused philox offset and the empty debug mask."""
    if seed is None:
        rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    else:
        rng_state = torch.nn.functional.pad(seed, (0, 1)).view(torch.uint64)
    return (rng_state, torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _seed_of(op: str, rng_state: Optional[Tensor], dropout_p: float) -> Optional[Tensor]:
    """The backward's dropout seed: element 0 of the rng_state :func:`_aux` returned."""
    if dropout_p == 0.0:
        return None
    if (rng_state is None or rng_state.dtype != torch.uint64
            or tuple(rng_state.shape) != (2,)):
        got = None if rng_state is None else f"{rng_state.dtype} {tuple(rng_state.shape)}"
        raise RuntimeError(
            f"flashop's SDPA implementation ({op}): dropout_p={dropout_p} needs the rng_state "
            f"its forward returned, a (2,) uint64 tensor holding flashop's seed, got {got}; "
            f"run the forward and the backward with the same implementation active")
    return rng_state.view(torch.int64)[:1]


# --- the aten overrides ---------------------------------------------------------------------


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                            is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                            window_size_right=None, seqused_k=None, alibi_slopes=None,
                            block_table=None, num_splits=None):
    """``aten::_flash_attention_forward``: (output, softmax_logsumexp, rng_state, unused,
    debug_attn_mask)."""
    _check_forward("_flash_attention_forward", return_debug_mask, seqused_k=seqused_k,
                   alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits)
    seed = dropout_seed(query, dropout_p)
    window = unbounded_if_negative(window_size_left, window_size_right)
    out, lse = flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                             scale, window, dropout_p, seed)
    return (out, lse, *_aux(query, seed))


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k,
                                               max_q, max_k, dropout_p, is_causal,
                                               return_debug_mask, *, scale=None,
                                               window_size_left=None, window_size_right=None,
                                               seqused_k=None, alibi_slopes=None,
                                               block_table=None, num_splits=None):
    """``aten::_flash_attention_forward_no_dropout_inplace``: writes ``out``, returns lse."""
    op = "_flash_attention_forward_no_dropout_inplace"
    if dropout_p != 0.0:
        raise _unsupported(op, f"dropout_p={dropout_p} (this variant returns no rng state)")
    _check_forward(op, return_debug_mask, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                   block_table=block_table, num_splits=num_splits)
    window = unbounded_if_negative(window_size_left, window_size_right)
    result, lse = flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                is_causal, scale, window)
    out.copy_(result)
    return lse


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                             max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                             scale=None, window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward``: (dq, dk, dv)."""
    seed = _seed_of("_flash_attention_backward", rng_state, dropout_p)
    window = unbounded_if_negative(window_size_left, window_size_right)
    return flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                          max_q, max_k, is_causal, scale, window, dropout_p, seed)


def _check_sdpa_causal(op: str, query: Tensor, key: Tensor, is_causal: bool) -> None:
    if is_causal and query.shape[2] != key.shape[2]:
        raise _unsupported(op, f"is_causal=True with {query.shape[2]} queries and "
                               f"{key.shape[2]} keys (SDPA's top-left causal mask)")


def scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False,
                                       return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on (B, H, S, D) inputs: (output,
    logsumexp (B, H, S_q), cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
    debug_attn_mask); the output is a (B, H, S_q, D) view of flashop's (B, S_q, H, D)."""
    op = "_scaled_dot_product_flash_attention"
    _check_forward(op, return_debug_mask)
    _check_sdpa_causal(op, query, key, is_causal)
    seed = dropout_seed(query, dropout_p)
    out, lse = flash_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                             None, None, query.shape[2], key.shape[2], is_causal, scale,
                             (-1, -1), dropout_p, seed)
    return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2],
            *_aux(query, seed))


def scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp,
                                                cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                                is_causal, philox_seed, philox_offset, *,
                                                scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv) as (B, H, S, D)."""
    op = "_scaled_dot_product_flash_attention_backward"
    _check_sdpa_causal(op, query, key, is_causal)
    seed = _seed_of(op, philox_seed, dropout_p)
    grads = flash_backward(*(t.transpose(1, 2) for t in (grad_out, query, key, value, out)),
                           logsumexp, None, None, max_q, max_k, is_causal, scale, (-1, -1),
                           dropout_p, seed)
    return tuple(g.transpose(1, 2) for g in grads)


_IMPLS = {
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_no_dropout_inplace,
    "_flash_attention_backward": flash_attention_backward,
    "_scaled_dot_product_flash_attention": scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_backward": scaled_dot_product_flash_attention_backward,
}


@dataclass
class _Handle:
    """Keeps the aten overrides registered; ``remove`` (torch's restore) drops them."""

    library: Optional[torch.library.Library]

    def remove(self) -> None:
        self.library = None


def _activate() -> _Handle:
    """The registry's register_fn: override the aten operators this torch has (CUDA key)."""
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for name in _OVERRIDES:
        if hasattr(torch.ops.aten, name):
            library.impl(name, _IMPLS[name], "CUDA")
    return _Handle(library)


def register() -> bool:
    """Register ``"flashop"`` with torch's flash-attention registry (not activated); False
    on torches without the registry."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(IMPL_NAME, register_fn=_activate)
    return True


REGISTERED = register()
