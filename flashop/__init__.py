"""flashop: FlashAttention-2 in Triton, registered as PyTorch operators.

Importing flashop registers ``torch.ops.flashop.attention``, ``attention_with_lse``, the
``attention_forward`` and ``attention_backward`` operators they are built on, and their
packed-batch versions (``attention_varlen``, ``attention_varlen_with_lse``,
``attention_varlen_forward``, ``attention_varlen_backward``). See README.md and docs/ for
the API and its conventions.
"""

from flashop.api import (
    attention, attention_varlen, attention_varlen_with_lse, attention_with_lse,
)
from flashop.kernels import INTERPRETING
from flashop.padding import pad_input, unpad_input
from flashop.reference import attention_reference, attention_varlen_reference
from flashop.api import attention_with_kvcache  # noqa: E402
from flashop.reference import attention_with_kvcache_reference  # noqa: E402

__all__ = ["attention", "attention_with_lse", "attention_varlen", "attention_varlen_with_lse",
           "attention_reference", "attention_varlen_reference", "pad_input", "unpad_input",
           "INTERPRETING", "attention_with_kvcache", "attention_with_kvcache_reference"]
__version__ = "0.1.0"

# PyTorch SDPA's flash-attention registry: "flashop" registered, not activated (torch >= 2.11)
from flashop import sdpa as _sdpa  # noqa: E402,F401
