#!/usr/bin/env bash
# The GPU check (docs/performance.md, "GPU check"): on a machine with one CUDA GPU and no package index, in about 8
# minutes,
#   1. prints the machine's versions (python, torch, CUDA, GPU, lightning, transformers, ...) and torch's floor;
#   2. installs what the image lacks from ./wheelhouse (`make gpu-wheels` builds it; scripts/gpu_wheels.py) with
#      `pip --no-index --no-deps`, tp_train itself from this tree, and imports everything the tree imports;
#   3. measures GPT-2 small at tp=1 in bf16, plain and ours, eager and compiled (tp_train/tools/bench/one_device.py):
#      the contenders alternated in 5 rounds (each ratio the median, with its range), a profile of each (busy ms per
#      step, top kernels), and ours' MFU at micro-batches 8, 16 and 32 x 1024;
#   4. runs the tests marked `cuda` (pytest -m cuda, on 8 workers);
#   5. writes gpu_check.json (versions, phases, tests, measurements) and gpu_check.log into OUT_DIR, and prints a
#      summary table. The phases' limits add up to 725 s.
#
#     bash scripts/gpu_check.sh [OUT_DIR]      # OUT_DIR: default $OUT, else ./gpu_check_out
#
# Each phase has its own time limit and a failing phase never stops the next; the JSON is written whatever failed.
# Exit status: 0 when every phase passed, 1 otherwise.
#
# Without a CUDA device it checks the wheelhouse (what CI runs) and says "no CUDA device" in one line: exit 0 when
# the wheelhouse is complete, 1 when not.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# The project's .venv where there is one (here), else python3 (a GPU machine's image: the tree travels without .venv).
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
# Nothing outside the machine can be reached there: no library may try (and wait for) the network.
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
PHASES="$OUT_DIR/phases.tsv"
: > "$PHASES"

# phase NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, records its status and seconds in phases.tsv.
phase() {
    local name=$1 limit=$2 start status
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    status=$?
    [ "$status" -eq 124 ] && echo "=== $name: timed out after ${limit}s"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" >> "$PHASES"
    echo "=== $name: exit $status after $(($(date +%s) - start))s"
    return "$status"
}

phase versions 45 "$PYTHON" scripts/gpu_versions.py "$OUT_DIR/versions.json"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    "$PYTHON" scripts/gpu_wheels.py check "$WHEELHOUSE"
    status=$?
    echo "no CUDA device: the GPU check ran only its wheelhouse check ($([ $status -eq 0 ] && echo passed || echo FAILED))"
    rm -f "$PHASES" "$OUT_DIR/versions.json"
    exit $status
fi

# The tree's modules import from here in any case (subprocesses too), installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
phase install 90 "$PYTHON" scripts/gpu_wheels.py install "$WHEELHOUSE"

phase bench 360 "$PYTHON" -m tp_train.tools.bench.one_device --output "$OUT_DIR/gpu_bench.json"

# pytest-timeout (the image has it) fails a stuck test and lets the rest finish; without it the phase's limit stops all.
per_test=()
"$PYTHON" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 210)
phase tests 230 "$PYTHON" -m pytest -m cuda -n 8 -p no:cacheprovider -q -rA ${per_test[@]+"${per_test[@]}"} \
    --junitxml="$OUT_DIR/cuda_tests.xml" tests/test_cuda_train.py tests/test_cuda_ranks.py

"$PYTHON" scripts/gpu_summary.py "$OUT_DIR"
