#!/usr/bin/env bash
# The last of the GPU calls that `python bench/gpu_carry.py pack` plans (issue 12 §4): the real
# SmolLM2 weights joined from the calls' parts, the extension built, then self-distillation and
# EAGLE-3 training with training-time test on the GPU within T_TRAIN seconds, and the head and the
# generated samples sent back in parts.
#
#   here:   python bench/gpu_carry.py pack        # prints the calls: carry .gpu_carry/callK
#   there:  python bench/gpu_carry.py stash .gpu_carry/call1      (call 1, and so on)
#           LAST_CALL=.gpu_carry/call3 bash bench/gpu_train.sh      (the last call, same warm machine;
#           gpu_carry.py pack prints it with bench/gpu_all.sh's e2ereal stage first)
#   here:   python bench/gpu_carry.py join-back <files_at>/head --dest /work/train/gpu-eagle3
#           python bench/ship_head.py --head /work/train/gpu-eagle3 --samples /work/train/gpu-eagle3/samples.jsonl ...
#
# The trainer's own --time-budget (T_TRAIN s) bounds the run: generation stops by 45% of it, features
# by 70%, and the schedule anneals by the deadline, where the final eval and head follow; SIGINT at
# T_TRAIN + 90 s is only the backstop. Whatever was generated comes back with the head (or alone).
# A second call on the same warm machine with RESUME=1 continues all three stages (the work folder
# with the generations and features stays in $CARRY while the machine is held).
# Env: LAST_CALL (the folder this call carries; empty: already stashed), CARRY (/tmp/turbospec_carry),
# OUT (bench/out/gpu_train), DEVICE (cuda), T_TRAIN (480 s), NUM_PROMPTS (0: all), MAX_NEW (256; 512 on the 512-token generation),
# GEN_BATCH (256), FEATURE_BATCH (32), EPOCHS (4), BATCH (32 sequences a step), DISTILL (the stored
# generation the run starts from and writes back to: data/distill/smollm2-135m-instruct-greedy512.npz
# when that continuation of the 256-token answers is complete (MAX_NEW 512), else
# data/distill/smollm2-135m-instruct-greedy256.npz, whose settings are MAX_NEW 256, all prompts,
# float32; empty: none), MIX (space-separated stored generations whose samples join the train split,
# --mix-data: by default every other SmolLM2 generation under data/distill/ (the sampled answers,
# the augmented prompts' answers) that no complete stored generation continues, and no unfinished continuation; empty: none), DRAFT_VOCAB (8192: the head's draft vocabulary; 16,384 gave the same tau on the same data and a
# proposal 11 % dearer on CPU, bench/results/2026-11-29-extra-features-all16k.md), DTYPE (float32: the target's; the CPU engine
# runs it so), SAVE_EVERY (400), RESUME (1:
# continue), TRAIN_ARGS (more). The extension is
# built unless its kernels for DEVICE already load (an earlier call on the same machine built them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu_train}"
CARRY="${CARRY:-/tmp/turbospec_carry}"
DEVICE="${DEVICE:-cuda}"
export CARRY
mkdir -p "$OUT"
START=$(date +%s)
# $OUT holds train.log and head/ (the device tool returns at most 8 files): the build log stays in $CARRY.
step() { echo "== [$(( $(date +%s) - START )) s] $*" | tee -a "$OUT/train.log"; }
if ! command -v python >/dev/null; then  # some images have only python3
  mkdir -p bench/out/pybin && ln -sf "$(command -v python3)" bench/out/pybin/python
  export PATH="$PWD/bench/out/pybin:$PATH"
fi

step "the carried model (stash ${LAST_CALL:-nothing more}, join unless joined)"
python bench/gpu_carry.py ready || exit 1
KIND="${DEVICE%%:*}"  # cuda or cpu: the kernels this run needs
if ! python -c "import sys, turbospec; sys.exit(0 if turbospec.kernels_available()['$KIND'] else 1)" 2>/dev/null; then
  step "build the extension (CUDA kernels for sm_90; CPU kernels at -O1)"
  TURBOSPEC_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
    TURBOSPEC_BUILD_OPT="${TURBOSPEC_BUILD_OPT:--O1}" python setup.py build_ext --inplace > "$CARRY/build.log" 2>&1 \
    || { tail -30 "$CARRY/build.log" | tee -a "$OUT/train.log"; exit 1; }
fi
python -c 'import turbospec; print("kernels:", turbospec.kernels_available())' | tee -a "$OUT/train.log"

