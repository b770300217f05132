"""flashop as an attention implementation of Hugging Face transformers (5.x).

Importing this module registers flashop with transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the mask function) under the name
:data:`ATTN_IMPLEMENTATION`::

    import flashop.transformers
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation=flashop.transformers.ATTN_IMPLEMENTATION)
    # or model.set_attn_implementation(flashop.transformers.ATTN_IMPLEMENTATION)

The name is ``"FlashOp"``: transformers sends every implementation whose name contains
``"flash"`` (lower case) to its flash-attention kernel loader, which cannot load flashop.

How each attention call runs (queries and keys arrive as (batch, heads, seq, head_dim) and
are read through transposed views, GQA without repeating K/V):

- no padding: ``flashop.attention`` with ``causal``, ``window_size=(sliding_window - 1, 0)``
  (transformers' window keeps keys ``q - sliding_window < k <= q``), ``softcap``, ``scaling``;
- a padded batch (the mask function passes the 2-D padding mask through): the real tokens
  are packed and run by ``flashop.attention_varlen`` (no work on padding); packing reads the
  token positions on the host, as flash-attn's path does;
- packed sequences (``DataCollatorWithFlattening``): with ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` (``return_flash_attn_kwargs=True``) one ``attention_varlen`` call
  without host synchronization; with only ``position_ids`` the boundaries are found on the
  host;
- one query per sequence (decoding; :func:`decode_attention`), no host synchronization, so
  static caches decode under ``torch.compile``: where each row's valid keys are the first
  ones of its cache (no left padding: dynamic caches, static caches whose unwritten slots
  follow the written ones, sliding windows whose padding has left the window),
  ``flashop.attention_with_kvcache`` over the cache as transformers wrote it (no append),
  with ``cache_seqlens`` the valid keys per row (and the model's attention sinks); a
  left-padded batch or a step with dropout: ``flashop.attention`` with a boolean key mask;
- a 4-D mask given by the caller: ``flashop.attention`` with that mask.

Attention sinks (gpt-oss's ``s_aux``, one logit per query head joining the softmax's
denominator) are flashop's ``sinks``, on every path. Attention dropout runs flashop's
dropout with the model's ``dropout`` in training (``module.training``) and none in
evaluation, as transformers' eager attention does.

Chunked attention (Llama 4's ``"chunked_attention"`` layers, ``config.attention_chunk_size``):
transformers passes such layers a mask and no keyword; the attention function reads the
chunk from the layer's type (``config.layer_types[module.layer_idx]``) and runs every path
above with ``attention_chunk``, chunks counted from each sequence's first real token, as
transformers' chunked mask counts them. A chunked layer's cache keeps only the last
``chunk - 1`` tokens, so its first key is in general not at a chunk's start: the mask
function (which transformers gives the chunk as ``local_size``, and the keys' position
``kv_offset``) then also masks the keys before the first chunk start, which no query
attends, so that the keys left start a chunk.

Not supported, raising an error that names them: masks combined with extra mask functions
(e.g. bidirectional image-token overlays).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import flashop

ATTN_IMPLEMENTATION = "FlashOp"

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "attention_mask", "decode_attention"]


# --- the mask function ----------------------------------------------------------------------


def _mask_chunk(config, local_size) -> int:
    """The chunk of a chunked layer's mask (create_chunked_causal_mask gives it as
    ``local_size``; sliding-window masks give their window there), 0 for other masks."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or ()
    if not chunk or local_size != chunk or "chunked_attention" not in types:
        return 0
    if "sliding_attention" in types and getattr(config, "sliding_window", None) == chunk:
        raise NotImplementedError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r}: this model's sliding window and "
            f"attention chunk are both {chunk}, so flashop cannot tell their masks apart; use "
            f"attn_implementation='sdpa' for it")
    return int(chunk)


