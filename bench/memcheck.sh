#!/usr/bin/env bash
# compute-sanitizer over the CUDA op tests: every turbospec kernel's test cases (test_ops.py, test_layer_ops.py,
# test_tree_attention.py, the CUDA cases only) under memcheck, then racecheck on a smaller subset.
#
#   bash bench/memcheck.sh            # memcheck + racecheck; writes bench/out/memcheck.log
#   TOOLS=memcheck bash bench/memcheck.sh
#   PYTEST_ARGS="--deselect tests/ops/test_tree_attention.py::test_cuda_specific_arguments" bash bench/memcheck.sh
#
# Exit status: 0 when every tool reports no errors and the tests pass; 1 otherwise; 2 when there is
# no compute-sanitizer or no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
if [ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then SAN=/usr/local/cuda/bin/compute-sanitizer; fi
if [ -z "$SAN" ]; then
  echo "memcheck: compute-sanitizer not found (it ships with the CUDA toolkit: /usr/local/cuda/bin)" >&2
  exit 2
fi
if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "memcheck: torch sees no CUDA device" >&2
  exit 2
fi
mkdir -p bench/out
LOG=bench/out/memcheck.log
: > "$LOG"
STATUS=0
for tool in ${TOOLS:-memcheck racecheck}; do
  # memcheck runs without the caching allocator, and a CUDA graph capture cannot cudaMalloc: the
  # graph-capture tests run under racecheck only (memcheck: 4 capture API errors, no bad access).
  if [ "$tool" = memcheck ]; then SEL="cuda and not graph"; else SEL="cuda and not large_vocab and not sampling"; fi
  echo "== $tool: tests/ops/test_ops.py tests/ops/test_tree_attention.py tests/ops/test_layer_ops.py -k '$SEL'" | tee -a "$LOG"
  # PYTORCH_NO_CUDA_MEMORY_CACHING: every allocation is its own cudaMalloc, so an out-of-bounds
  # access is not hidden inside a larger cached block.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python -m pytest tests/ops/test_ops.py tests/ops/test_tree_attention.py tests/ops/test_layer_ops.py -q -n 0 -x -k "$SEL" ${PYTEST_ARGS:-} >> "$LOG" 2>&1
  rc=$?
  tail -n 3 "$LOG"
  if [ "$rc" -ne 0 ]; then echo "== $tool: FAILED (exit $rc; see $LOG)"; STATUS=1; else echo "== $tool: clean"; fi
done
exit "$STATUS"
