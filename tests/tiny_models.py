"""Tiny random-weight transformers models (no download) and left-padded batches for them
(tests/test_transformers.py, tests/test_autocast.py, tests/test_meta.py). Importing it skips
the importing test, or its module, where transformers is not installed."""

import pytest
import torch

pytest.importorskip("transformers")

import flashop.transformers as ft  # noqa: E402
from helpers import DEVICE  # noqa: E402

from transformers import (  # noqa: E402
    AutoModelForCausalLM, Gemma2Config, GptOssConfig, Llama4TextConfig, LlamaConfig,
    MistralConfig, Qwen2Config,
)

_COMMON = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               max_position_embeddings=64, pad_token_id=0)


def tiny_config(kind: str, **changes):
    configs = {
        "llama": lambda: LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     **_COMMON),
        "qwen2": lambda: Qwen2Config(num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     **_COMMON),
        "mistral": lambda: MistralConfig(num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, sliding_window=4, **_COMMON),
        # softcap 1.0: the tiny model's scores are small, a larger cap would not bend them
        "gemma2": lambda: Gemma2Config(num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                       attn_logit_softcapping=1.0, **_COMMON),
        # attention sinks; sliding and full layers; 4 experts, 2 per token, run eagerly
        # (the grouped-GEMM experts take no float64, which the per-row reference needs)
        "gpt_oss": lambda: GptOssConfig(num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, sliding_window=4, num_local_experts=4,
                                        num_experts_per_tok=2, experts_implementation="eager",
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                        **dict(_COMMON, hidden_size=64)),
        # a chunked layer (chunks of 4 tokens; its cache keeps the last 3) and a full one;
        # 2 experts, the second layer's MLP a mixture of them
        "llama4": lambda: Llama4TextConfig(num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, attention_chunk_size=4,
                                           no_rope_layers=[1, 0], intermediate_size_mlp=64,
                                           num_local_experts=2, num_experts_per_tok=1,
                                           interleave_moe_layer_step=2, **_COMMON),
    }
    config = configs[kind]()
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def tiny_model(kind: str, implementation=ft.ATTN_IMPLEMENTATION, **changes):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **changes),
                                             attn_implementation=implementation)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                # sinks of the size of the tiny model's scores' exponentials (the random
                # init, std 0.02, would hardly change them)
                module.sinks.normal_(1.0, 1.0)
    return model.to(DEVICE).eval()


def left_padded_batch(lengths, S, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lengths), S), generator=gen)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def positions(mask):
    """Each token's position in its sequence (as generate() computes them)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def per_row_reference(model, ids, mask, fn):
    """``fn(model(row))`` summed over the rows, each row run alone (no padding) in float64
    with the positions it has in the batch: the reference no padding can disturb."""
    model.double().set_attn_implementation("eager")
    results = []
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        logits = model(ids[b, keep][None], position_ids=positions(mask[b])[keep][None]).logits
        results.append(fn(b, logits[0]))
    return results