def _chunk_starts(chunk: int, kv_length: int, kv_offset: int,
                  attention_mask: Optional[Tensor], device) -> Tensor:
    """(batch or 1, kv_length) bool: the key slots from the first that starts a chunk (slot
    j holds position kv_offset + j, counted from the row's first real token as transformers'
    chunked mask counts it); the slots before it are attended by no query."""
    if attention_mask is not None:
        device = attention_mask.device
    slots = torch.arange(kv_length, device=device)
    if attention_mask is None:
        return (slots >= (-kv_offset) % chunk)[None]
    padding = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True)  # leading zeros
    first = torch.where(padding >= kv_offset, padding - kv_offset,
                        torch.remainder(padding - kv_offset, chunk))
    return slots >= first


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask: Optional[Tensor] = None,
                   use_vmap: bool = False, device=None, local_size=None, config=None,
                   **kwargs) -> Optional[Tensor]:
    """transformers' mask function for flashop: None, a (batch, L) boolean key mask, or for a
    one-query step whose valid keys are each row's first ones, (batch,) int32 key counts.

    Key slot ``j < L`` of the keys the attention receives is attended iff ``mask[b, j]``;
    slots from ``L`` on (a static cache's unwritten, zero-filled slots) never are; the
    queries are the last ``q_length`` slots before ``L``. Counts ``n``: row b attends its
    first ``n[b]`` slots, its query at slot ``n[b] - 1``. None: every key is attended (the
    keys end with the queries). Causality and windows are not in the mask: the attention
    applies them. Reads nothing on the host except, outside torch.compile, whether a given
    padding mask is all ones (to drop it, as transformers' flash-attention mask does) or,
    for a one-query step, holds no left padding (generate() builds a static cache's masks
    outside its compiled forward, so compiled decoding gets counts too), and a static cache's
    length for a multi-token step without a padding mask.

    A chunked layer's keys that start past position 0 (``kv_offset``, its cache full) get a
    boolean mask without the keys before their first chunk start (_chunk_starts).
    """
    if use_vmap:
        # set by transformers when a model adds mask functions of its own (or_/and_mask_function)
        raise NotImplementedError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r}: this model combines the causal mask "
            f"with extra mask functions (e.g. bidirectional image tokens), which flashop cannot "
            f"represent; use attn_implementation='sdpa' for it")
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask  # counts made by this function, passed back in by the model
    chunk = _mask_chunk(config, local_size)
    if chunk and kv_offset and (attention_mask is not None or kv_offset % chunk):
        starts = _chunk_starts(chunk, kv_length, kv_offset, attention_mask, device)
        if attention_mask is not None:
            return attention_mask[:, -kv_length:].bool() & starts
        valid = q_offset + q_length - kv_offset  # keys written so far (a static cache's)
        return (starts & (torch.arange(kv_length, device=device) < valid)).expand(
            batch_size, kv_length)
    if attention_mask is not None:
        mask = attention_mask[:, -kv_length:].bool()
        if torch.compiler.is_compiling() or (q_length != 1 and mask.shape[1] != kv_length):
            return mask
        # one host read: is the mask all ones / is every row ones then zeros (no left padding)
        all_ones, prefix = torch.stack((mask.all(), (mask[:, 1:] <= mask[:, :-1]).all())).tolist()
        if all_ones and mask.shape[1] == kv_length:
            return None
        if q_length == 1 and prefix:
            return mask.sum(1, dtype=torch.int32)
        return mask
    valid = q_offset + q_length - kv_offset  # keys written so far, the queries' included
    if isinstance(valid, int):
        if valid == kv_length:
            return None
        if q_length == 1:
            return torch.full((batch_size,), valid, dtype=torch.int32, device=device)
        return torch.ones(batch_size, valid, dtype=torch.bool, device=device)
    # a static cache's length is a tensor: decoding counts its written slots without reading
    # it; a longer step reads it on the host (prefill runs outside torch.compile)
    if q_length == 1:
        return valid.to(device=device, dtype=torch.int32).reshape(1).repeat(batch_size)
    return torch.ones(batch_size, int(valid), dtype=torch.bool, device=device)


