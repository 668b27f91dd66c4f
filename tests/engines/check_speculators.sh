#!/usr/bin/env bash
# Opt-in integration check (not part of `make test`): does the speculators library load our
# speculators-format export with its own API and compute the same draft logits as eagle?
#
#   tests/engines/check_speculators.sh [HEAD_OR_EXPORT]     (default heads/smollm2-135m-instruct-eagle3)
#
# HEAD_OR_EXPORT: a speculators-format folder (used as it is), or anything eagle-export takes as
# draft.path (exported to format=speculators first). TARGET=... (default smollm2-135m-instruct) is
# the head's target.path. Installs speculators==0.9.0 next to torch==2.13.0 in
# ${EAGLE_CACHE:-~/.cache/eagle}/venvs/speculators-0.9.0 once (torchvision / torchaudio, which it
# drags in built for another torch, are removed), then runs offline: our .venv computes reference
# logits on a few MT-bench first turns, `SpeculatorModel.from_pretrained(EXPORT)` recomputes them.
# Prints one PASS/FAIL line; exits non-zero on failure.
source "$(dirname "$0")/check_common.sh" speculators

HEAD=${1:-heads/smollm2-135m-instruct-eagle3}
PROMPTS=${CHECK_PROMPTS:-4}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
[ -e "$HEAD" ] || fail "$HEAD does not exist"
mkdir -p "$WORK"

VENV=$(speculators_venv) || exit 1

if "$OURS/python" -c 'import json,sys; sys.exit(0 if "speculators_model_type" in json.load(open(sys.argv[1])) else 1)' \
    "$HEAD/config.json" 2>/dev/null; then
  EXPORT=$HEAD
  "$OURS/eagle-export" --check "$EXPORT" "output_dir=$WORK/check" || fail "eagle-export --check $EXPORT"
else
  EXPORT=$WORK/export
  echo "== exporting $HEAD as format=speculators -> $EXPORT"
  timeout "$STEP_TIMEOUT" "$OURS/eagle-export" "target.path=$TARGET" "draft.path=$HEAD" format=speculators \
    "output_dir=$EXPORT" || fail "eagle-export format=speculators of $HEAD"
fi

echo "== reference: eagle's logits on $PROMPTS MT-bench prompts"
timeout "$STEP_TIMEOUT" "$OURS/python" tests/engines/check_speculators.py reference --export "$EXPORT" \
  --target "$TARGET" --prompts "$PROMPTS" --out "$WORK/reference.safetensors" || fail "reference logits (our .venv)"

echo "== speculators: SpeculatorModel.from_pretrained($EXPORT), offline"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout "$STEP_TIMEOUT" "$VENV/bin/python" tests/engines/check_speculators.py \
  compare --export "$EXPORT" --ref "$WORK/reference.safetensors" 2>"$WORK/compare.log" | tee "$WORK/result.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && ! grep -q '^FAIL' "$WORK/result.txt"; then
  tail -n 20 "$WORK/compare.log"
  [ "$rc" -eq 124 ] && fail "speculators compare ran past ${STEP_TIMEOUT}s (log: $WORK/compare.log)"
  fail "speculators compare exited $rc (log: $WORK/compare.log)"
fi
exit "$rc"
