#!/usr/bin/env bash
# The GPU checks in one go: the test suite on the real kernels (Hypothesis `gpu`
# profile unless HYPOTHESIS_PROFILE says otherwise), the self-check, the benchmark grid and
# the modifiers' and packed documents' benchmarks.
# Logs and CSVs go to $OUT (or ./gpu-check); a short summary is printed last.
#   bash benchmarks/gpu_check.sh [--quick]     (--quick: ci profile, N = 1k and 4k)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
quick=${1:-}
if [ "$quick" = "--quick" ]; then
    export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
    bench_args=(--quick --warmup 10 --rep 50)
else
    bench_args=(--warmup 10 --rep 50)
fi
gpu=$(python -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")

timeout -s INT "${TEST_SECONDS:-420}" python -m pytest tests -n 8 -q -p no:warnings -rfE \
    --tb=short > "$out/pytest.log" 2>&1
echo "pytest rc=$?" >> "$out/pytest.log"
timeout 200 python -m flashop > "$out/main.log" 2>&1
echo "main rc=$?" >> "$out/main.log"
timeout "${BENCH_SECONDS:-420}" python benchmarks/attention.py "${bench_args[@]}" \
    --providers flashop,flashop-atomic,sdpa-flash,sdpa-cudnn,sdpa-mem,flex \
    --out "$out/$(date +%F)-$gpu.csv" --plot "$out/$(date +%F)-$gpu.png" > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/bench.log"
timeout "${BENCH_SECONDS:-420}" python benchmarks/modifiers.py \
    --out "$out/$(date +%F)-$gpu-modifiers.csv" > "$out/modifiers.log" 2>&1
echo "modifiers rc=$?" >> "$out/modifiers.log"
timeout "${BENCH_SECONDS:-420}" python benchmarks/varlen.py --cuda-graph \
    --out "$out/$(date +%F)-$gpu-varlen.csv" > "$out/varlen.log" 2>&1
echo "varlen rc=$?" >> "$out/varlen.log"

echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$out/pytest.log" | tail -15
echo "== python -m flashop"; grep -E "FAIL|self-check|rc=" "$out/main.log"
echo "== benchmark"; sed -n '/^TFLOP/,$p' "$out/bench.log"; tail -1 "$out/bench.log"
echo "== modifiers"; grep -E "^N=|rc=" "$out/modifiers.log"
echo "== packed documents"; grep -E "^docs|rc=" "$out/varlen.log"