def _key_mask(counts: Tensor, S_k: int) -> Tensor:
    """(batch,) key counts as the (batch, S_k) boolean key mask they stand for."""
    return torch.arange(S_k, device=counts.device) < counts[:, None]


# --- the attention function -----------------------------------------------------------------


def _dropout_p(module: torch.nn.Module, dropout: float) -> float:
    """The attention dropout of a call: the model's ``dropout`` in training, 0 in evaluation
    (transformers' eager attention drops with ``training=module.training``)."""
    return float(dropout) if module.training else 0.0


def _window_size(sliding_window: Optional[int]) -> tuple[int, int]:
    """flashop's window of transformers' ``sliding_window`` (keys ``q - sliding_window < k
    <= q``), with causal attention."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _attention_chunk(module: torch.nn.Module) -> int:
    """The attention chunk of a chunked layer (``"chunked_attention"`` in
    ``config.layer_types`` at the module's ``layer_idx``: ``config.attention_chunk_size``),
    0 for every other layer."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types is None or index is None or index >= len(types):
        return 0
    if types[index] != "chunked_attention":
        return 0
    return int(getattr(config, "attention_chunk_size", None) or 0)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], *,
                     scale: Optional[float], window: Optional[int], softcap: float,
                     sinks: Optional[Tensor] = None, dropout_p: float = 0.0,
                     chunk: int = 0) -> Tensor:
    """One query per sequence (a decoding step) against the cached keys: q (B, 1, H, D),
    k/v (B, S_k, H_kv, D) (transposed views of transformers' (B, H_kv, S, D) caches),
    ``key_mask`` as :func:`attention_mask` returns it: None (all S_k keys), (B,) int32
    counts (row b's first ``key_mask[b]`` keys), or a (B, L <= S_k) boolean mask. Reads
    nothing on the host.

    None and counts run ``flashop.attention_with_kvcache`` with ``cache_seqlens`` the counts
    (S_k for None) and no k/v to append: transformers has already written the new token's
    key and value into its cache (the static cache in place, the dynamic cache by
    concatenation), and the views' strides are passed as they are. For the dynamic cache this
    beats ``flashop.attention``, though its keys are exactly the valid ones: with one query
    per sequence, ``flashop.attention`` has one program per (sequence, KV head) walk all the
    keys, while the split-KV decoding kernel spreads them over the GPU; both read each key
    once; ``sinks`` ((H,)) go with either. A boolean mask (left padding, which the decoding
    kernel cannot skip) runs ``flashop.attention`` with the mask, as does anything needing a
    gradient or ``dropout_p > 0``. ``chunk``: the layer's attention chunk, counted from the
    first attended slot (the first key, or a boolean mask's first True).
    """
    window_size = _window_size(window)
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    options = dict(scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p)
    if key_mask is None or key_mask.dim() == 1:
        if not needs_grad and dropout_p == 0.0 and k.stride(-1) == 1 and v.stride(-1) == 1:
            counts = k.shape[1] if key_mask is None else key_mask
            return flashop.attention_with_kvcache(q, k, v, cache_seqlens=counts, causal=True,
                                                  scale=scale, window_size=window_size,
                                                  attention_chunk=chunk, softcap=softcap,
                                                  sinks=sinks)
        if key_mask is None:
            return flashop.attention(q, k, v, causal=True, window_size=window_size,
                                     attention_chunk=chunk, **options)
        key_mask = _key_mask(key_mask, k.shape[1])
    L = key_mask.shape[1]
    k, v = k[:, :L], v[:, :L]
    keep = key_mask
    slots = torch.arange(L, device=key_mask.device)
    # the query sits at its sequence's last attended slot
    last = torch.where(key_mask, slots, -1).amax(dim=1, keepdim=True)
    if window is not None:
        keep = keep & (slots > last - window)
    if chunk:
        first = torch.where(key_mask, slots, L).amin(dim=1, keepdim=True)
        keep = keep & (torch.div(slots - first, chunk, rounding_mode="floor")
                       == torch.div(last - first, chunk, rounding_mode="floor"))
    return flashop.attention(q, k, v, keep[:, None, None, :], **options)


