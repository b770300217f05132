"""Training throughput of a Llama-style decoder with each attention provider: tokens/s,
ms per step and peak memory of whole training steps (forward, loss, backward, AdamW).

The model: RMSNorm, rotary embeddings (rotate-half, theta 10000), grouped-query attention,
SwiGLU MLP (hidden size 8/3 x dim rounded up to 256: 5632 at 2048) and an untied LM head,
as Llama 2 and TinyLlama (whose 2048-wide, 4-KV-head shape the default is, with 8 layers).
Weights and AdamW's states in the chosen dtype (bf16 on a GPU, no fp32 master copy), AdamW
fused on CUDA; initial weights from a fixed seed, so every configuration starts from the
same model. Random tokens, one batch of a fixed seed trained on at every step.

Layouts: ``one``, one document per sequence (causal over all of it); ``packed``, documents of
random lengths (``--docs LO HI`` of them per sequence, fixed seed), each attending causally
within itself, rotary positions restarting at each, the token after a document's last not
its target. Providers:
- ``flashop``: ``flashop.attention``; packed, ``flashop.attention_varlen`` over
  ``cu_seqlens`` of all the batch's documents;
- ``sdpa``, ``sdpa-cudnn``, ``sdpa-flash``: ``F.scaled_dot_product_attention`` with its own
  choice of backend, or one forced with ``sdpa_kernel``; ``enable_gqa`` and ``is_causal``
  for one document per sequence; packed, no variable-length path: a boolean
  block-diagonal causal ``attn_mask`` over keys and values repeated to every query head (as
  transformers does with a mask). A backend that refuses gives a row "n/a" with its reason;
- ``flex``: FlexAttention (compiled), a causal block mask, or a document-causal one built
  with ``create_block_mask``.
The per-batch arguments (``cu_seqlens``, the boolean mask, the block mask) are built once
per configuration, before the timed steps.

Modes: ``eager``, and ``compiled`` (``torch.compile(model, fullgraph=True)``: forward, loss
and their backward; the optimizer step stays eager). Each row: the median of ``--steps`` timed steps after
``--warmup`` (the first compiles), tokens/s, peak memory (``max_memory_allocated`` less what
was allocated when the configuration began: leftovers of earlier ones not counted), the
ratio to the fastest SDPA provider of the same (mode, seq, layout), and the first step's
loss, which every provider should give alike (same weights, same batch).

    python benchmarks/train_model.py --seq 4096 --layouts one packed \\
        --modes eager compiled --providers flashop sdpa           # GPU, 2 minutes on an H200
    python benchmarks/train_model.py --tiny --device cpu          # CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import error_line, import_flashop, write_csv  # noqa: E402
from progress import progress  # noqa: E402

PROVIDERS = ["flashop", "sdpa", "sdpa-cudnn", "sdpa-flash", "flex"]
SDPA_BACKENDS = {"sdpa": None, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa-flash": SDPBackend.FLASH_ATTENTION}
LAYOUTS = ["one", "packed"]
MODES = ["eager", "compiled"]
CSV_HEADER = ["gpu", "torch", "triton", "dtype", "layers", "dim", "heads", "kv_heads", "batch",
              "mode", "seq", "layout", "provider", "tokens_per_s", "ms", "peak_gib", "held_gib",
              "vs_best_sdpa", "first_step_s", "loss", "note"]
IGNORE = -100  # cross_entropy's ignore_index: the target after a document's last token


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def ffn(self) -> int:
        return 256 * math.ceil(8 * self.dim / 3 / 256)


TINY = dict(model=ModelConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2), seq=[64],
            docs=(2, 2), warmup=1, steps=2)
FULL = dict(model=ModelConfig(), seq=[4096, 8192], docs=(4, 8), warmup=3, steps=5)


# --- the model ----------------------------------------------------------------------------

def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in fp64 where it is (a float64 reference model stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x (B, S, heads, D); cos, sin (B, S, 1, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = at_least_fp32(x)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend):
        super().__init__()
        self.cfg, self.attend = cfg, attend
        H, H_kv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, H * D, bias=False)
        self.wk = nn.Linear(cfg.dim, H_kv * D, bias=False)
        self.wv = nn.Linear(cfg.dim, H_kv * D, bias=False)
        self.wo = nn.Linear(H * D, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        B, S, _ = x.shape
        q = rotary(self.wq(x).view(B, S, self.cfg.heads, -1), cos, sin)
        k = rotary(self.wk(x).view(B, S, self.cfg.kv_heads, -1), cos, sin)
        v = self.wv(x).view(B, S, self.cfg.kv_heads, -1)
        return self.wo(self.attend(q, k, v, mask).reshape(B, S, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attend):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = Attention(cfg, attend)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    """``forward(tokens, targets, pos, mask)``: the mean cross-entropy of the next tokens.
    tokens, targets (B, S); pos (B, S) the rotary positions; mask: the provider's per-batch
    attention argument (:func:`attention_mask`)."""

    def __init__(self, cfg: ModelConfig, attend):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, targets, pos, mask):
        x = self.embed(tokens)
        D, dtype = self.cfg.head_dim, torch.promote_types(x.dtype, torch.float32)
        freq = self.cfg.rope_theta ** (-torch.arange(0, D, 2, device=x.device, dtype=dtype) / D)
        angle = pos.to(dtype)[..., None] * freq  # (B, S, D / 2)
        cos = torch.cat([angle.cos()] * 2, -1)[:, :, None].to(x.dtype)
        sin = torch.cat([angle.sin()] * 2, -1)[:, :, None].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE)


# --- the providers' attention: q (B, S, H, D), k, v (B, S, H_kv, D) -> (B, S, H, D) ------

def flashop_attend():
    flashop = import_flashop()

    def attend_flashop(q, k, v, mask):
        if mask is None:
            return flashop.attention(q, k, v, causal=True)
        cu_seqlens, max_seqlen = mask
        o = flashop.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                     cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                     causal=True)
        return o.view(q.shape)
    return attend_flashop


def attend_sdpa(q, k, v, mask):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # with a mask, keys and values repeated per query head, as transformers does
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o.transpose(1, 2)


def flex_attend(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # inside a compiled model flex_attention is compiled with it; eager calls compile it alone
    flex = flex_attention if compiled else torch.compile(flex_attention)

    def attend_flex(q, k, v, block_mask):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
    return attend_flex


def attend_fn(provider: str, mode: str):
    if provider == "flashop":
        return flashop_attend()
    if provider in SDPA_BACKENDS:
        return attend_sdpa
    if provider == "flex":
        return flex_attend(mode == "compiled")
    raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")


def sdpa_context(provider: str):
    """The context a step runs in: SDPA's backend forced for sdpa-cudnn and sdpa-flash."""
    backend = SDPA_BACKENDS.get(provider)
    return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()


