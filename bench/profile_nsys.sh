#!/usr/bin/env bash
# Nsight Systems timeline of turbospec's end-to-end decoding on a GPU: the engine's NVTX ranges
# (draft / verify / accept / compact, from turbospec.ops.nvtx) and the CUDA kernels under them, including
# the kernels inside CUDA-graph replays (--cuda-graph-trace=node).
#
# One nsys process per system: bench/bench_gpu.py builds the random-weight model, does a warm-up
# generation, then wraps the timed generation in cudaProfilerStart/Stop (--cuda-profiler-range);
# nsys records only that range (unless --full-capture). Then `nsys stats` writes the NVTX range
# summary, the NVTX ranges projected onto the GPU, the CUDA kernel summary, the kernels per NVTX
# range and the CUDA API summary as CSV files next to the report.

usage() {
  cat <<'EOF'
usage: bench/profile_nsys.sh [options] [-- extra bench_gpu.py arguments]

Profile turbospec's end-to-end decoding with Nsight Systems (needs a CUDA GPU and `nsys`).

options:
  --model NAME          smollm2_135m (default) or llama3_8b (same as --8b)
  --8b                  profile the Llama-3-8B-shaped model
  --systems LIST        bench_gpu.py e2e systems, one nsys run each
                        (default: smollm2_135m: ts_graphs,ts_eagle; llama3_8b: ts_graphs,ts_ngram)
  --max-new-tokens N    tokens generated in the profiled run (default 64)
  --prompt-len N        random prompt tokens (default 128)
  --out-dir DIR         where reports and CSVs go (default bench/out)
  --full-capture        record the whole process, not only the timed generation (use it if the
                        kernel summary lacks the kernels inside graph replays: the CUDA graphs are
                        captured before the capture range opens, and an nsys that traces only
                        graphs it saw being created shows such replays as whole graphs)
  -h, --help            this text

environment: NSYS (default: nsys), PYTHON (default: python)

outputs, per system S:  DIR/nsys_<model>_<S>.nsys-rep (open in the Nsight Systems GUI),
  DIR/nsys_<model>_<S>_<report>.csv for the reports nvtx_sum, nvtx_gpu_proj_sum,
  cuda_gpu_kern_sum, nvtx_kern_sum, cuda_api_sum, and DIR/nsys_<model>_<S>.bench.md (bench_gpu's own
  report of the run).

examples:
  bench/profile_nsys.sh
  bench/profile_nsys.sh --8b --max-new-tokens 32
  bench/profile_nsys.sh --systems ts_medusa -- --dtype float16
EOF
}

MODEL=smollm2_135m
SYSTEMS=""
MAX_NEW=64
PROMPT_LEN=128
OUT_DIR=""
FULL=0
EXTRA=()

need_value() {  # $1 option, $2 number of remaining arguments
  if [ "$2" -lt 2 ]; then
    echo "profile_nsys.sh: $1 needs a value" >&2
    exit 2
  fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --model) need_value "$1" $#; MODEL="$2"; shift 2 ;;
    --8b) MODEL=llama3_8b; shift ;;
    --systems) need_value "$1" $#; SYSTEMS="$2"; shift 2 ;;
    --max-new-tokens) need_value "$1" $#; MAX_NEW="$2"; shift 2 ;;
    --prompt-len) need_value "$1" $#; PROMPT_LEN="$2"; shift 2 ;;
    --out-dir) need_value "$1" $#; OUT_DIR="$2"; shift 2 ;;
    --full-capture) FULL=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "profile_nsys.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

case "${BASH_SOURCE[0]}" in
  */*) HERE="${BASH_SOURCE[0]%/*}" ;;
  *) HERE=. ;;
esac
. "$HERE/tools.sh"
require_tool profile_nsys.sh NSYS nsys "the Nsight Systems CLI" \
  "Install Nsight Systems (CUDA toolkits ship it as nsight-systems-*/bin/nsys) and put it on PATH."
require_tool profile_nsys.sh PYTHON python "the Python interpreter" ""

