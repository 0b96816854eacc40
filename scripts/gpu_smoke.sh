#!/usr/bin/env bash
# The GPU path in one command (issue 30): tests/test_cuda.py on this machine's GPUs, then a summary
# to paste into an issue or docs/gpus.md.
#
#     scripts/gpu_smoke.sh                  # from anywhere; N = 1, and N = 2 too with 2+ GPUs
#     scripts/gpu_smoke.sh -k offload       # extra arguments go to pytest
#
# The summary: the machine (torch, CUDA, NCCL, GPUs); per stage, offload setting and dtype, the
# device model states of the default GPT by the formula, by engine.memory() and as CUDA's allocator
# frees them, and the allocator's peak (max_memory_allocated) next to engine.memory()'s peak plus the
# activations; how far offload takes the device bytes down (allocator, engine.memory(), formula);
# with 2+ GPUs, how long stage 3's all-gathers ran beside compute with and without prefetch; the
# bench table at N = 1 in fp32, every pair (test_bench_runs_every_pair_on_one_gpu); pytest's result
# line; then `python -m minizero.bench --device cuda --dtype bf16`'s table: minizero alone (the peers
# run in fp32 only), tokens/s and MFU against the GPU's bf16 GEMM peak. The whole log stays in
# $TMPDIR. Exit status: pytest's, or else the bench's (2: no CUDA).
# Meant to take under 5 minutes on one GPU; pytest is stopped after 9 minutes, the bench after 2.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"      # this checkout's minizero, installed or not
# $PYTHON, else python, else python3 (CUDA images often have only python3)
python=${PYTHON:-$(command -v python || command -v python3)}
[ -n "$python" ] || { echo "gpu_smoke: no python or python3 on PATH (set PYTHON)" >&2; exit 2; }

machine=$("$python" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu_smoke: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU")
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY
) || exit 2

log="${TMPDIR:-/tmp}/minizero-gpu-smoke-$(date +%Y%m%d-%H%M%S).log"
echo "gpu_smoke: $machine; log: $log"
start=$SECONDS
timeout 540 "$python" -m pytest tests/test_cuda.py -q -s -rfEsxX -p no:cacheprovider "$@" 2>&1 \
    | tee "$log"
status=${PIPESTATUS[0]}
pytest_s=$((SECONDS - start))
bench=(-m minizero.bench --device cuda --dtype bf16 --steps 4 --repeats 1 --quiet)
timeout 120 "$python" "${bench[@]}" > "$log.bench" 2>&1
bench_status=$?

echo
echo "=== minizero GPU smoke summary: $machine ==="
grep -o 'gpu-smoke: .*' "$log" | sed 's/^gpu-smoke: //'
grep -E '^(FAILED|ERROR|XPASS|XFAIL)' "$log"
result=$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | xargs)
echo "pytest: ${result:-no result line (exit status $status; see the log)}; ${pytest_s} s"
[ "$status" = 124 ] && echo "gpu_smoke: stopped after 540 s"
echo
echo "python ${bench[*]}: exit status $bench_status, $((SECONDS - start - pytest_s)) s"
cat "$log.bench"
[ "$status" = 0 ] && status=$bench_status
exit "$status"