DATA="$CARRY/data/train_prompts.jsonl"
[ -f "$DATA" ] || { echo "gpu_train: no $DATA (gpu_carry.py pack carries it)"; exit 1; }
RESUME_FLAG=""
[ "${RESUME:-0}" = 1 ] && RESUME_FLAG="--resume"
T_TRAIN="${T_TRAIN:-480}"
# The greedy answers continued to 512 tokens on CPU (--extend-data, int8 batched engine), once that
# generation is complete, are the run's own generation (the flags reproduce its settings, so nothing
# is answered again); else the 256-token one.
G512=data/distill/smollm2-135m-instruct-greedy512.npz
GEN_FLAGS=()
if [ -z "${DISTILL+set}" ] && python -c "import json, sys; sys.exit(0 if json.load(open('${G512%.npz}.json'))['info']['complete'] else 1)" 2>/dev/null; then
  DISTILL="$G512"
  MAX_NEW="${MAX_NEW:-512}"
  GEN_FLAGS=(--gen-engine batched --gen-activations int8 --extend-data data/distill/smollm2-135m-instruct-greedy256.npz)
fi
DISTILL="${DISTILL-data/distill/smollm2-135m-instruct-greedy256.npz}"
if [ -z "${MIX+set}" ]; then  # default: every stored generation under data/distill/ but DISTILL and those
  MIX=""                      # a stored one continues (--extend-data: the longer answers stand for them)
  EXTENDED="$(python -c 'import glob; from turbospec.train.data import continued
from turbospec.train.data import unfinished_continuations as u
g = sorted(glob.glob("data/distill/smollm2-135m-instruct-*.npz"))
print(" ".join(continued(g) + u(g)))')"
  for m in data/distill/smollm2-135m-instruct-*.npz; do
    [ -f "$m" ] && [ "$m" != "$DISTILL" ] && [[ " $EXTENDED " != *" $m "* ]] && MIX="$MIX $m"
  done
fi
MIX_FLAGS=()
for m in $MIX; do MIX_FLAGS+=(--mix-data "$m"); done
step "train (--time-budget $T_TRAIN s; SIGINT at $(( T_TRAIN + 90 )) s as a backstop)"
timeout -s INT -k 60 "$(( T_TRAIN + 90 ))" python -u -m turbospec.cli train --method eagle3 \
  --target "$CARRY/model" --data "$DATA" --out "$CARRY/head" --work-dir "$CARRY/work" \
  --num-prompts "${NUM_PROMPTS:-0}" --max-new-tokens "${MAX_NEW:-256}" --gen-batch-size "${GEN_BATCH:-256}" \
  --dtype "${DTYPE:-float32}" --device "$DEVICE" --epochs "${EPOCHS:-4}" --batch-size "${BATCH:-32}" \
  --loss-on-prompt --time-budget "$T_TRAIN" --feature-batch-size "${FEATURE_BATCH:-32}" \
  --draft-vocab "${DRAFT_VOCAB:-8192}" \
  ${DISTILL:+--distill-data "$DISTILL"} "${MIX_FLAGS[@]}" "${GEN_FLAGS[@]}" \
  --eval-every "${SAVE_EVERY:-400}" --save-every "${SAVE_EVERY:-400}" $RESUME_FLAG ${TRAIN_ARGS:-} \
  2>&1 | tee -a "$OUT/train.log"
rc=${PIPESTATUS[0]}
step "train: exit $rc (0: the head is final, at the time budget or after its epochs; 124 / 130: stopped by the backstop)"

# The samples the head learnt from (ship_head.py takes its draft vocabulary from them): all of
# them, also when the run stopped before a head was saved, so generation continues elsewhere.
SAMPLES="$(ls -t "$CARRY"/work/gen-*/samples.jsonl 2>/dev/null | head -1)"
FILES=()
for f in "$CARRY/head/config.json" "$CARRY/head/model.safetensors" "$SAMPLES"; do
  [ -n "$f" ] && [ -f "$f" ] && FILES+=("$f")
done
[ -f "$CARRY/head/model.safetensors" ] || echo "gpu_train: no head saved under $CARRY/head" | tee -a "$OUT/train.log"
if [ "${#FILES[@]}" -gt 0 ]; then
  step "send back: ${FILES[*]}"
  python bench/gpu_carry.py split-out "${FILES[@]}" --out "$OUT/head" || exit 1
fi
[ -f "$CARRY/head/model.safetensors" ] || exit 1
step "done"