case "$MODEL" in
  smollm2_135m) : "${SYSTEMS:=ts_graphs,ts_eagle}" ;;
  llama3_8b) : "${SYSTEMS:=ts_graphs,ts_ngram}" ;;
  *) echo "profile_nsys.sh: --model must be smollm2_135m or llama3_8b, got '$MODEL'" >&2; exit 2 ;;
esac

ROOT="$(cd "$HERE/.." && pwd)" || exit 1
cd "$ROOT" || exit 1
: "${OUT_DIR:=bench/out}"
mkdir -p "$OUT_DIR" || exit 1

# `nsys stats` report names changed in 2023 (nvtxsum -> nvtx_sum ...): try the new name, then the old.
REPORTS=("nvtx_sum:nvtxsum" "nvtx_gpu_proj_sum" "cuda_gpu_kern_sum:gpukernsum" "nvtx_kern_sum:nvtxkernsum"
         "cuda_api_sum:cudaapisum")

write_stats() {  # $1 report file, $2 output stem
  local spec name ok
  for spec in "${REPORTS[@]}"; do
    ok=0
    for name in ${spec//:/ }; do
      if "$NSYS" stats --force-export=true --report "$name" --format csv --output "$2" "$1" \
           >/dev/null 2>"$2.stats_$name.err"; then
        ok=1
        rm -f "$2.stats_$name.err"
        echo "wrote $2_$name.csv"
        break
      fi
    done
    if [ "$ok" = 0 ]; then
      echo "profile_nsys.sh: warning: nsys stats could not produce the '${spec%%:*}' report (see $2.stats_*.err)" >&2
    fi
  done
}

check_ranges() {  # $1 output stem: which engine NVTX ranges the trace holds
  local csv name found="" missing=""
  csv="$(ls "$1"_nvtx_sum.csv "$1"_nvtxsum.csv 2>/dev/null | head -n 1)"
  if [ -z "$csv" ]; then
    echo "profile_nsys.sh: warning: no NVTX summary CSV for $1" >&2
    return
  fi
  for name in draft verify accept compact; do
    if grep -qw "$name" "$csv"; then found="$found $name"; else missing="$missing $name"; fi
  done
  echo "engine NVTX ranges found:${found:- none}; missing:${missing:- none}"
  if [ -n "$missing" ]; then
    echo "  (draft needs a drafter; compact needs a tree drafter such as ts_eagle / ts_medusa)"
  fi
}

status=0
for SYS in ${SYSTEMS//,/ }; do
  STEM="$OUT_DIR/nsys_${MODEL}_${SYS}"
  CAPTURE=(--capture-range=cudaProfilerApi --capture-range-end=stop)
  if [ "$FULL" = 1 ]; then CAPTURE=(); fi
  echo "== nsys: $MODEL $SYS -> $STEM.nsys-rep"
  "$NSYS" profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node --sample=none --cpuctxsw=none \
      "${CAPTURE[@]}" --force-overwrite=true --output "$STEM" \
      "$PYTHON" bench/bench_gpu.py --device cuda --sections e2e --models "$MODEL" --systems "$SYS" \
      --prompt-len "$PROMPT_LEN" --max-new-tokens "$MAX_NEW" --repeats 1 --cuda-profiler-range \
      --out "$STEM.bench.md" "${EXTRA[@]}"
  rc=$?
  if [ "$rc" != 0 ]; then
    echo "profile_nsys.sh: nsys profile failed for $SYS (exit $rc)" >&2
    status=$rc
    continue
  fi
  if [ ! -f "$STEM.nsys-rep" ]; then
    echo "profile_nsys.sh: nsys wrote no report $STEM.nsys-rep (on some VMs, e.g. Firecracker, nsys records nothing)" >&2
    status=1
    continue
  fi
  write_stats "$STEM.nsys-rep" "$STEM"
  check_ranges "$STEM"
  for name in nvtx_sum cuda_gpu_kern_sum; do
    echo "-- $name ($SYS)"
    "$NSYS" stats --report "$name" --format table "$STEM.nsys-rep" 2>/dev/null | head -n 40
  done
done
exit "$status"
