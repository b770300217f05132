"""Prefill over a paged key/value cache with prefix reuse, as nano-vllm does it, with
flashop's ``flash_attn_varlen_func(..., block_table=...)``.

A toy 2-layer attention model (random projections, RMSNorm, rotary embeddings, grouped-query
attention) keeps each layer's keys and values in pages of 16 tokens. A block manager hands
pages out from a free list (in shuffled order: the table, not the page's place, finds a
token) and keeps the hash of every full page (of its tokens and the pages before it), so a
request whose prompt starts with cached pages reuses them, as nano-vllm's BlockManager does.

1. Request A prefills its whole prompt (61 tokens): it writes 4 pages per layer.
2. Request B's prompt is A's first 48 tokens and 20 of its own: its block table starts with
   A's first 3 pages (found by their hashes), then fresh ones. One batch then prefills A's
   continuation (7 more tokens) and B: queries, keys and values only for the new tokens,
   their keys and values written into the pages (``slot_mapping``), and one call
   ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
   max_seqlen_k, causal=True, block_table=block_table)`` per layer.

Checked: B's (and A's continuation's) outputs against the whole prompt run without a cache,
by flashop's accuracy rule (error to a float64 run at most 2x that of plain PyTorch in
``--dtype`` with the same weights, plus two units of rounding); A's keys and values in its
pages bit for bit unchanged by the second batch. Unwritten cache slots hold NaN, so a read of
one shows. Exits 1 if a check fails.

    python examples/prefix_prefill.py                          # GPU where there is one
    python examples/prefix_prefill.py --device cpu             # Triton's CPU interpreter
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

PAGE = 16  # tokens per page
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 128, 64, 4, 2, 16, 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    return p.parse_args(argv)


def import_flashop(device: str):
    """flashop; on the CPU its kernels run in Triton's interpreter, which Triton reads when
    they are defined (at import)."""
    if torch.device(device).type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import flashop.flash_attn
    except ImportError:  # not installed: the checkout this script lives in
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import flashop.flash_attn
    return flashop


# --- the model ------------------------------------------------------------------------------


class ToyModel:
    """Embedding, then per layer x += W_o attention(RoPE(W_q n(x)), RoPE(W_k n(x)), W_v n(x))
    with n the RMS norm; the weights random (std 1.5 / sqrt(fan-in): scores of a few units)."""

    def __init__(self, weights: dict):
        self.weights = weights

    @classmethod
    def random(cls, device, seed: int = 0) -> "ToyModel":
        gen = torch.Generator().manual_seed(seed)

        def w(fan_in, fan_out):
            return (torch.randn(fan_in, fan_out, generator=gen) * 1.5 / fan_in ** 0.5).to(device)
        weights = {"embed": torch.randn(VOCAB, HIDDEN, generator=gen).to(device)}
        for i in range(LAYERS):
            weights.update({f"{i}.q": w(HIDDEN, HEADS * HEAD_DIM),
                            f"{i}.k": w(HIDDEN, KV_HEADS * HEAD_DIM),
                            f"{i}.v": w(HIDDEN, KV_HEADS * HEAD_DIM),
                            f"{i}.o": w(HEADS * HEAD_DIM, HIDDEN)})
        return cls(weights)

    def to(self, dtype) -> "ToyModel":
        return ToyModel({name: w.to(dtype) for name, w in self.weights.items()})

    def embed(self, tokens):
        return self.weights["embed"][tokens]

    def qkv(self, i: int, x, positions):
        """(n, H, D) queries, (n, H_kv, D) keys and values of n tokens at ``positions``."""
        w = self.weights
        h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        q = (h @ w[f"{i}.q"]).view(-1, HEADS, HEAD_DIM)
        k = (h @ w[f"{i}.k"]).view(-1, KV_HEADS, HEAD_DIM)
        v = (h @ w[f"{i}.v"]).view(-1, KV_HEADS, HEAD_DIM)
        return rope(q, positions), rope(k, positions), v

    def out(self, i: int, x, attention):
        return x + attention.flatten(1) @ self.weights[f"{i}.o"]


def rope(x, positions):
    """Rotary embedding (rotate-half, theta 10000) at absolute positions: a cached key keeps
    its position whichever request reads it."""
    half = HEAD_DIM // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angle = positions.to(torch.float64)[:, None] * freq  # (n, half)
    cos, sin = angle.cos().to(x.dtype)[:, None], angle.sin().to(x.dtype)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


def forward_dense(flashop, model: ToyModel, tokens, compute_dtype):
    """The whole prompt without a cache (flashop.attention_reference: causal attention in
    ``compute_dtype``, None for the weights' dtype as plain PyTorch computes)."""
    x = model.embed(tokens)
    positions = torch.arange(len(tokens), device=tokens.device)
    for i in range(LAYERS):
        q, k, v = model.qkv(i, x, positions)
        o, _ = flashop.attention_reference(q[None], k[None], v[None], causal=True,
                                           compute_dtype=compute_dtype)
        x = model.out(i, x, o[0].to(x.dtype))
    return x


# --- the paged cache ------------------------------------------------------------------------


@dataclass
class Sequence:
    tokens: list
    block_table: list = field(default_factory=list)
    num_cached: int = 0  # tokens whose keys and values are in the pages

    @property
    def num_pages(self) -> int:
        return -(-len(self.tokens) // PAGE)


@dataclass
class Page:
    id: int
    ref_count: int = 0
    hash: int = -1
    tokens: tuple = ()


class BlockManager:
    """nano-vllm's BlockManager in brief: pages from a free list, reference counts, and a
    hash per full page (chained with the previous pages') for prefix reuse."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.pages = [Page(i) for i in range(num_pages)]
        order = list(range(num_pages))
        random.Random(seed).shuffle(order)
        self.free = deque(order)
        self.by_hash: dict[int, int] = {}

    def _take(self) -> Page:
        if not self.free:
            raise RuntimeError("out of pages")
        page = self.pages[self.free.popleft()]
        page.ref_count, page.hash, page.tokens = 1, -1, ()
        return page

    def _seal(self, seq: Sequence, index: int, prefix_hash: int) -> int:
        """Record page ``index`` of ``seq`` (full) under the hash of its tokens and prefix."""
        tokens = tuple(seq.tokens[index * PAGE:(index + 1) * PAGE])
        h = hash((prefix_hash, tokens))
        page = self.pages[seq.block_table[index]]
        page.hash, page.tokens = h, tokens
        self.by_hash[h] = page.id
        return h

    def allocate(self, seq: Sequence) -> None:
        """The prompt's pages: cached full pages while they match (the last token is always
        computed, so a prompt of cached pages still has a query), fresh ones after."""
        h, hit = -1, True
        for index in range(seq.num_pages):
            tokens = tuple(seq.tokens[index * PAGE:(index + 1) * PAGE])
            full = len(tokens) == PAGE and (index + 1) * PAGE < len(seq.tokens)
            candidate = self.by_hash.get(hash((h, tokens)), -1) if full else -1
            hit = hit and candidate != -1 and self.pages[candidate].tokens == tokens
            if hit:
                self.pages[candidate].ref_count += 1
                seq.block_table.append(candidate)
                seq.num_cached += PAGE
            else:
                seq.block_table.append(self._take().id)
            if len(tokens) == PAGE:
                h = self._seal(seq, index, h)

    def append(self, seq: Sequence, new_tokens: list) -> None:
        """More tokens for a sequence: pages for them, hashes for the pages they fill."""
        first_new_page = len(seq.tokens) // PAGE
        seq.tokens = seq.tokens + list(new_tokens)
        while len(seq.block_table) < seq.num_pages:
            seq.block_table.append(self._take().id)
        h = -1 if first_new_page == 0 else self.pages[seq.block_table[first_new_page - 1]].hash
        for index in range(first_new_page, len(seq.tokens) // PAGE):
            h = self._seal(seq, index, h)


def prefill(flashop, model: ToyModel, caches, seqs: list, device):
    """One batched prefill of each sequence's uncached tokens; returns their outputs
    (packed) and marks them cached."""
    new = [torch.arange(s.num_cached, len(s.tokens)) for s in seqs]
    positions = torch.cat(new).to(device)
    tokens = torch.tensor([s.tokens[p] for s, n in zip(seqs, new) for p in n.tolist()],
                          device=device)
    tables = [torch.tensor(s.block_table) for s in seqs]
    # where each new token's key and value go: row p % PAGE of page table[p // PAGE]
    slots = torch.cat([t[n // PAGE] * PAGE + n % PAGE for t, n in zip(tables, new)]).to(device)
    width = max(len(t) for t in tables)
    block_table = torch.stack([torch.nn.functional.pad(t, (0, width - len(t)), value=-1)
                               for t in tables]).to(device=device, dtype=torch.int32)
    lens_q = [len(n) for n in new]
    lens_k = [len(s.tokens) for s in seqs]
    cu_q = torch.tensor([0, *lens_q], device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=device).cumsum(0).to(torch.int32)
    x = model.embed(tokens)
    for i, (k_cache, v_cache) in enumerate(caches):
        q, k, v = model.qkv(i, x, positions)
        k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = v
        o = flashop.flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
            block_table=block_table)
        x = model.out(i, x, o)
    for s in seqs:
        s.num_cached = len(s.tokens)
    return x.split(lens_q)


def cached_kv(caches, seq: Sequence, n: int) -> list:
    """The keys and values of ``seq``'s first ``n`` tokens, read from its pages (copies)."""
    table = torch.tensor(seq.block_table, device=caches[0][0].device)
    return [c[table].flatten(0, 1)[:n].clone() for layer in caches for c in layer]


# --- the demo -------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    flashop = import_flashop(args.device)
    from flashop.testing import accuracy

    dtype, device = DTYPES[args.dtype], args.device
    on_cuda = torch.device(device).type == "cuda"
    model = ToyModel.random(device)
    manager = BlockManager(num_pages=12)
    caches = [tuple(torch.full((len(manager.pages), PAGE, KV_HEADS, HEAD_DIM), float("nan"),
                               device=device, dtype=dtype) for _ in range(2))
              for _ in range(LAYERS)]
    gen = random.Random(1)
    prompt_a = [gen.randrange(VOCAB) for _ in range(61)]
    shared = 48
    a = Sequence(prompt_a)
    manager.allocate(a)
    prefill(flashop, model.to(dtype), caches, [a], device)
    written_by_a = cached_kv(caches, a, len(prompt_a))

    b = Sequence(prompt_a[:shared] + [gen.randrange(VOCAB) for _ in range(20)])
    manager.allocate(b)
    shared_pages = [p for p in b.block_table if p in a.block_table]
    manager.append(a, [gen.randrange(VOCAB) for _ in range(7)])
    out_a, out_b = prefill(flashop, model.to(dtype), caches, [a, b], device)

    print(f"toy model: {LAYERS} layers, {HEADS} heads ({KV_HEADS} KV heads) of {HEAD_DIM}, "
          f"{args.dtype}, pages of {PAGE}, on "
          f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}")
    print(f"A: {len(prompt_a)} prompt tokens prefilled, then {len(out_a)} more; "
          f"pages {a.block_table}")
    print(f"B: {len(b.tokens)} tokens, {b.num_cached - len(out_b)} cached, {len(out_b)} "
          f"computed; pages {b.block_table}; {len(shared_pages)} pages shared with A")
    ok = b.num_cached - len(out_b) == shared == len(shared_pages) * PAGE
    results = []
    for name, seq, out in (("B", b, out_b), ("A's continuation", a, out_a)):
        tokens = torch.tensor(seq.tokens, device=device)
        ref = forward_dense(flashop, model.to(torch.float64), tokens, torch.float64)
        plain = forward_dense(flashop, model.to(dtype), tokens, None)
        r = accuracy(name, out, ref[-len(out):], plain[-len(out):], 2, dtype)
        results.append(r)
        print(f"  {'ok  ' if r.ok else 'FAIL'} {name} against its whole prompt without a "
              f"cache: max error {r.error:.2e}, bound {r.bound:.2e} (plain PyTorch "
              f"{r.plain_error:.2e})")
    unchanged = all(torch.equal(before, after) for before, after
                    in zip(written_by_a, cached_kv(caches, a, len(prompt_a))))
    print(f"  {'ok  ' if unchanged else 'FAIL'} A's keys and values in its pages unchanged "
          f"by the second batch (bit for bit)")
    ok = ok and unchanged and all(r.ok for r in results)
    print(f"check: paged prefill with {len(shared_pages)} shared pages "
          f"{'matches' if ok else 'does NOT match'} the prompt run without a cache")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
