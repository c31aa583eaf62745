#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu for sm_80 and sm_90 with nvcc, without a GPU.
#
# Each file is compiled (nvcc -c, device code for both architectures, host code with gcc) against
# the headers of the installed torch. A CPU-only torch wheel ships every header these files use
# (torch/library.h, ATen core, c10/cuda/CUDAStream.h, CUDAGuard.h, CUDAException.h) except the
# generated c10/cuda/impl/cuda_cmake_macros.h, which only defines an export macro: the check then
# sets C10_CUDA_NO_CMAKE_CONFIGURE_FILE. The objects are then linked together (ld -r) to catch
# symbols defined twice; linking against torch needs a CUDA build of torch (libc10_cuda), which this
# check does not do (a GPU machine builds the real extension with setup.py).
#
# Exit status: 0 if every file compiles (or nvcc is absent: nothing to check), 1 otherwise.
# Env: NVCC (default: nvcc on PATH), PYTHON (default: python), JOBS (default: 2).
set -uo pipefail

cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
PYTHON="${PYTHON:-python}"
JOBS="${JOBS:-2}"

if [ -z "$NVCC" ]; then
  echo "compile_cuda: nvcc not found; no CUDA compile check"
  exit 0
fi

read -r -a TORCH_INCLUDES < <("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))')
FLAGS=(-std=c++20 -c -O3 --expt-relaxed-constexpr --resource-usage -Xcompiler -fPIC
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ -diag-suppress 3306)
for inc in "${TORCH_INCLUDES[@]}"; do FLAGS+=(-I"$inc"); done
if [ ! -f "${TORCH_INCLUDES[0]}/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  FLAGS+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)
  echo "compile_cuda: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') has no generated CUDA macros header (a CPU build): compiling with -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
SOURCES=(csrc/cuda/*.cu)
echo "compile_cuda: $("$NVCC" --version | tail -n 1)"
echo "compile_cuda: ${#SOURCES[@]} files x {sm_80, sm_90}, $JOBS at a time"

compile_one() {
  local src="$1" name start status
  name="$(basename "$src" .cu)"
  start=$(date +%s)
  "$NVCC" "${FLAGS[@]}" "$src" -o "$OUT/$name.o" > "$OUT/$name.log" 2>&1
  status=$?
  echo "$status $(( $(date +%s) - start ))" > "$OUT/$name.status"
}

START=$(date +%s)
running=0
for src in "${SOURCES[@]}"; do
  compile_one "$src" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait

FAILED=0
for src in "${SOURCES[@]}"; do
  name="$(basename "$src" .cu)"
  read -r status seconds < "$OUT/$name.status"
  if [ "$status" -eq 0 ]; then
    echo "compile_cuda: ok     $src (${seconds}s)"
    # one line per kernel and architecture: registers, spills, shared memory
    awk '/Compiling entry function/ { match($0, /for .sm_[0-9]+./); arch = substr($0, RSTART + 5, RLENGTH - 6);
                                      fn = $7; gsub("\047", "", fn) }
         /bytes spill stores/ { spills = $5 " B spilled" }
         /Used [0-9]+ registers/ { printf "compile_cuda:          %s %s: %s registers, %s\n", arch, fn, $5, spills }' \
      "$OUT/$name.log" | { command -v c++filt > /dev/null && c++filt || cat; } |
      sed -E 's/turbospec::gpu::\(anonymous namespace\):://g; s/^(compile_cuda: +sm_[0-9]+ )(void )?([A-Za-z_0-9<>]+)\(.*\): /\1\3: /'
  else
    echo "compile_cuda: FAILED $src (${seconds}s):"
    grep -v "^$" "$OUT/$name.log" | tail -n 40
    FAILED=1
  fi
done
if [ "$FAILED" -eq 0 ]; then
  # The objects go into one library: a relocatable link catches symbols defined in two files.
  if ld -r -o "$OUT/all.o" "$OUT"/*.o > "$OUT/link.log" 2>&1; then
    echo "compile_cuda: ok     relocatable link of the ${#SOURCES[@]} objects (no duplicate symbols)"
  else
    echo "compile_cuda: FAILED relocatable link of the ${#SOURCES[@]} objects:"
    tail -n 20 "$OUT/link.log"
    FAILED=1
  fi
fi
echo "compile_cuda: done in $(( $(date +%s) - START ))s"
exit "$FAILED"
