"""The benchmark scripts' parts that need no GPU: the results-file reading
(benchmarks/attention.py --from-csv; a grid run in parts is tabulated and plotted from its
CSV files), and the calls a sweep times (their timing stubbed)."""

import sys
from pathlib import Path

import torch

import flashop
from helpers import DEVICE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention  # noqa: E402

ROWS = [("flashop", 128, 1024, False, "fwd", 0.5, 300.0),
        ("flex", 128, 1024, False, "fwd", 0.6, 250.0),
        ("flashop", 64, 1024, True, "bwd", 0.7, 200.0)]


def _write(path):
    attention.write_csv(path, [
        dict(gpu="GPU X", torch="2.0", triton="3.0", provider=p, dtype="bf16", D=D, N=N,
             B=16384 // N, H=2048 // D, causal=c, **{"pass": s}, ms=ms, tflops=t)
        for p, D, N, c, s, ms, t in ROWS])


def test_results_are_read_back_with_their_numbers_and_filtered(tmp_path):
    _write(tmp_path / "a.csv")
    rows = attention.read_results([tmp_path / "a.csv"])
    assert [(r["provider"], r["D"], r["N"], r["causal"], r["pass"], r["ms"], r["tflops"])
            for r in rows] == ROWS
    assert [r["D"] for r in attention.read_results([tmp_path / "a.csv"],
                                                   heads_dims=[(64, 64)])] == [64]
    assert [r["DV"] for r in rows] == [128, 128, 64]  # files without the column: DV = D
    assert len(attention.read_results([tmp_path / "a.csv"], causal="false")) == 2
    assert [r["provider"] for r in attention.read_results([tmp_path / "a.csv"],
                                                          providers="flex")] == ["flex"]


def test_from_csv_prints_the_table_and_ratios_of_several_files(tmp_path, capsys):
    _write(tmp_path / "a.csv")
    _write(tmp_path / "b.csv")
    assert attention.main(["--from-csv", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"),
                           "--heads-dims", "128"]) == 0
    out = capsys.readouterr().out
    assert "GPU: GPU X | torch 2.0 | triton 3.0" in out
    line = next(x for x in out.splitlines() if x.split()[:4] == ["128", "1024", "False", "fwd"])
    assert line.split()[4:] == ["300.0", "250.0", "1.20"]


def test_values_head_dim_is_read_parsed_and_counted(tmp_path, capsys):
    """A D/DV head dim (192/128, DeepSeek's prefill): parsed from --heads-dims, its FLOPs
    2 * B * H * N^2 * (D + DV), its rows told apart from D's in the table."""
    assert attention.dims_list("64, 192/128") == [(64, 64), (192, 128)]
    assert attention.flops(1, 1, 2, 192, False, "fwd", 128) == 2 * 4 * 320
    assert attention.flops(1, 1, 2, 64, True, "bwd") == 4 * 4 * 64 / 2 * 2.5
    rows = [dict(gpu="GPU X", torch="2.0", triton="3.0", provider="flashop", dtype="bf16",
                 D=192, N=4096, B=4, H=16, causal=True, **{"pass": "fwd"}, ms=1.0, tflops=t,
                 DV=dv) for dv, t in ((128, 400.0), (192, 500.0))]
    attention.write_csv(tmp_path / "a.csv", rows)
    assert attention.main(["--from-csv", str(tmp_path / "a.csv"), "--heads-dims",
                           "192/128"]) == 0
    lines = [x.split() for x in capsys.readouterr().out.splitlines()]
    assert ["192/128", "4096", "True", "fwd", "400.0"] in lines
    assert not any(x[:1] == ["192"] for x in lines)


def test_from_csv_with_nothing_selected_fails(tmp_path, capsys):
    _write(tmp_path / "a.csv")
    assert attention.main(["--from-csv", str(tmp_path / "a.csv"), "--heads-dims", "256"]) == 1
    assert "no rows selected" in capsys.readouterr().err


def test_decode_from_csv_prints_the_table_with_the_ratio_to_sdpa(tmp_path, capsys):
    import decode

    rows = [dict(gpu="GPU X", torch="2.0", triton="3.0", provider=p, layout=layout, page=page,
                 B=8, L=4096, H=32, H_kv=8, D=128, us=us, gbps=1.0, frac_copy=f)
            for p, layout, page, us, f in [("flashop", "dense", 0, 40.0, 0.8),
                                           ("flashop", "paged", 16, 50.0, 0.64),
                                           ("sdpa", "dense", 0, 44.0, 0.73)]]
    decode.write_csv(tmp_path / "d.csv", rows, decode.CSV_HEADER)
    assert decode.main(["--from-csv", str(tmp_path / "d.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split()[2:] == ["flashop", "flashop-p16", "sdpa", "flashop/sdpa"]
    assert lines[-1].split() == ["8", "4096", "40.0us", "80%", "50.0us", "64%", "44.0us",
                                 "73%", "1.10x"]


def test_decode_mla_from_csv_prints_the_table(tmp_path, capsys):
    """decode.py --mla --from-csv: µs, fraction of copy bandwidth and TFLOP/s per provider
    and point; a sweep's rows left out; the sweep's tile candidates and their spelling."""
    import decode
    import decode_mla

    rows = [dict(gpu="GPU X", torch="2.0", triton="3.0", provider=p, layout=layout,
                 page=page, B=32, H=16, L=8192, S_q=1, splits="auto", tiles="table", us=us,
                 gbps=1.0, frac_copy=f, tflops=t)
            for p, layout, page, us, f, t in [("flashop", "paged", 64, 120.0, 0.81, 40.5),
                                              ("sdpa", "dense", 0, 9000.0, 0.01, 0.5),
                                              ("flashop-sweep", "paged", 64, 1.0, 9.0, 9.0)]]
    decode.write_csv(tmp_path / "m.csv", rows, decode_mla.CSV_HEADER)
    assert decode.main(["--mla", "--from-csv", str(tmp_path / "m.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["B", "H", "L", "S_q", "flashop-p64", "sdpa"]
    assert lines[-1].split() == ["32", "16", "8192", "1", "120.0us", "81%", "40.5TF",
                                 "9000.0us", "1%", "0.5TF"]
    assert decode_mla.parse_tiles("64x32x8x2,16x64x4x2p") == [(64, 32, 8, 2, False),
                                                               (16, 64, 4, 2, True)]
    from flashop._launch.decode_tiles import DecodeTiles
    from flashop._launch.mla import MARGIN, held_bytes
    for rows_ in (16, 32, 128):  # each fits Hopper's shared memory over pages; 64 rows on 8
        tiles_ = decode_mla.candidate_tiles(rows_)
        for m, n, w, s, _ in tiles_:
            assert (held_bytes(DecodeTiles(m, n, w, s), 576, 2, True) <= 232448 - MARGIN
                    and (m < 64 or w == 8))
        # the table's tiles are among them (the sweep that chose them can find them again)
        table = {16: [(16, 64, 4, 5), (16, 64, 4, 3)], 32: [(32, 32, 4, 2)],
                 128: [(64, 64, 8, 2)]}[rows_]
        assert all(t + (False,) in tiles_ for t in table), (rows_, tiles_)


# --- the scripts import without a GPU; switches go through flashop.config ----------------

import importlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

SCRIPTS = ["attention", "modifiers", "varlen", "tune", "kernel_times", "progress", "train_model",
           "decode_mla"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_scripts_import_without_a_gpu(name):
    importlib.import_module(name)


def test_cpu_benchmark_prints_a_row_per_call_and_the_path_it_took(capsys):
    """benchmarks/cpu.py at a tiny shape: a row per call kind with the path taken (SDPA's
    kernels for plain bf16 calls, the blocked path for the others) and its times."""
    import cpu

    cpu.main(["--shape", "1,32,2,16", "--dtypes", "bfloat16", "--reps", "1", "--threads", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[-6] for row in rows] == ["SDPA's", "SDPA's"] + ["blocked"] * 4
    assert all(float(row[-4]) > 0 and float(row[-2]) > 0 for row in rows)  # fwd + bwd


def test_flashop_providers_set_their_switches_only_while_timed():
    from flashop import config
    before = dict(vars(config.settings))
    for name, switches in attention.FLASHOP_VARIANTS.items():
        fn, layout = attention.make_provider(name, 1024, False)
        assert layout == "bnhd" and fn.switches == switches
        with attention.switches_of(fn):
            for key, value in switches.items():
                assert getattr(config.settings, key) == value
        assert dict(vars(config.settings)) == before
    assert attention.DEFAULT_PROVIDERS[0] == "flashop"
    assert set(attention.DEFAULT_PROVIDERS) <= set(attention.PROVIDERS)


def test_no_benchmark_assigns_flashop_module_globals():
    """Switches and tiles are changed with flashop.config.override / flashop._launch.tiles.force,
    never by assigning (or setattr-ing) a flashop module's attributes."""
    assignment = re.compile(r"^\s*(launch|tiles|config|api|ops|flashop)(\.\w+)+\s*=[^=]",
                            re.MULTILINE)
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert not assignment.search(text), path.name
        assert "setattr(" not in text, path.name


def test_tune_parses_tiles_and_names_the_format_on_a_bad_one():
    import tune
    a, b = tune.parse_tiles("128x64x8x3,256x64x8x3xsplit")
    assert (a.BLOCK_M, a.BLOCK_N, a.num_warps, a.num_stages, a.split_m) == (128, 64, 8, 3, False)
    assert (b.BLOCK_M, b.split_m) == (256, True)
    with pytest.raises(ValueError, match="BLOCK_MxBLOCK_NxWARPSxSTAGES"):
        tune.parse_tiles("128x64x8")


def test_line_progress_counts_steps_and_estimates_the_rest():
    import progress
    err, seen = io.StringIO(), []
    bar = progress.LineProgress(range(3), desc="grid", label=lambda i: f"step {i}", file=err)
    for i in bar:
        seen.append(i)
    assert seen == [0, 1, 2]
    lines = err.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "grid: [1/3] step 0", "grid: [2/3] step 1", "grid: [3/3] step 2"]
    assert "left)" in lines[-1]
    err = io.StringIO()
    assert list(progress.LineProgress(iter("ab"), file=err)) == ["a", "b"]  # no length
    assert [line.split(" (")[0] for line in err.getvalue().splitlines()] == ["[1]", "[2]"]


# --- benchmarks/train_model.py: every provider trains the same model ----------------------

import torch  # noqa: E402
from helpers import DEVICE  # noqa: E402

import train_model  # noqa: E402

def _train_model_step(provider, layout, dtype):
    """The first step's loss and gradients of the --tiny model (fresh weights of seed 0) on
    the --tiny batch of ``layout``, with ``provider``'s attention, in ``dtype``."""
    tm = train_model
    cfg = tm.TINY["model"]
    batch = tm.make_batch(cfg, 1, tm.TINY["seq"][0], layout, tm.TINY["docs"], device=DEVICE)
    model = tm.build_model(cfg, provider, "eager", DEVICE, dtype)
    loss = model(batch.tokens, batch.targets, batch.pos, tm.attention_mask(provider, batch))
    loss.backward()
    attn = model.layers[0].attn
    return {"loss": loss.detach(), "dwq": attn.wq.weight.grad, "dwk": attn.wk.weight.grad,
            "dwv": attn.wv.weight.grad}


@pytest.mark.parametrize("layout", ["one", "packed"])
def test_train_model_flashop_trains_the_model_sdpa_trains(layout):
    """From the same weights and batch, flashop's first-step loss and the gradients of the
    first layer's q, k and v projections (through both layers' attention backward) are within
    the accuracy rule of the float64 model's: at most 2x (loss) and 3x (gradients) plain
    PyTorch's fp32 error, plus fp32 rounding noise. Packed, flashop reads cu_seqlens and SDPA
    a block-diagonal causal mask."""
    from flashop.testing import accuracy

    ref = _train_model_step("sdpa", layout, torch.float64)
    plain = _train_model_step("sdpa", layout, torch.float32)
    ours = _train_model_step("flashop", layout, torch.float32)
    for name in ref:
        acc = accuracy(name, ours[name], ref[name], plain[name], 2 if name == "loss" else 3,
                       torch.float32)
        assert acc.ok, acc


def test_train_model_packed_documents_train_as_separate_sequences():
    """The packed layout's loss (SDPA's mask; no target across a document's end) equals that
    of each document trained as a sequence of its own, in float64; rotary positions restart
    at each document."""
    tm = train_model
    cfg = tm.TINY["model"]
    packed = tm.make_batch(cfg, 1, 64, "packed", (3, 3), device=DEVICE)
    lens = packed.doc_lens[0]
    assert len(lens) == 3 and sum(lens) == 64
    assert packed.pos[0].tolist() == [i for n in lens for i in range(n)]
    model = tm.build_model(cfg, "sdpa", "eager", DEVICE, torch.float64)
    loss = model(packed.tokens, packed.targets, packed.pos, tm.attention_mask("sdpa", packed))
    total, count, start = 0.0, 0, 0
    for i, n in enumerate(lens):
        tokens = packed.tokens[:, start:start + n]
        # the next token of the document; after its last, none (the batch's last: the next)
        last = packed.targets[:, -1:] if i == len(lens) - 1 else torch.full_like(tokens[:, :1],
                                                                                 tm.IGNORE)
        targets = torch.cat([tokens[:, 1:], last], 1)
        valid = int((targets != tm.IGNORE).sum())
        if valid:
            total += model(tokens, targets, torch.arange(n, device=DEVICE)[None], None) * valid
        count, start = count + valid, start + n
    torch.testing.assert_close(loss, total / count, rtol=1e-12, atol=0)


def test_train_model_prints_a_row_per_configuration_and_refusals_as_na(tmp_path, capsys):
    """The table and the CSV, with a forced SDPA backend that refuses (cuDNN on the CPU,
    FlashAttention-2's with a mask on a GPU): its row "n/a" with the reason, the rest run."""
    import csv

    tm = train_model
    refused = "sdpa-cudnn" if DEVICE == "cpu" else "sdpa-flash"
    assert tm.main(["--tiny", "--device", DEVICE, "--providers", "sdpa", refused,
                    "--layouts", "packed", "--modes", "eager", "--warmup", "0", "--steps", "1",
                    "--csv", str(tmp_path / "t.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines.index("| mode | seq | layout | provider | tokens/s | ms/step | peak GiB "
                       "| vs best SDPA | first loss | note |")
    ran, na = (line.split(" | ") for line in lines[head + 2:head + 4])
    assert ran[:4] == ["| eager", "64", "packed", "sdpa"] and ran[6:8][1] == "1.00"
    assert float(ran[4]) > 0 and float(ran[8]) > 0
    assert na[3:9] == [refused] + ["n/a"] * 5 and "n/a: " in na[9]
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["sdpa", refused]
    assert f"{float(rows[0]['loss']):.4f}" == ran[8] and rows[1]["note"] == na[9].rstrip(" |")


def test_modifiers_counts_a_chunks_pairs_and_its_share_of_causal():
    """benchmarks/modifiers.py's chunked variant: the pairs causal chunks attend (chunks of 4
    over 8 tokens: twice 1 + 2 + 3 + 4), and its times as shares of flashop's causal time."""
    import modifiers
    assert modifiers.attended_pairs(8, True, (-1, -1)) == 36
    assert modifiers.attended_pairs(8, True, (-1, -1), chunk=4) == 20
    assert modifiers.attended_pairs(8, False, (-1, -1), chunk=4) == 32
    name = modifiers.chunk_variant(4)
    assert name in modifiers.variants(8, 2, 1, "cpu", chunk=4)
    rows = [dict(N=8, provider=provider, variant=variant, ms=ms, **{"pass": "fwd"})
            for provider, variant, ms in (("flashop", "causal", 2.0), ("flashop", name, 0.5),
                                          ("flex", name, 1.0))]
    assert modifiers.chunk_shares(rows, name) == [
        "N=     8 causal chunk 4 flashop  fwd    0.500 ms = 0.250 x flashop's causal (2.000 ms)",
        "N=     8 causal chunk 4 flex     fwd    1.000 ms = 0.500 x flashop's causal (2.000 ms)"]


def test_decode_mla_sweep_times_the_paged_and_the_dense_cache(monkeypatch):
    """decode.py --mla --sweep: each tile and split count over the paged cache and over the
    same cache dense (each key's page id: pages only), every call's output the unforced
    call's, fastest first (the timing stubbed: the calls run once, here under the
    interpreter)."""
    import decode
    import decode_mla

    B, H, L, S_q = 2, 2, 128, 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S_q, H, 576, dtype=torch.float32, generator=gen).to(DEVICE)
    cache = torch.randn(B, L, 1, 576, dtype=torch.float32, generator=gen).to(DEVICE)
    pages = cache.view(B * L // decode_mla.PAGE, decode_mla.PAGE, 1, 576)
    table = torch.arange(B * L // decode_mla.PAGE, dtype=torch.int32).view(B, -1).to(DEVICE)
    lengths = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
    expected = flashop.attention_with_kvcache(q, cache, cache[..., :512],
                                              cache_seqlens=lengths, scale=decode_mla.SCALE)
    outputs, times = [], iter([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])

    def time_us(fn, graph):
        outputs.append(fn())
        return next(times)
    monkeypatch.setattr(decode, "time_us", time_us)
    rows = decode_mla.sweep(flashop, (B, H, L, S_q), (q, cache, pages, table, lengths),
                            [(16, 16, 4, 2, False), (16, 16, 4, 2, True)], [0, 2], "GPU X",
                            1000.0)
    assert [(r["tiles"], r["layout"], r["splits"]) for r in rows] == [
        ("16x16x4x2p", "paged", 2), ("16x16x4x2p", "paged", "auto"), ("16x16x4x2", "dense", 2),
        ("16x16x4x2", "paged", 2), ("16x16x4x2", "dense", "auto"),
        ("16x16x4x2", "paged", "auto")]
    assert len(outputs) == 6
    for out in outputs:  # (the same computation: another split count's merge rounds the
        # fp32 output apart by an ulp or so; a wrong layout or cache is far off)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