def _padded_attention(q, k, v, key_mask, **options):
    """A padded batch as a packed one: the real queries and keys gathered, one
    attention_varlen call, the outputs scattered back (zeros at padded queries)."""
    B, S_q, H, _ = q.shape
    L = key_mask.shape[1]
    q_mask = key_mask[:, L - S_q:]
    k, v = k[:, :L], v[:, :L]
    # the positions of the real tokens: the one host synchronization (as in flash-attn)
    q_idx = q_mask.flatten().nonzero().flatten()
    k_idx = key_mask.flatten().nonzero().flatten()
    cu_q = torch.nn.functional.pad(q_mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                                   (1, 0))
    cu_k = torch.nn.functional.pad(
        key_mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    out = flashop.attention_varlen(
        q.flatten(0, 1).index_select(0, q_idx), k.flatten(0, 1).index_select(0, k_idx),
        v.flatten(0, 1).index_select(0, k_idx), cu_q, cu_k, S_q, L, **options)
    return flashop.pad_input(out, q_idx, B, S_q)


def _sequence_starts(position_ids: Tensor) -> Optional[tuple[Tensor, int]]:
    """(cu_seqlens, longest length) of a batch of one packed row, from where its positions
    restart; None if the row holds one sequence. Reads the boundaries on the host."""
    pos = position_ids.reshape(-1)
    restart = torch.ones_like(pos, dtype=torch.bool)
    restart[1:] = pos[1:] != pos[:-1] + 1
    starts = restart.nonzero().flatten()
    if starts.numel() <= 1:
        return None
    total = torch.tensor([pos.numel()], device=pos.device)
    cu = torch.cat((starts, total)).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    B, S_q = q.shape[:2]
    if isinstance(max_q, Tensor):
        max_q = int(max_q)
    if isinstance(max_k, Tensor):
        max_k = int(max_k)
    out = flashop.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                   cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                   **options)
    return out.view(B, S_q, *out.shape[1:])


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                      s_aux: Optional[Tensor] = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention function for flashop: query (B, H, S_q, D), key and value
    (B, H_kv, S_k, D), ``attention_mask`` as :func:`attention_mask` returns it (or a 4-D
    mask; ``s_aux``: (H,) attention sinks). Returns ((B, S_q, H, D) output, None)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    softcap = float(softcap or 0.0)
    common = dict(scale=scaling, softcap=softcap, sinks=s_aux,
                  dropout_p=_dropout_p(module, dropout))
    if attention_mask is not None and attention_mask.dim() == 4:
        # a mask built by the caller holds causality, windows and chunks itself
        return flashop.attention(q, k, v, attention_mask, **common), None
    window = sliding_window if causal else None
    chunk = _attention_chunk(module)
    options = dict(causal=causal, window_size=_window_size(window), attention_chunk=chunk,
                   **common)
    if q.shape[1] == 1 and causal:
        return decode_attention(q, k, v, attention_mask, window=window, chunk=chunk,
                                **common), None
    if attention_mask is not None and attention_mask.dim() == 1:
        attention_mask = _key_mask(attention_mask, k.shape[1])
    if attention_mask is not None:
        return _padded_attention(q, k, v, attention_mask, **options), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        return _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, **options), None
    position_ids = kwargs.get("position_ids")
    if (position_ids is not None and q.shape[0] == 1 and q.shape[1] == k.shape[1] > 1
            and position_ids.numel() == q.shape[1]):
        packing = _sequence_starts(position_ids)
        if packing is not None:
            cu, longest = packing
            return _packed_attention(q, k, v, cu, cu, longest, longest, **options), None
    return flashop.attention(q, k, v, **options), None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)