# --- batches ------------------------------------------------------------------------------

@dataclass
class Batch:
    tokens: torch.Tensor  # (B, S) int64
    targets: torch.Tensor  # (B, S) int64; IGNORE at a document's last token (not the row's)
    pos: torch.Tensor  # (B, S) int32: rotary positions, restarting at each document
    layout: str  # "one" or "packed"
    doc_lens: list  # per sequence, its documents' lengths (one of S when not packed)


def document_lengths(S: int, lo: int, hi: int, gen: torch.Generator) -> list:
    """Between lo and hi (at most S) documents of random lengths summing to S."""
    n = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), S)
    cuts = sorted((torch.randperm(S - 1, generator=gen)[:n - 1] + 1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, S])]


def make_batch(cfg: ModelConfig, batch: int, seq: int, layout: str, docs=(4, 8), seed=0,
               device="cpu") -> Batch:
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=gen)
    tokens, targets = stream[:, :-1].clone(), stream[:, 1:].clone()
    if layout == "one":
        doc_lens = [[seq] for _ in range(batch)]
    elif layout == "packed":
        doc_lens = [document_lengths(seq, *docs, gen) for _ in range(batch)]
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    pos = torch.cat([torch.arange(n) for lens in doc_lens for n in lens]).view(batch, seq)
    for b, lens in enumerate(doc_lens):  # (a sequence's last target: the stream's next token)
        targets[b, torch.tensor(lens[:-1], dtype=torch.int64).cumsum(0) - 1] = IGNORE
    return Batch(tokens.to(device), targets.to(device), pos.to(device, torch.int32), layout,
                 doc_lens)


