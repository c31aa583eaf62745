#!/usr/bin/env bash
# Build AND link the whole extension (CPU + CUDA kernels) against a CUDA build of torch, without a
# GPU: proves that every CUDA entry point compiles with torch's real CUDA headers and that the
# shared object links (no undefined or duplicate symbols), and that importing it registers a CUDA
# kernel for every op. Nothing runs on a GPU here.
#
# How (see ../shared/ENVIRONMENT.md): a separate venv with torch 2.14.1 (a +cu130 wheel, ~5 GB with
# its nvidia packages); CUDA_HOME = the toolkit the machine's nvcc belongs to; the cusparse/cublas
# headers ATen/cuda includes come from the nvidia.cu13 Python package; safetensors because importing
# turbospec (to list the registered kernels) loads the head checkpoint code. Built for sm_80 and
# sm_90 (what compile_cuda.sh checks; CI runs that only when this script cannot get a CUDA torch).
#
# The CPU sources are compiled at -O0 (TURBOSPEC_BUILD_OPT): nothing runs here, and the optimised
# build of the same sources is the one the tests use.
#
# `link_cuda.sh --prepare` only creates the venv and installs the CUDA torch (CI runs it in the
# background, with LINK_CUDA_VENV set, while it builds and compile-checks).
#
# Exit status: 0 built, linked and registered; 1 a compile / link / registration failure; 0 with a
# "skipped" line when there is no nvcc or the CUDA torch cannot be installed (no network).
# Env: LINK_CUDA_VENV (default: a temp dir), TORCH_CUDA_VERSION (default 2.14.1), MAX_JOBS (default 2).
set -uo pipefail
PREPARE=0
if [ "${1:-}" = "--prepare" ]; then
  PREPARE=1
  [ -n "${LINK_CUDA_VENV:-}" ] || { echo "link_cuda: --prepare needs LINK_CUDA_VENV (where the venv is kept)"; exit 1; }
fi
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ]; then echo "link_cuda: skipped (no nvcc)"; exit 0; fi
# nvcc on PATH may be a wrapper script: find the toolkit folder it runs
REAL="$(sed -n 's/^exec \([^ ]*nvcc\) .*/\1/p' "$NVCC" 2>/dev/null | head -n 1)"
CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "${REAL:-$NVCC}")")}"
VENV="${LINK_CUDA_VENV:-$(mktemp -d)/venv}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"; [ -z "${LINK_CUDA_VENV:-}" ] && rm -rf "$(dirname "$VENV")"' EXIT
START=$(date +%s)
echo "link_cuda: CUDA_HOME=$CUDA_HOME ($("$NVCC" --version | tail -n 1))"

if [ ! -x "$VENV/bin/python" ]; then
  python -m venv "$VENV" || { echo "link_cuda: FAILED to create a venv"; exit 1; }
fi
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  if ! "$VENV/bin/pip" install -q "torch==${TORCH_CUDA_VERSION:-2.14.1}" setuptools ninja numpy safetensors > "$WORK/pip.log" 2>&1; then
    echo "link_cuda: skipped (could not install a CUDA torch: $(tail -n 1 "$WORK/pip.log"))"
    exit 0
  fi
fi
TORCH_V="$("$VENV/bin/python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)"
CU13_INC="$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))')"
echo "link_cuda: torch $TORCH_V installed in $(( $(date +%s) - START ))s"
[ "$PREPARE" -eq 1 ] && exit 0

# Build a copy of the sources, so that the checkout's own (CPU) turbospec._C is left alone.
mkdir -p "$WORK/src"
cp -r setup.py csrc turbospec "$WORK/src/"
rm -f "$WORK/src/turbospec/"_C*.so
cd "$WORK/src"
if ! CUDA_HOME="$CUDA_HOME" CPATH="$CU13_INC${CPATH:+:$CPATH}" TORCH_CUDA_ARCH_LIST="8.0;9.0" TURBOSPEC_CUDA=1 TURBOSPEC_BUILD_OPT=-O0 \
     MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" setup.py build_ext --inplace > "$WORK/build.log" 2>&1; then
  echo "link_cuda: FAILED to build/link the CUDA extension:"
  grep -E "error|Error|undefined" "$WORK/build.log" | head -n 40
  tail -n 20 "$WORK/build.log"
  exit 1
fi
echo "link_cuda: built $(ls turbospec/_C*.so) in $(( $(date +%s) - START ))s"
"$VENV/bin/python" - <<'PY' 2>&1 | grep -v -i "numpy\|warn\|_conversion_method"
import sys
import torch
import turbospec.ops as ops
ops_with_cuda = ("build_tree", "verify", "compact_kv", "tree_attention", "add_rms_norm", "silu_mul", "rope_cache")
missing = [op for op in ops_with_cuda if not torch._C._dispatch_has_kernel_for_dispatch_key(f"turbospec::{op}", "CUDA")]
print(f"link_cuda: kernels_available() = {ops.kernels_available()}; CUDA kernels for {', '.join(ops_with_cuda)}:",
      "all registered" if not missing else f"MISSING {missing}")
sys.exit(1 if missing else 0)
PY
STATUS=${PIPESTATUS[0]}
[ "$STATUS" -eq 0 ] && echo "link_cuda: ok in $(( $(date +%s) - START ))s" || echo "link_cuda: FAILED (registration)"
exit "$STATUS"
