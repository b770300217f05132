"""flashop: FlashAttention-2 in Triton, registered as PyTorch operators.

Importing flashop registers the ``torch.ops.flashop`` operators: ``attention_forward`` and
``attention_backward`` (one pair for dense and packed batches), the composites built on them
(``attention``, ``attention_with_lse``, ``attention_varlen``, ``attention_varlen_with_lse``),
the decoding operator ``attention_with_kvcache`` and the paged prefill's
``attention_varlen_paged``; it also registers "flashop" with
SDPA's flash-attention registry (torch >= 2.11), without activating it. See README.md and
docs/ for the API and its conventions; ``flashop.config`` holds the FLASHOP_* switches.

The public modules sit here (api, config, reference, testing, padding, and the doors
flash_attn, flash_mla, sdpa, transformers, distributed); ``flashop._ops`` (the operators'
registration and checks), ``flashop._launch`` (the launchers and tiles) and
``flashop.kernels`` (the Triton kernels) are the layers below, internal.
"""

from flashop import config
from flashop.api import (
    attention, attention_varlen, attention_varlen_with_lse, attention_with_kvcache,
    attention_with_lse,
)
from flashop.explain import Explanation, explain
from flashop.kernels import INTERPRETING
from flashop.padding import pad_input, unpad_input
from flashop.reference import (
    attention_reference, attention_varlen_reference, attention_with_kvcache_reference,
)
from flashop import sdpa as _sdpa  # noqa: F401  (registers, does not activate)

__all__ = ["attention", "attention_with_lse", "attention_varlen", "attention_varlen_with_lse",
           "attention_with_kvcache", "attention_reference", "attention_varlen_reference",
           "attention_with_kvcache_reference", "pad_input", "unpad_input", "INTERPRETING",
           "config", "explain", "Explanation"]
__version__ = "0.1.0"