def document_ids(batch: Batch) -> torch.Tensor:
    """(B, S): each token's document number within its sequence."""
    lens = torch.tensor([n for lens in batch.doc_lens for n in lens])
    seq_ids = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    return seq_ids.view(batch.tokens.shape).to(batch.tokens.device)


def attention_mask(provider: str, batch: Batch):
    """The provider's per-batch attention argument: None (causal over each sequence);
    packed, flashop's (cu_seqlens, max_seqlen), SDPA's (B, 1, S, S) boolean mask, or
    FlexAttention's block mask."""
    device, (B, S) = batch.tokens.device, batch.tokens.shape
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        if batch.layout == "one":
            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
            return create_block_mask(mask_mod, None, None, S, S, device=device)
        doc = document_ids(batch)

        def doc_causal(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        return create_block_mask(doc_causal, B, None, S, S, device=device)
    if batch.layout == "one":
        return None
    if provider == "flashop":
        lens = [n for lens in batch.doc_lens for n in lens]
        cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
        return cu, max(lens)
    doc = document_ids(batch)
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def build_model(cfg: ModelConfig, provider: str, mode: str, device, dtype, seed=0) -> nn.Module:
    """The model with the provider's attention, weights drawn in fp32 from ``seed`` (normal,
    std dim^-0.5; embeddings std 1) and cast to ``dtype``: the same initial weights for
    every provider, mode and dtype."""
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = Decoder(cfg, attend_fn(provider, mode))
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.data.normal_(0.0, 1.0 if name == "embed.weight" else cfg.dim ** -0.5,
                               generator=gen)
    model = model.to(dtype)
    if mode == "compiled":
        model = torch.compile(model, fullgraph=True)
    return model


# --- timing -------------------------------------------------------------------------------

@dataclass
class Result:
    tokens_per_s: float = float("nan")
    ms: float = float("nan")
    peak_gib: float = float("nan")
    held_gib: float = float("nan")  # allocated before the configuration began
    first_step_s: float = float("nan")
    loss: float = float("nan")
    note: str = ""


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_config(cfg, provider, mode, batch: Batch, dtype, warmup, steps) -> Result:
    """Train ``warmup + steps`` steps of a fresh model on ``batch``; the timed steps' median."""
    device = batch.tokens.device
    held = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    model = build_model(cfg, provider, mode, device, dtype)
    mask = attention_mask(provider, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    times, losses = [], []
    with sdpa_context(provider):
        for _ in range(warmup + steps):
            _sync(device)
            start = time.perf_counter()
            loss = model(batch.tokens, batch.targets, batch.pos, mask)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.detach())
    seconds = statistics.median(times[warmup:])
    result = Result(tokens_per_s=batch.tokens.numel() / seconds, ms=seconds * 1e3,
                    first_step_s=times[0], loss=losses[0].item())
    if device.type == "cuda":
        result.peak_gib = (torch.cuda.max_memory_allocated() - held) / 2**30
        result.held_gib = held / 2**30
    return result


def refusal(provider: str, error: Exception, caught) -> str:
    """Why a configuration failed: the error's line, and SDPA's warnings naming the forced
    backend's reasons (its RuntimeError says only "No available kernel")."""
    reason = f"{type(error).__name__}: {error_line(error)}"
    backend = {"sdpa-cudnn": "cudnn", "sdpa-flash": "flash"}.get(provider)
    if backend:
        why = [re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message)).strip()
               for w in caught]
        why = [w.splitlines()[0] for w in why
               if w and backend in w.lower() and not w.endswith(":")]
        if why:
            reason += f" ({'; '.join(dict.fromkeys(why))[:300]})"
    return reason


