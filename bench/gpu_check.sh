#!/bin/bash
# The checks to run on a machine with a CUDA GPU, in order of value, each under a time limit,
# with what they print kept in OUT (default: gpu-check/): the GPU tests, a budget's
# predictions on the GPU, the GPU benchmark, the quantize kernels against the array-API path,
# two GPU sweeps, then the whole suite (failures listed). Run from the repository root:
#
#     bash bench/gpu_check.sh [OUT]
#
# Limits in seconds: T_TESTS, T_BENCH, T_SWEEP, T_SUITE (environment). Needs cupy; torch and
# JAX columns of the benchmark are skipped where they are not installed.
set -u
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    python3 -c "import sys, numpy, cupy; print(sys.version); print('numpy', numpy.__version__, 'cupy', cupy.__version__)"
    nproc
} > "$OUT/machine.txt" 2>&1
stamp machine
timeout "${T_TESTS:-120}" python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests \
    > "$OUT/gpu-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu-tests.txt"; tail -3 "$OUT/gpu-tests.txt"; stamp gpu-tests
timeout "${T_SWEEP:-120}" python3 -m bench.budget_gpu --device cuda --out "$OUT" \
    > "$OUT/budget-gpu.log" 2>&1
echo "rc=$?" >> "$OUT/budget-gpu.log"; stamp budget-gpu
timeout "${T_BENCH:-300}" python3 -m bench.gpu --out "$OUT" --timeout 120 --repeats 3 \
    > "$OUT/bench.log" 2>&1
echo "rc=$?" >> "$OUT/bench.log"; stamp bench
timeout "${T_SWEEP:-120}" python3 -m bench.quantize_gpu --out "$OUT" > "$OUT/quantize-gpu.log" 2>&1
echo "rc=$?" >> "$OUT/quantize-gpu.log"; stamp quantize-gpu
timeout "${T_SWEEP:-120}" python3 -m checkpoint_ad.cli sweep --model rnn --device cuda --quiet \
    --out "$OUT/rnn-budgets" --budgets 3MiB,1MiB > "$OUT/sweep-budgets.log" 2>&1
echo "rc=$?" >> "$OUT/sweep-budgets.log"; stamp sweep-budgets
timeout "${T_SWEEP:-120}" python3 -m checkpoint_ad.cli sweep --model rnn --device cuda --quiet \
    --out "$OUT/rnn-large" --size steps=512 --size batch=512 --size hidden=1024 \
    --size input_size=1024 > "$OUT/sweep-large.log" 2>&1
echo "rc=$?" >> "$OUT/sweep-large.log"; stamp sweep-large
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n $(nproc)")
# shellcheck disable=SC2086  # $workers is empty or two words
timeout "${T_SUITE:-300}" python3 -m pytest -v -rf -p no:cacheprovider $workers tests \
    > "$OUT/full-suite.txt" 2>&1
echo "rc=$?" >> "$OUT/full-suite.txt"; grep -E "FAILED|[0-9]+ passed|[0-9]+ failed" "$OUT/full-suite.txt" | tail -25
stamp suite
