#!/usr/bin/env bash
# Nsight Compute profile of turbospec's CUDA op kernels (verify, build_tree, compact_kv,
# tree_attention) as bench/bench_ops.py --device cuda launches them: one .ncu-rep with the chosen
# section set, plus CSV exports (every metric per kernel; ncu's per-kernel summary; a short table of
# duration, DRAM / SM throughput and launch shape).

usage() {
  cat <<'EOF'
usage: bench/profile_ncu.sh [options]

Profile turbospec's op kernels with Nsight Compute (needs a CUDA GPU, `ncu`, and the turbospec
extension built with its CUDA kernels: `TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace`).

options:
  --regex RE        kernel-name regex (default 'verify|build_tree|compact_kv|tree_attention')
  --set NAME        ncu section set: full (default), detailed, basic, ...
  --launch-skip N   matching launches to skip first (default 0; ncu flushes caches before each
                    profiled launch, so warm-up launches measure the same)
  --launch-count N  matching launches to profile (default 100: every launch of bench_ops --iters 1)
  --iters N         bench_ops.py --iters (default 1: 3 warm-up + 1 timed call per op shape)
  --name NAME       report name (default ncu_ops)
  --out-dir DIR     where outputs go (default bench/out)
  -h, --help        this text

environment: NCU (default: ncu), PYTHON (default: python)

outputs: DIR/NAME.ncu-rep (open in the Nsight Compute GUI), DIR/NAME_details.csv (every section's
metrics per launch), DIR/NAME_summary.csv (per-kernel summary), DIR/NAME_key_metrics.csv (duration,
DRAM and SM throughput in % of peak, grid and block size, registers per thread).
EOF
}

REGEX='verify|build_tree|compact_kv|tree_attention'
SET=full
SKIP=0
COUNT=100
ITERS=1
NAME=ncu_ops
OUT_DIR=""

need_value() {  # $1 option, $2 number of remaining arguments
  if [ "$2" -lt 2 ]; then
    echo "profile_ncu.sh: $1 needs a value" >&2
    exit 2
  fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --regex) need_value "$1" $#; REGEX="$2"; shift 2 ;;
    --set) need_value "$1" $#; SET="$2"; shift 2 ;;
    --launch-skip) need_value "$1" $#; SKIP="$2"; shift 2 ;;
    --launch-count) need_value "$1" $#; COUNT="$2"; shift 2 ;;
    --iters) need_value "$1" $#; ITERS="$2"; shift 2 ;;
    --name) need_value "$1" $#; NAME="$2"; shift 2 ;;
    --out-dir) need_value "$1" $#; OUT_DIR="$2"; shift 2 ;;
    *) echo "profile_ncu.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

case "${BASH_SOURCE[0]}" in
  */*) HERE="${BASH_SOURCE[0]%/*}" ;;
  *) HERE=. ;;
esac
. "$HERE/tools.sh"
require_tool profile_ncu.sh NCU ncu "the Nsight Compute CLI" \
  "Install Nsight Compute (CUDA toolkits ship it as nsight-compute-*/ncu) and put it on PATH."
require_tool profile_ncu.sh PYTHON python "the Python interpreter" ""

ROOT="$(cd "$HERE/.." && pwd)" || exit 1
cd "$ROOT" || exit 1
: "${OUT_DIR:=bench/out}"
mkdir -p "$OUT_DIR" || exit 1
STEM="$OUT_DIR/$NAME"

# Without the CUDA kernels bench_ops runs the pure-torch reference and nothing would match.
"$PYTHON" - <<'EOF'
import sys, warnings
warnings.simplefilter("ignore")
import torch
import turbospec
if not torch.cuda.is_available():
    sys.exit("profile_ncu.sh: torch sees no CUDA device; ncu needs a GPU")
if not turbospec.kernels_available()["cuda"]:
    sys.exit("profile_ncu.sh: turbospec's CUDA kernels are not built (kernels_available()['cuda'] is False); "
             "build them first: TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace")
EOF
[ $? = 0 ] || exit 1

echo "== ncu --set $SET on kernels matching /$REGEX/ (skip $SKIP, count $COUNT) -> $STEM.ncu-rep"
"$NCU" --target-processes all --kernel-name "regex:$REGEX" --launch-skip "$SKIP" --launch-count "$COUNT" \
    --set "$SET" --force-overwrite --export "$STEM" \
    "$PYTHON" bench/bench_ops.py --device cuda --iters "$ITERS"
rc=$?
if [ "$rc" != 0 ]; then
  echo "profile_ncu.sh: ncu failed (exit $rc). ERR_NVGPUCTRPERM means GPU performance counters are" >&2
  echo "  restricted to root on this machine (run as root or set NVreg_RestrictProfilingToAdminUsers=0)." >&2
  exit "$rc"
fi
if [ ! -f "$STEM.ncu-rep" ]; then
  echo "profile_ncu.sh: ncu wrote no report: no kernel launch matched /$REGEX/ (check the kernel names" >&2
  echo "  with: $NCU --print-summary per-kernel $PYTHON bench/bench_ops.py --device cuda --iters 1)" >&2
  exit 1
fi

status=0
"$NCU" --import "$STEM.ncu-rep" --csv --page details > "${STEM}_details.csv" || status=1
"$NCU" --import "$STEM.ncu-rep" --csv --print-summary per-kernel > "${STEM}_summary.csv" || status=1
if ! "$NCU" --import "$STEM.ncu-rep" --csv --page raw --metrics \
    gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread \
    > "${STEM}_key_metrics.csv"; then
  echo "profile_ncu.sh: warning: the key-metrics CSV could not be exported (the report is fine)" >&2
fi
if [ "$status" != 0 ]; then
  echo "profile_ncu.sh: exporting CSVs from $STEM.ncu-rep failed" >&2
fi
echo "wrote $STEM.ncu-rep ${STEM}_details.csv ${STEM}_summary.csv ${STEM}_key_metrics.csv"
echo "-- per-kernel summary"
head -n 40 "${STEM}_summary.csv"
exit "$status"
