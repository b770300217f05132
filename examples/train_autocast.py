"""Training a transformers model with fp32 weights under bf16 autocast, its attention run by
flashop (``attn_implementation="FlashOp"``), beside the same model on PyTorch's SDPA.

A tiny random-init Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128; built from
its config, nothing downloaded) takes ``--steps`` AdamW steps on one random batch, once with
flashop and once with SDPA, from the same initial weights. The losses of every step are
printed side by side. The first step's loss and the gradients of layer 0's attention
weights are checked against a float64 eager reference by flashop's accuracy rule: flashop's
error may be at most 2x (loss) / 3x (gradients) SDPA's error under the same autocast, plus
two bf16 units of rounding at the reference's magnitude. Exits 1 if a check fails.

    python examples/train_autocast.py                      # GPU where there is one
    python examples/train_autocast.py --device cpu         # Triton's CPU interpreter
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

ATTENTION_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        p.error("--steps and --batch must be at least 1, --seq at least 2")
    return args


def import_flashop(device: str):
    """flashop and its transformers registration; on the CPU its kernels run in Triton's
    interpreter, which Triton reads when they are defined (at import)."""
    if torch.device(device).type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import flashop.transformers
    except ImportError:  # not installed: the checkout this script lives in
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import flashop.transformers
    return flashop


def tiny_llama(implementation: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096,
                         # weights of std 0.1 rather than 0.02: scores of a few units, so
                         # attention is far from uniform and a wrong one shows in the loss
                         initializer_range=0.1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation)


def attention_grads(model) -> dict:
    attn = model.model.layers[0].self_attn
    return {f"layer 0 {name}.weight grad": getattr(attn, name).weight.grad.detach().clone()
            for name in ATTENTION_WEIGHTS}


def train(model, ids, steps: int, device: str):
    """``steps`` AdamW steps under bf16 autocast on the batch ``ids`` (next-token loss);
    returns the losses and the first step's attention gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first_grads = [], None
    for _ in range(steps):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        if not all(p.dtype == g.dtype == torch.float32 for p, g in zip(model.parameters(), grads)):
            raise RuntimeError("expected fp32 weights and fp32 gradients under autocast")
        if first_grads is None:
            first_grads = attention_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).float(), first_grads


def reference(model, ids):
    """The first step's loss and attention gradients in float64, eager attention, no
    autocast."""
    model.double().set_attn_implementation("eager")
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), attention_grads(model)


def main(argv=None) -> int:
    args = parse_args(argv)
    flashop = import_flashop(args.device)
    from flashop.testing import accuracy

    model = tiny_llama(flashop.transformers.ATTN_IMPLEMENTATION).to(args.device).train()
    initial = copy.deepcopy(model.state_dict())
    ids = torch.randint(0, 128, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(args.device)
    runs = {}
    for name in ("FlashOp", "sdpa"):
        model.load_state_dict(initial)
        model.set_attn_implementation(name)
        model.zero_grad(set_to_none=True)
        runs[name] = train(model, ids, args.steps, args.device)
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_grads = reference(model, ids)

    on_cuda = torch.device(args.device).type == "cuda"
    device = torch.cuda.get_device_name(args.device) if on_cuda else "cpu"
    print(f"tiny Llama, fp32 weights, bf16 autocast, batch {args.batch} x {args.seq} tokens, "
          f"AdamW, on {device}")
    print("step  loss flashop  loss sdpa")
    for step, (a, b) in enumerate(zip(runs["FlashOp"][0].tolist(), runs["sdpa"][0].tolist())):
        print(f"{step:4d}  {a:12.6f}  {b:9.6f}")
    # Both runs compute in bf16 under autocast: their distance to the float64 reference is
    # bf16-sized, and flashop's must stay within 2x (loss) / 3x (gradients) SDPA's plus two
    # bf16 units at the reference's magnitude (flashop.testing's rule, docs/testing.md).
    results = [accuracy("first step's loss", runs["FlashOp"][0][:1], ref_loss.reshape(1),
                        runs["sdpa"][0][:1], 2, torch.bfloat16)]
    results += [accuracy(name, runs["FlashOp"][1][name], ref_grads[name], runs["sdpa"][1][name],
                         3, torch.bfloat16) for name in ref_grads]
    for r in results:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.name}: |flashop - float64| {r.error:.2e}, "
              f"|SDPA - float64| {r.plain_error:.2e}, bound {r.bound:.2e}")
    ok = all(result.ok for result in results)
    print(f"check: flashop {'matches' if ok else 'does NOT match'} SDPA under bf16 autocast "
          f"(the accuracy rule against float64 eager)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
