"""flashop's Triton kernels (``@triton.jit``): the attention forward and backward.

``INTERPRETING``: whether they run in Triton's CPU interpreter. Triton decides it when a
kernel is decorated, from TRITON_INTERPRET=1 at import.
"""

from triton.runtime.interpreter import InterpretedFunction

from flashop.kernels.forward import attention_fwd_kernel

INTERPRETING = isinstance(attention_fwd_kernel, InterpretedFunction)
