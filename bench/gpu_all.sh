#!/usr/bin/env bash
# Everything a GPU session runs, in one call (the lent machine stays warm only briefly):
# build the CUDA extension, the CUDA tests, compute-sanitizer, op benchmarks, end-to-end GPU
# benchmarks and an ncu profile. Results go to $OUT (default bench/out/gpu_all) and are printed.
#
#   STAGES="build test memcheck ops" bash bench/gpu_all.sh     # ~5 min: one device call
#   STAGES="build e2e" bash bench/gpu_all.sh                    # SmolLM2-shaped end to end
#   STAGES="build e2e8b ncu" bash bench/gpu_all.sh              # Llama-3-8B-shaped, ncu
#
#   LAST_CALL=.gpu_carry/call3 STAGES="build test e2ereal" bash bench/gpu_all.sh
#                                              # real SmolLM2 weights (bench/gpu_carry.py's last call)
#
# Stages: build, test, memcheck, profile, ops, e2e, e2e8b, e2ereal, ncu (default: all but e2ereal,
# which needs the carried weights; all may pass the device tool's 10-minute limit for one command).
# A failing stage is reported and the next one runs; the exit status is 1 when any stage failed. The build is incremental: repeating it costs seconds.
#
# Env: STAGES; T_<stage> (seconds, e.g. T_test=180: the stage is killed past it and counted as
# failed, so one hang cannot eat the whole call; default 600); PACK=FILE.tgz (after every stage,
# pack all of $OUT's logs into that one file: for a device tool that returns only a few files);
# TEST_PATHS (the test stage's files, default tests); TEST_ARGS (more pytest options for it); PROFILE_ARGS (bench/profile_step.py's);
# E2E_ARGS / E2E8B_ARGS (more bench_gpu.py options for those stages, e.g. "--sections steps");
# TURBOSPEC_BUILD_OPT (-O1 builds the CPU kernels faster; they are not what a GPU run measures).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu_all}"
mkdir -p "$OUT" bench/out
# Some images have only python3: the stage scripts call `python`.
if ! command -v python >/dev/null; then
  mkdir -p bench/out/pybin && ln -sf "$(command -v python3)" bench/out/pybin/python
  export PATH="$PWD/bench/out/pybin:$PATH"
fi
STAGES="${STAGES:-build test memcheck profile ops e2e e2e8b ncu}"
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
  local limit_var="T_$name"
  timeout -k 10 "${!limit_var:-600}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  [ "$rc" -eq 124 ] && echo "== $name: killed after ${!limit_var:-600} s (T_$name)"
  echo "== $name: exit $rc in $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
  pack
}

pack() {  # PACK=FILE: every log and report so far, in one file
  [ -n "${PACK:-}" ] || return 0
  cp -f bench/out/*.md bench/out/*.json bench/out/*.csv bench/out/*.log "$OUT"/ 2>/dev/null
  tar czf "$PACK.tmp" -C "$OUT" . && mv -f "$PACK.tmp" "$PACK"
}

export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" TURBOSPEC_CUDA=1
stage build python setup.py build_ext --inplace
python -c 'import turbospec.ops as o; print("kernels:", o.kernels_available())' | tee -a "$OUT/machine.txt"
# CUDA cases of every test file (the CPU cases ran in CI); the emulator is not needed here. In this
# process (-n 0): the CUDA tests share one GPU.
stage test env TURBOSPEC_SKIP_CUDA_EMU=1 python -m pytest ${TEST_PATHS:-tests} -q -n 0 -rs -p no:cacheprovider \
  -k "cuda and not refuses_without_cuda" --durations 15 ${TEST_ARGS:-}
stage memcheck bash bench/memcheck.sh
stage profile python bench/profile_step.py ${PROFILE_ARGS:-}
stage ops python bench/bench_ops.py --device cuda --iters "${OPS_ITERS:-200}"
stage e2e python bench/bench_gpu.py --device cuda --models smollm2_135m --out "$OUT/gpu_smollm2.md" ${E2E_ARGS:-}
stage e2e8b python bench/bench_gpu.py --device cuda --models llama3_8b --out "$OUT/gpu_llama3_8b.md" ${E2E8B_ARGS:-}
# Real SmolLM2 weights and the Spec-Bench sample, carried by bench/gpu_carry.py (LAST_CALL: this call's share).
CARRY="${CARRY:-/tmp/turbospec_carry}"
stage e2ereal bash -c "python bench/gpu_carry.py ready && python bench/bench_gpu.py --device cuda --models smollm2_135m \
  --sections steps,e2e --cache-lens 1024 --tokens 1,8,64 --real-model '$CARRY/model' \
  --spec-bench '$CARRY/data/specbench_dev.jsonl' --spec-per-category 1 --max-new-tokens 128 --repeats 1 \
  --systems hf_plain,hf_lookup,hf_static,hf_static_compile,ts_graphs,ts_ngram,ts_eagle,ts_medusa \
  --out '$OUT/gpu_smollm2_real.md' ${E2EREAL_ARGS:-}"
stage ncu bash bench/profile_ncu.sh
cp -f bench/out/*.md bench/out/*.json bench/out/*.csv "$OUT"/ 2>/dev/null || true
pack
if [ -n "$FAILED" ]; then echo "gpu_all: FAILED stages:$FAILED"; exit 1; fi
echo "gpu_all: every stage passed"