def free_memory(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --- the table ----------------------------------------------------------------------------

def add_ratios(rows):
    """Each row's tokens/s over the fastest SDPA provider's of its (mode, seq, layout)."""
    best = {}
    for r in rows:
        if r["provider"] in SDPA_BACKENDS and r["tokens_per_s"] == r["tokens_per_s"]:
            key = (r["mode"], r["seq"], r["layout"])
            best[key] = max(best.get(key, 0.0), r["tokens_per_s"])
    for r in rows:
        b = best.get((r["mode"], r["seq"], r["layout"]))
        r["vs_best_sdpa"] = r["tokens_per_s"] / b if b else float("nan")


def _cell(x, fmt):
    return "n/a" if x != x else format(x, fmt)  # NaN: not measured


def print_table(rows):
    """A markdown table: one row per configuration, in the order run."""
    print("\n| mode | seq | layout | provider | tokens/s | ms/step | peak GiB | vs best SDPA "
          "| first loss | note |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['seq']} | {r['layout']} | {r['provider']} "
              f"| {_cell(r['tokens_per_s'], '.0f')} | {_cell(r['ms'], '.1f')} "
              f"| {_cell(r['peak_gib'], '.2f')} | {_cell(r['vs_best_sdpa'], '.2f')} "
              f"| {_cell(r['loss'], '.4f')} | {r['note']} |", flush=True)


# --- the command --------------------------------------------------------------------------

def _names(values, choices, parser, what):
    """Space- or comma-separated names, each checked against ``choices``."""
    names = [x for v in values for x in v.split(",") if x]
    for name in names:
        if name not in choices:
            parser.error(f"unknown {what} {name!r}; choose from {', '.join(choices)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--tiny", action="store_true",
                   help="a model for the CPU: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, "
                        "vocab 256, seq 64, 2 documents when packed, 1 warm-up and 2 timed "
                        "steps (options given override it)")
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="weights and activations (default bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--providers", nargs="+", default=None,
                   help=f"of {', '.join(PROVIDERS)} (default all on CUDA, flashop and sdpa "
                        "on the CPU)")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"of {', '.join(MODES)} (default both on CUDA, eager on the CPU)")
    p.add_argument("--layouts", nargs="+", default=["one", "packed"],
                   help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--seq", nargs="+", type=int, default=None,
                   help="sequence lengths (default 4096 8192; tiny: 64)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per step, a multiple of each --seq (default one sequence)")
    p.add_argument("--docs", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                   help="documents per packed sequence, drawn from [LO, HI] (default 4 8)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="model width (default 2048)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the rows to PATH")
    args = p.parse_args(argv)
    preset = TINY if args.tiny else FULL
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(args.device).type == "cuda"
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if on_cuda else "fp32")]
    default_providers = PROVIDERS if on_cuda else ["flashop", "sdpa"]
    args.providers = _names(args.providers or default_providers, PROVIDERS, p, "provider")
    args.modes = _names(args.modes or (MODES if on_cuda else ["eager"]), MODES, p, "mode")
    args.layouts = _names(args.layouts, LAYOUTS, p, "layout")
    base = preset["model"]
    args.model = ModelConfig(
        vocab=base.vocab, dim=args.hidden or base.dim, layers=args.layers or base.layers,
        heads=args.heads or base.heads, kv_heads=args.kv_heads or base.kv_heads)
    m = args.model
    if m.dim % m.heads or m.heads % m.kv_heads or m.head_dim % 2:
        p.error(f"--hidden {m.dim}, --heads {m.heads}, --kv-heads {m.kv_heads}: the heads must "
                "divide the width into an even head dim, and the KV heads the heads")
    args.seq = args.seq or preset["seq"]
    args.docs = tuple(args.docs or preset["docs"])
    if not 1 <= args.docs[0] <= args.docs[1]:
        p.error(f"--docs {args.docs[0]} {args.docs[1]}: need 1 <= LO <= HI")
    for S in args.seq:
        if S < 1 or (args.tokens and args.tokens % S):
            p.error(f"--seq {S}: must be positive and divide --tokens {args.tokens}")
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    args.steps = preset["steps"] if args.steps is None else args.steps
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    if argv is None and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        # flashop's kernels run on the CPU in Triton's interpreter, read when they are defined
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    import triton
    import_flashop()
    cfg = args.model
    gpu = torch.cuda.get_device_name() if on_cuda else "cpu (Triton's interpreter)"
    with torch.device("meta"):
        params = sum(p.numel() for p in Decoder(cfg, None).parameters())
    print(f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    print(f"model: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads of {cfg.head_dim}, "
          f"{cfg.kv_heads} KV heads, MLP {cfg.ffn}, vocab {cfg.vocab}, untied head, "
          f"{params / 1e6:.1f}M parameters, {str(args.dtype)[6:]}; warm-up {args.warmup}, "
          f"timed {args.steps} steps", flush=True)
    configs = [(S, layout, mode, provider) for S in args.seq for layout in args.layouts
               for mode in args.modes for provider in args.providers]
    rows, batch = [], None
    bar = progress(configs, desc="configurations", label=lambda c: " ".join(map(str, c)))
    for S, layout, mode, provider in bar:
        B = (args.tokens or S) // S
        if batch is None or batch.tokens.shape[1] != S or batch.layout != layout:
            batch = make_batch(cfg, B, S, layout, args.docs, seed=0, device=args.device)
            bar.write(f"seq {S}, batch {B}, {layout}: document lengths {batch.doc_lens}")
        if mode == "compiled" or provider == "flex":
            torch._dynamo.reset()  # a fresh compile per configuration, no recompile limit
        free_memory(args.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run_config(cfg, provider, mode, batch, args.dtype, args.warmup,
                                    args.steps)
            except Exception as e:  # a backend's refusal, out of memory, a compile failure
                result = Result(note="n/a: " + refusal(provider, e, caught))
        free_memory(args.device)
        rows.append(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                         dtype=str(args.dtype)[6:], layers=cfg.layers, dim=cfg.dim,
                         heads=cfg.heads, kv_heads=cfg.kv_heads, batch=B, mode=mode, seq=S,
                         layout=layout, provider=provider, **vars(result)))
        bar.write(f"  {mode:<8} {layout:<6} {provider:<10} "
                  + (result.note if result.note else
                     f"{result.tokens_per_s:9.0f} tokens/s {result.ms:8.1f} ms "
                     f"peak {_cell(result.peak_gib, '.2f')} GiB, first step "
                     f"{result.first_step_s:.1f} s, loss {result.loss:.4f}"
                     + (f" ({result.held_gib:.2f} GiB held before)"
                        if result.held_gib > 0.01 else "")))
    add_ratios(rows)
    print_table(rows)
    if args.csv:
        digits = dict(tokens_per_s=1, ms=3, peak_gib=3, held_gib=3, vs_best_sdpa=3,
                      first_step_s=2, loss=6)
        write_csv(Path(args.csv), [  # NaN (not measured) as an empty field
            {k: ("" if r[k] != r[k] else round(r[k], digits[k])) if k in digits else r[k]
             for k in CSV_HEADER} for r in rows], CSV_HEADER)
        print(f"\nresults written to {args.csv}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
