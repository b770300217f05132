"""The benchmark script's results-file reading (benchmarks/attention.py --from-csv), which
needs no GPU: a grid run in parts is tabulated and plotted from its CSV files."""

import sys
from pathlib import Path

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
    assert [r["D"] for r in attention.read_results([tmp_path / "a.csv"], heads_dims=[64])] == [64]
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


def test_from_csv_with_nothing_selected_fails(tmp_path, capsys):
    _write(tmp_path / "a.csv")
    assert attention.main(["--from-csv", str(tmp_path / "a.csv"), "--heads-dims", "256"]) == 1
    assert "no rows selected" in capsys.readouterr().err
