"""The operators' registration: pinned schemas and torch.library.opcheck."""

import pytest
import torch
from expecttest import TestCase
from torch.library import opcheck

import flashop
from helpers import Case, make_inputs

OPCHECK_CASES = [
    Case(B=2, S_q=37, S_k=53, H_kv=2, G=2, D=40, DV=24, dtype=torch.float32, causal=True),
    Case(B=1, S_q=40, S_k=17, H_kv=1, G=3, D=16, DV=16, dtype=torch.float16, causal=True,
         scale=0.5, layout="bhsd"),
    Case(B=1, S_q=19, S_k=33, H_kv=2, G=1, D=24, DV=32, dtype=torch.bfloat16, causal=False),
]


class TestSchemas(TestCase):
    def test_schemas(self):
        schemas = "\n".join(str(op.default._schema) for op in (
            torch.ops.flashop.attention, torch.ops.flashop.attention_with_lse,
            torch.ops.flashop.attention_backward))
        self.assertExpectedInline(schemas, """\
flashop::attention(Tensor q, Tensor k, Tensor v, *, bool causal=False, float? scale=None) -> Tensor
flashop::attention_with_lse(Tensor q, Tensor k, Tensor v, *, bool causal=False, float? scale=None) -> (Tensor, Tensor)
flashop::attention_backward(Tensor dout, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, *, bool causal=False, float? scale=None) -> (Tensor, Tensor, Tensor)""")  # noqa: B950

    def test_python_functions_have_the_ops_names(self):
        for fn in (flashop.attention, flashop.attention_with_lse):
            self.assertTrue(hasattr(torch.ops.flashop, fn.__name__))


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
@pytest.mark.parametrize("op", ["attention", "attention_with_lse"])
def test_opcheck_forward(case, op):
    (q, k, v), _, _ = make_inputs(case)
    opcheck(getattr(torch.ops.flashop, op).default, (q, k, v),
            {"causal": case.causal, "scale": case.scale})


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_backward(case):
    (q, k, v), dout, dlse = make_inputs(case)
    out, lse = flashop.attention_with_lse(q, k, v, causal=case.causal, scale=case.scale)
    args = (dout, dlse, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    opcheck(torch.ops.flashop.attention_backward.default, args,
            {"causal": case.causal, "scale": case.scale})
