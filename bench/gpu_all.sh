#!/usr/bin/env bash
# Everything a GPU session runs, in one call (the lent machine stays warm only briefly):
# build the CUDA extension, the CUDA tests, compute-sanitizer, op benchmarks, end-to-end GPU
# benchmarks and an ncu profile. Results go to $OUT (default bench/out/gpu_all) and are printed.
#
#   STAGES="build test memcheck ops" bash bench/gpu_all.sh     # ~5 min: one device call
#   STAGES="build e2e" bash bench/gpu_all.sh                    # SmolLM2-shaped end to end
#   STAGES="build e2e8b ncu" bash bench/gpu_all.sh              # Llama-3-8B-shaped, ncu
#
# Stages: build, test, memcheck, ops, e2e, e2e8b, ncu (default: all, which may pass the device
# tool's 10-minute limit for one command). A failing stage is reported and the next one runs; the
# exit status is 1 when any stage failed. The build is incremental: repeating it costs seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu_all}"
mkdir -p "$OUT" bench/out
STAGES="${STAGES:-build test memcheck ops e2e e2e8b ncu}"
FAILED=""
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/machine.txt"

stage() {  # stage NAME COMMAND...: run, log to $OUT/NAME.log, keep going on failure
  local name="$1"; shift
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name: $*"
  local start=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc in $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
}

export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" TURBOSPEC_CUDA=1
stage build python setup.py build_ext --inplace
python -c 'import turbospec.ops as o; print("kernels:", o.kernels_available())' | tee -a "$OUT/machine.txt"
# CUDA cases of every test file (the CPU cases ran in CI); the emulator is not needed here.
stage test env TURBOSPEC_SKIP_CUDA_EMU=1 python -m pytest tests -q -rs -k "cuda" -p no:cacheprovider
stage memcheck bash bench/memcheck.sh
stage ops python bench/bench_ops.py --device cuda --iters 200
stage e2e python bench/bench_gpu.py --device cuda --models smollm2_135m --out "$OUT/gpu_smollm2.md"
stage e2e8b python bench/bench_gpu.py --device cuda --models llama3_8b --out "$OUT/gpu_llama3_8b.md"
stage ncu bash bench/profile_ncu.sh
cp -f bench/out/*.md bench/out/*.json bench/out/*.csv "$OUT"/ 2>/dev/null || true
if [ -n "$FAILED" ]; then echo "gpu_all: FAILED stages:$FAILED"; exit 1; fi
echo "gpu_all: every stage passed"
