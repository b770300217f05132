"""The ``torch.ops.flashop`` operators (internal): their registration (``torch.library``
ops, fakes, autograd), the input checks they share with their fakes, and the eager path
that runs their bodies without the dispatcher. Built on ``flashop._launch``; importing it
registers the operators."""

from flashop._ops import attention, attention_fp8, kvcache  # noqa: F401  (registers the ops)
from flashop._ops import compile_key

compile_key.register()  # (after the ops: their kernels' table holds the launch environment)
