"""flashop.transformers: tiny random-weight transformers models (no download) run through
flashop give eager's logits (within the accuracy rule), greedy tokens and gradients.

Models are built from configs (hidden 32, gpt-oss 64, 2 layers, vocab 100); the kernels run in the
interpreter on the CPU, so every kernel call costs about half a second: keep batches,
sequences and generated lengths short."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import flashop  # noqa: E402
import flashop.transformers as ft  # noqa: E402
from flashop.testing import accuracy  # noqa: E402
from helpers import DEVICE, CPU_PATH_TWIN, cpu_path  # noqa: E402
from tiny_models import (  # noqa: E402
    left_padded_batch, per_row_reference, positions, tiny_config, tiny_model,
)

from transformers import (  # noqa: E402
    AttentionInterface, AutoModelForCausalLM, CompileConfig, DataCollatorWithFlattening,
    DynamicCache,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

try:  # transformers >= 5.2x; earlier ones test for "flash" in the name themselves
    from transformers.utils.generic import is_flash_attention_requested
except ImportError:  # pragma: no cover
    def is_flash_attention_requested(requested_attention_implementation):
        return "flash" in requested_attention_implementation


def assert_accurate(name, actual, ref, plain, factor=2):
    result = accuracy(name, actual, ref, plain, factor, torch.float32)
    assert result.ok, str(result)


def test_registered_under_a_name_transformers_does_not_send_to_flash_attn(tmp_path):
    name = ft.ATTN_IMPLEMENTATION
    assert AttentionInterface()[name] is ft.attention_forward
    assert AttentionMaskInterface()[name] is ft.attention_mask
    assert not is_flash_attention_requested(requested_attention_implementation=name)
    # the three ways to choose it
    model = tiny_model("llama", implementation="eager")
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
    assert loaded.config._attn_implementation == name
    assert tiny_model("qwen2").config._attn_implementation == name


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2", "gpt_oss", "llama4"])
def test_left_padded_logits_match_eager(kind):
    """Left-padded batch (one row padded, one full; S=12 > the window of 4): flashop's
    logits at the real tokens against a float64 per-row reference, eager's as the bound."""
    model = tiny_model(kind)
    ids, mask = left_padded_batch([9, 12], 12)
    keep = mask.bool()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[keep]
        model.set_attn_implementation("eager")
        plain = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[keep]
        ref = torch.cat(per_row_reference(model, ids, mask, lambda b, x: x))
    assert_accurate("logits", out, ref, plain)


