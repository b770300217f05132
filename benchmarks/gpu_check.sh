#!/usr/bin/env bash
# The GPU checks in one go: the test suite on the real kernels (Hypothesis `gpu`
# profile unless HYPOTHESIS_PROFILE says otherwise), the self-check, the benchmark grid and
# the modifiers' and packed documents' benchmarks, the forward's and the dK/dV kernel's
# variants and ablations, and the host time of an eager call, layer by layer.
# Logs and the CSV go to $OUT (or ./gpu-check); a short summary is printed last.
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
timeout 300 python benchmarks/fwd_variants.py --D 128,64 \
    --out "$out/$(date +%F)-$gpu-fwd-variants.csv" > "$out/variants.log" 2>&1
echo "variants rc=$?" >> "$out/variants.log"
timeout 300 python benchmarks/bwd_variants.py --D 128 \
    --out "$out/$(date +%F)-$gpu-bwd-variants.csv" > "$out/bwd-variants.log" 2>&1
echo "bwd variants rc=$?" >> "$out/bwd-variants.log"
timeout 200 python benchmarks/host_time.py --profile 0 > "$out/host-time.log" 2>&1
echo "host time rc=$?" >> "$out/host-time.log"

echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$out/pytest.log" | tail -15
echo "== python -m flashop"; grep -E "FAIL|self-check|rc=" "$out/main.log"
echo "== benchmark"; sed -n '/^TFLOP/,$p' "$out/bench.log"; tail -1 "$out/bench.log"
echo "== modifiers"; grep -E "^N=|rc=" "$out/modifiers.log"
echo "== packed documents"; grep -E "^docs|rc=" "$out/varlen.log"
echo "== forward variants"; sed -n '/best tiles/,$p' "$out/variants.log"; tail -1 "$out/variants.log"
echo "== backward (dK/dV) variants"; sed -n '/best tiles/,$p' "$out/bwd-variants.log"
tail -1 "$out/bwd-variants.log"
echo "== host time per eager call"; tail -n +2 "$out/host-time.log"