@pytest.mark.parametrize("kind", ["qwen2", "gpt_oss", "llama4"])
def test_training_step_gradients_match_eager(kind):
    """A padded batch's loss backward in train mode (no dropout): every parameter's gradient,
    gpt-oss's sinks' included, within 3x eager's error to a float64 per-row reference."""
    ids, mask = left_padded_batch([7, 10], 10, seed=1)
    weights = torch.randn(2, 10, 100, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def loss(b, logits):  # one row's loss from its real tokens' logits
        return (logits * weights[b, mask[b].bool()]).sum()

    def batch_loss(model):
        logits = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
        return sum(loss(b, logits[b, mask[b].bool()]) for b in range(2))

    model = tiny_model(kind).train()
    batch_loss(model).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_attn_implementation("eager")
    batch_loss(model).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(per_row_reference(model, ids, mask, loss)).backward()
    for n, p in model.named_parameters():
        assert_accurate(f"d{n}", grads[n], p.grad, plain[n], factor=3)


def _static_generate_breaks_chunked_masks() -> bool:
    """Whether this transformers' generate() passes ``block_sequence_ids`` to
    create_chunked_causal_mask, which does not take it (5.17 does): its static-cache
    generation of a chunked model then fails inside transformers for every attention
    implementation, eager included."""
    import inspect

    from transformers import masking_utils
    takes = (inspect.signature(masking_utils.create_masks_for_generate).parameters,
             inspect.signature(masking_utils.create_chunked_causal_mask).parameters)
    return "block_sequence_ids" in takes[0] and "block_sequence_ids" not in takes[1]


@pytest.mark.parametrize("kind,cache", [
    ("mistral", "dynamic"), ("gemma2", "static"), ("gpt_oss", "dynamic"),
    pytest.param("llama4", "static", marks=pytest.mark.xfail(
        _static_generate_breaks_chunked_masks(), raises=TypeError, strict=True,
        reason="this transformers' static-cache generate() fails for chunked models "
               "(block_sequence_ids passed to create_chunked_causal_mask)"))])
def test_greedy_generate_gives_eagers_tokens(kind, cache):
    """Left-padded prompts, 4 new tokens past the window of 4: the dynamic cache (Mistral's
    sliding layers; gpt-oss's with sinks) and the static cache (Gemma 2's zero-filled full
    and rolling sliding layers, which must not be attended past their current length; Llama
    4's rolling chunked layers, whose keys start a chunk only now and then)."""
    model = tiny_model(kind)
    ids, mask = left_padded_batch([5, 7], 7, seed=3)
    options = dict(max_new_tokens=4, do_sample=False, cache_implementation=cache)
    tokens = model.generate(ids, attention_mask=mask, **options)
    model.set_attn_implementation("eager")
    assert torch.equal(tokens, model.generate(ids, attention_mask=mask, **options))


@CPU_PATH_TWIN
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_cpu_path_logits_gradients_and_tokens(kind):
    """attn_implementation="FlashOp" on the CPU path (flashop/_launch/cpu, as without the
    interpreter): a left-padded batch's logits and a training step's gradients within the
    rule of eager attention's, greedy generation eager's tokens (decoding steps through the
    decoding operator: Llama's dynamic cache, Gemma 2's static one, gpt-oss's sinks)."""
    with cpu_path():
        test_left_padded_logits_match_eager(kind)
        if kind == "gpt_oss":
            test_training_step_gradients_match_eager(kind)
        cache = "static" if kind == "gemma2" else "dynamic"
        test_decode_steps_run_attention_with_kvcache(kind, cache)


class AttentionCalls(TorchDispatchMode):
    """Records (operator name, number of queries) of every flashop attention operator run."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("flashop::attention"):
            self.calls.append((name.split("::")[1], args[0].shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.compile
@pytest.mark.parametrize("lengths,decode_op", [([4, 6], "attention_forward"),
                                               ([6, 6], "attention_with_kvcache")])
def test_static_cache_generate_compiles_fullgraph(lengths, decode_op):
    """generate() with a static cache and a compiled forward (fullgraph: no host reads in the
    decoding steps; aot_eager, as the interpreter's ops are opaque) gives eager's tokens: a
    left-padded batch decodes with the boolean key mask, an unpadded one with the decoding
    operator."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths, 6, seed=4)
    options = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    graph_ops = []

    def aot_eager_recording(gm, example_inputs, **kwargs):  # the flashop ops of each graph
        graph_ops.append([str(node.target).split(".")[1] for node in gm.graph.nodes
                          if str(node.target).startswith("flashop.")])
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compile_config = CompileConfig(fullgraph=True, backend=aot_eager_recording)
    compile_config._compile_all_devices = True  # compile on the CPU too
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(ids, attention_mask=mask, compile_config=compile_config,
                              **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # decoding compiled
    assert graph_ops and all(ops == [decode_op] * 2 for ops in graph_ops)  # one per layer
    model.set_attn_implementation("eager")
    assert torch.equal(compiled, model.generate(ids, attention_mask=mask, **options))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", [[5, 9], [9, 9]])  # masked / decoding operator
def test_static_cache_generate_compiled_by_inductor_on_gpu(lengths):
    """On a GPU generate() compiles the static-cache decoding steps with Inductor itself."""
    model = tiny_model("gemma2")
    ids, mask = left_padded_batch(lengths, 9, seed=7)
    options = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tokens = model.generate(ids, attention_mask=mask, **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    model.set_attn_implementation("eager")
    assert torch.equal(tokens, model.generate(ids, attention_mask=mask, **options))


@pytest.mark.parametrize("kind", ["mistral", "llama4"])
def test_packed_sequences_match_separate_runs(kind):
    """DataCollatorWithFlattening's one-row batch: with its cu_seq_lens/max_length kwargs,
    compiled with fullgraph (no host reads), and with position_ids alone, the logits equal
    each sequence run alone (Llama 4's chunks restart in every sequence; its layers do not
    pass position_ids on, so it has the kwargs' path alone)."""
    model = tiny_model(kind)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in (5, 8, 3)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in sequences], return_tensors="pt")
    inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in batch.items() if k != "labels"}
    assert isinstance(inputs["max_length_q"], int)
    with torch.no_grad():
        torch._dynamo.reset()
        forward = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
        packed = forward(**inputs).logits[0]
        if kind != "llama4":
            by_positions = model(inputs["input_ids"],
                                 position_ids=inputs["position_ids"]).logits[0]
        model.set_attn_implementation("eager")
        plain = torch.cat([model(torch.tensor([s], device=DEVICE)).logits[0]
                           for s in sequences])
        model.double()
        ref = torch.cat([model(torch.tensor([s], device=DEVICE)).logits[0] for s in sequences])
    assert_accurate("logits (cu_seq_lens)", packed, ref, plain)
    if kind != "llama4":
        assert_accurate("logits (position_ids)", by_positions, ref, plain)


def test_training_with_attention_dropout_is_reproducible():
    """attention_dropout=0.1 in training: flashop's dropout on the padded batch's varlen
    path; gradients finite; torch.manual_seed reproduces the loss and the gradients, another
    seed drops others; in evaluation no dropout (the loss of attention_dropout=0)."""
    ids, mask = left_padded_batch([5, 8], 8, seed=10)
    model = tiny_model("llama", attention_dropout=0.1).train()

    def loss_and_grads(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(ids, attention_mask=mask, position_ids=positions(mask),
                     labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(0)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    again, grads_again = loss_and_grads(0)
    assert torch.equal(again, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    other, _ = loss_and_grads(1)
    assert not torch.equal(other, loss)
    with torch.no_grad():
        evaluated = model.eval()(ids, attention_mask=mask, position_ids=positions(mask),
                                 labels=ids).loss
        model.config.attention_dropout = 0.0
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.0
        assert torch.equal(evaluated, model.train()(ids, attention_mask=mask,
                                                    position_ids=positions(mask),
                                                    labels=ids).loss)


def test_attention_forward_passes_dropout_in_training_and_sinks():
    """One attention call: the module's dropout in training is flashop's dropout_p (the same
    seed, the same values), none in evaluation; s_aux is flashop's sinks."""
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 6, 8, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 6, 8, generator=gen).to(DEVICE) for _ in range(2))
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    evaluated, _ = ft.attention_forward(attn, q, k, v, None, dropout=0.5, s_aux=sinks)
    assert torch.equal(evaluated, flashop.attention(*views, sinks=sinks, causal=True))
    attn.train()
    torch.manual_seed(12)
    dropped, _ = ft.attention_forward(attn, q, k, v, None, dropout=0.5, s_aux=sinks)
    torch.manual_seed(12)
    assert torch.equal(dropped, flashop.attention(*views, sinks=sinks, causal=True,
                                                  dropout_p=0.5))
    assert not torch.equal(dropped, evaluated)


def test_unsupported_features_raise_naming_them():
    with pytest.raises(NotImplementedError, match="extra mask functions"):
        ft.attention_mask(1, 3, 3, use_vmap=True)


def test_mask_function_marks_static_cache_slots_without_reading_them():
    """A decoding step on a static cache (its length a tensor): each row's count of written
    slots, made on the device; multi-token steps and dynamic caches get the mask's length;
    a left-padded decoding step a boolean mask, an unpadded one counts."""
    length = torch.tensor(5)
    counts = ft.attention_mask(2, 1, 8, q_offset=length, kv_offset=0)
    assert counts.dtype == torch.int32 and counts.tolist() == [6, 6]
    assert ft.attention_mask(2, 1, 8, attention_mask=counts) is counts  # passed back in
    assert ft.attention_mask(2, 1, 8, q_offset=4).tolist() == [5, 5]
    assert ft.attention_mask(2, 3, 8, q_offset=length).shape == (2, 8)
    assert ft.attention_mask(2, 3, 8, q_offset=2).shape == (2, 5)
    assert ft.attention_mask(2, 3, 5, q_offset=2) is None  # a dynamic cache
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(ft.attention_mask(2, 1, 6, attention_mask=padding), padding.bool())
    unpadded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert ft.attention_mask(2, 1, 6, attention_mask=unpadded).tolist() == [3, 4]
    assert ft.attention_mask(2, 4, 4, attention_mask=torch.ones(2, 4)) is None


def test_decode_attention_masks_unwritten_slots_and_the_window():
    """decode_attention against the reference on the attended slots only: garbage written
    past each row's length must not change the output."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 8, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 9, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
    key_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1] * 7 + [0, 0]],
                            dtype=torch.bool, device=DEVICE)
    k[:, 7:], v[:, 7:] = 1e4, -1e4  # a static cache's slots past the current length
    out = ft.decode_attention(q, k, v, key_mask, scale=None, window=3, softcap=0.0)
    keep = key_mask.clone()
    keep[:, :4] = False  # the window of 3 ending at the query's slot 6
    ref, _ = flashop.attention_reference(q, k, v, keep[:, None, None, :],
                                         compute_dtype=torch.float64)
    plain, _ = flashop.attention_reference(q, k, v, keep[:, None, None, :], compute_dtype=None)
    result = accuracy("out", out, ref, plain, 2, q.dtype)
    assert result.ok, str(result)


@pytest.mark.parametrize("kind,cache", [("llama", "static"), ("llama", "dynamic"),
                                        ("gemma2", "static"), ("gpt_oss", "static")])
def test_decode_steps_run_attention_with_kvcache(kind, cache):
    """An unpadded batch: every decoding step's attention is the decoding operator over the
    cache as transformers wrote it (static: zero-filled slots past each row's length; Gemma
    2's rolling sliding layers with their window and softcap; gpt-oss's sinks), tokens equal
    to eager's."""
    model = tiny_model(kind)
    ids, mask = left_padded_batch([6, 6], 6, seed=8)
    options = dict(max_new_tokens=3, do_sample=False, cache_implementation=cache)
    with AttentionCalls() as recorded:
        tokens = model.generate(ids, attention_mask=mask, **options)
    decode = [name for name, S_q in recorded.calls if S_q == 1]
    assert decode == ["attention_with_kvcache"] * (2 * 2)  # 2 steps x 2 layers
    model.set_attn_implementation("eager")
    assert torch.equal(tokens, model.generate(ids, attention_mask=mask, **options))


def test_decode_attention_counts_match_the_masked_path():
    """Counts (the decoding operator) give the boolean mask's result on the same slots:
    garbage past each row's count is never attended; a window; gradients take the mask."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 4, 8, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen).to(DEVICE).transpose(1, 2)
            for _ in range(2))  # transformers' (B, H_kv, S, D) caches, as views
    counts = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    k[0, 5:], v[0, 5:] = 1e4, -1e4
    for window in (None, 3):
        options = dict(scale=None, window=window, softcap=0.0)
        with AttentionCalls() as recorded:
            out = ft.decode_attention(q, k, v, counts, **options)
        assert [name for name, _ in recorded.calls] == ["attention_with_kvcache"]
        expected = ft.decode_attention(q, k, v, ft._key_mask(counts, 9), **options)
        # fp32, two of flashop's kernels (the split-KV decoding one and the dense forward)
        # summing the same terms in another order: equal to a few fp32 roundings
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    q.requires_grad_()
    with AttentionCalls() as recorded:
        out = ft.decode_attention(q, k, v, counts, **options)
    assert [name for name, _ in recorded.calls] == ["attention_forward"]
    # the dense forward on the mask the counts make: within the same fp32 rounding bound
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding", [True, False], ids=["chunked-cache", "full-cache"])
def test_llama4_chunked_layers_decode_as_the_whole_sequence(sliding):
    """Llama 4's chunked layers (chunks of 4 tokens) decoding a left-padded batch one token
    per step with a dynamic cache: the model's (its chunked layers keep their last 3 tokens,
    so that their first key rarely starts a chunk, and the mask function masks the keys
    before the first that does), or one that keeps every token (the decoding step's mask
    then holds every key of the row, the attention restricts it to the query's chunk). Each
    step's logits against the float64 forward of each whole row, eager's steps as the
    bound."""
    model = tiny_model("llama4")
    assert [ft._attention_chunk(layer.self_attn) for layer in model.model.layers] == [4, 0]
    ids, mask = left_padded_batch([9, 12], 12, seed=11)
    prefill = 5
    steps = {}
    with torch.no_grad():
        for implementation in (ft.ATTN_IMPLEMENTATION, "eager"):
            model.set_attn_implementation(implementation)
            cache = DynamicCache(config=model.config) if sliding else DynamicCache()
            # the cache positionally: transformers renamed the argument (past_key_values,
            # cache from 5.2x on)
            logits = [model(ids[:, :prefill], mask[:, :prefill], positions(mask)[:, :prefill],
                            cache, use_cache=True).logits]
            for t in range(prefill, ids.shape[1]):
                logits.append(model(ids[:, t:t + 1], mask[:, :t + 1],
                                    positions(mask)[:, t:t + 1], cache,
                                    use_cache=True).logits)
            steps[implementation] = torch.cat(logits, dim=1)[mask.bool()]
        ref = torch.cat(per_row_reference(model, ids, mask, lambda b, x: x))
    assert_accurate("logits", steps[ft.ATTN_IMPLEMENTATION], ref, steps["eager"])


def test_mask_function_masks_the_keys_before_a_chunk_start():
    """The mask function of a chunked layer whose keys start at position kv_offset (a full
    chunked cache): the slots before the first chunk start are masked, counted from each
    row's first real token; other layers' masks and offsets of a whole chunk are as
    before."""
    config = tiny_config("llama4")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    # 4 keys at positions 6..9: row 0's tokens count from position 2 (chunks 2-5, 6-9),
    # row 1's from 0 (chunks 4-7, 8-11)
    out = ft.attention_mask(2, 1, 4, q_offset=9, kv_offset=6, attention_mask=mask,
                            local_size=4, config=config)
    assert out.tolist() == [[True, True, True, True], [False, False, True, True]]
    out = ft.attention_mask(2, 1, 4, q_offset=9, kv_offset=6, local_size=4, config=config,
                            device=DEVICE)
    assert out.tolist() == [[False, False, True, True]] * 2
    assert ft.attention_mask(2, 1, 4, q_offset=11, kv_offset=8, local_size=4,
                             config=config) is None
    assert ft.attention_mask(2, 1, 4, q_offset=9, kv_offset=6, local_size=None,
                             config=config) is None
