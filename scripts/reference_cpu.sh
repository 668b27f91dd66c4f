#!/usr/bin/env bash
# How the shipped reference head heads/smollm2-135m-instruct-eagle3 is made on a 2-core CPU, by the
# recipe: self-distil ShareGPT first turns (the target's own answers), capture their features, train,
# evaluate (bf16 = this CPU's decoding default, and fp32), export (vllm layout) with its card, check.
# Every stage resumes when re-run with the same command (regeneration skips written conversations,
# capture skips written shards, training continues from its last checkpoint), so the chain can be
# split over several sessions. Prints the wall time of each stage, also appended to $WORK/stages.tsv.
#
#   CONVERSATIONS=4000 STEPS=6000 [MAX_MINUTES=60] bash scripts/reference_cpu.sh
#   STAGES="regenerate capture" bash scripts/reference_cpu.sh      (only some stages)
#   INIT_FROM=outputs/ref/v2-head STEPS=2500 TRAIN_ARGS="train.lr=2e-4 train.warmup_steps=100 train.min_lr_ratio=0.3" \
#     STAGES=train bash scripts/reference_cpu.sh                     (warm start from an earlier head)
set -euo pipefail
cd "$(dirname "$0")/.."
CONVERSATIONS=${CONVERSATIONS:-4000}
STEPS=${STEPS:-6000}
WORK=${WORK:-outputs/ref}
HEAD=heads/smollm2-135m-instruct-eagle3
NOTES=${NOTES:-$(ls "$HEAD.notes.md" 2>/dev/null || true)}  # the card's Notes: history, limits (kept beside the head)
STAGES=${STAGES:-"regenerate capture train eval export check"}
R=(recipe=smollm2-135m-instruct)
PATH="$PWD/.venv/bin:$PATH"
REGEN="$WORK/regen/regenerated.jsonl"
# The self-distilled data are kept in the repository (a few MB gzipped), so a new machine resumes
# regeneration where the last one stopped instead of redoing hours of generation; outputs/ is scratch.
KEPT=data/regenerated/smollm2-135m-instruct
mkdir -p "$WORK"

stage() {  # stage NAME COMMAND...: run it if NAME is in $STAGES, print and record its wall time
  local name=$1; shift
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name: $*"
  local start=$SECONDS
  "$@"
  local took=$((SECONDS - start))
  printf '%s\t%s\t%ss\n' "$(date -u +%FT%TZ)" "$name" "$took" | tee -a "$WORK/stages.tsv"
}

# The full evaluation (issue sizes) takes ~35 min per dtype here; smaller sizes for a short session:
# EVAL_DTYPES=bfloat16 MTBENCH_PROMPTS=80 HUMANEVAL_PROMPTS=20 SAMPLED_PROMPTS=10 (0 skips a row);
# CHAIN_PROMPTS=8: the vLLM-equivalent chain row, in the first of EVAL_DTYPES. EVAL_ARGS adds eagle-eval
# overrides to every row (e.g. 'eval.baselines=[hf_generate,prompt_lookup]' saves the autoregressive run).
evaluate() {
  local dtype
  EVAL_DTYPES=${EVAL_DTYPES:-bfloat16 float32}
  for dtype in $EVAL_DTYPES; do
    eval_row "$dtype" mt_bench "${MTBENCH_PROMPTS:-80}" 0 "$WORK/eval-mtbench-t0-$dtype"
    eval_row "$dtype" humaneval "${HUMANEVAL_PROMPTS:-40}" 0 "$WORK/eval-humaneval-t0-$dtype"
    eval_row "$dtype" mt_bench "${SAMPLED_PROMPTS:-20}" 1.0 "$WORK/eval-mtbench-t1-$dtype"
  done
  # The chain vLLM drafts (check_vllm.sh: k=3, the first 8 MT-bench turns x 64 tokens, greedy), in
  # eagle's decoder: the same acceptance must come out of both, so this row is what vLLM's is read against.
  if [ "${CHAIN_PROMPTS:-8}" -gt 0 ]; then
    eagle-eval "${R[@]}" draft.path="$WORK/train" target.dtype="${EVAL_DTYPES%% *}" eval.prompts=mt_bench \
      eval.max_prompts="${CHAIN_PROMPTS:-8}" decode.temperature=0 decode.max_new_tokens=64 decode.tree=dynamic \
      decode.tree_top_k=1 decode.tree_depth=3 decode.tree_total_tokens=3 'eval.baselines=[hf_generate]' \
      output_dir="$WORK/eval-mtbench-chain3-${EVAL_DTYPES%% *}"
  fi
}

eval_row() {  # eval_row DTYPE PROMPTS N TEMPERATURE OUTPUT_DIR (N=0: skipped)
  [ "$3" -gt 0 ] || return 0
  eagle-eval "${R[@]}" draft.path="$WORK/train" target.dtype="$1" eval.prompts="$2" eval.max_prompts="$3" \
    decode.temperature="$4" decode.max_new_tokens=128 ${EVAL_ARGS:-} output_dir="$5"
}

export_head() {
  local reports=() d
  for d in "$WORK"/eval-*; do reports+=("$d"); done
  local joined
  joined=$(IFS=,; echo "${reports[*]}")
  eagle-publish "${R[@]}" draft.path="$WORK/train" format=vllm publish.dry_run=true \
    publish.repo_id=eagle/smollm2-135m-instruct-eagle3 "publish.reports=[$joined]" output_dir="$WORK/publish" \
    ${NOTES:+publish.notes=$NOTES}
  rm -rf "$HEAD" && mkdir -p heads "$WORK/publish/hub/reports" && cp -r "$WORK/publish/hub" "$HEAD"
  for d in "${reports[@]}"; do cp "$d/report.json" "$HEAD/reports/$(basename "$d").json"; done
  eagle-export --check "$HEAD"
}

restore_regenerated() {  # the kept copy -> $WORK/regen, unless this machine already has as much
  [ -f "$KEPT/regenerated.jsonl.gz" ] || return 0
  local kept_lines have=0
  kept_lines=$(gzip -dc "$KEPT/regenerated.jsonl.gz" | wc -l)
  [ -f "$REGEN" ] && have=$(wc -l < "$REGEN")
  if [ "$have" -lt "$kept_lines" ]; then
    echo "== restore: $kept_lines regenerated conversations from $KEPT"
    mkdir -p "$WORK/regen"
    gzip -dc "$KEPT/regenerated.jsonl.gz" > "$REGEN.restore" && mv "$REGEN.restore" "$REGEN"
    cp "$KEPT/regenerated.jsonl.meta.json" "$REGEN.meta.json"
  fi
}

keep_regenerated() {  # $WORK/regen -> the kept copy (commit it: git add data/regenerated)
  [ -f "$REGEN" ] || return 0
  mkdir -p "$KEPT"
  gzip -9 -n -c "$REGEN" > "$KEPT/regenerated.jsonl.gz.tmp" && mv "$KEPT/regenerated.jsonl.gz.tmp" "$KEPT/regenerated.jsonl.gz"
  cp "$REGEN.meta.json" "$KEPT/regenerated.jsonl.meta.json"
  echo "kept $(wc -l < "$REGEN") regenerated conversations in $KEPT (commit them)"
}

restore_regenerated
stage regenerate eagle-regenerate "${R[@]}" data.max_conversations="$CONVERSATIONS" output_dir="$WORK/regen"
[[ " $STAGES " == *" regenerate "* ]] && keep_regenerated
# Held-out prompts never enter: MT-bench / HumanEval are removed from the data before regeneration.
# Captured in bf16, the dtype the head is served in on this CPU (decode target.dtype=auto): 3.0x the
# float32 capture here (benchmarks/capture.py, 48 conversations: 2306 vs 771 tok/s).
stage capture eagle-capture "${R[@]}" data=local data.path="$REGEN" data.max_conversations=null \
  target.dtype=bfloat16 output_dir="$WORK/capture"
# MAX_MINUTES=N stops training after N minutes (checkpoint saved); the same command continues it.
# INIT_FROM=DIR starts from an earlier head (saved or exported, same shape) with a fresh optimizer and
# schedule; a run that already has a checkpoint resumes from it and ignores INIT_FROM. TRAIN_ARGS adds
# overrides (a warm start wants the lr where the earlier schedule left off, not the recipe's peak: at
# 6e-4 the v2 head fell from tau_sim 2.10 to 1.89 in 100 steps).
stage train eagle-train "${R[@]}" train.data_dir="$WORK/capture" train.max_steps="$STEPS" \
  ${MAX_MINUTES:+train.max_minutes=$MAX_MINUTES} ${INIT_FROM:+train.init_from=$INIT_FROM} ${TRAIN_ARGS:-} output_dir="$WORK/train"
stage eval evaluate
stage export export_head
# The check serves the head at k = 1, 2 and 3 and prints the fastest (the recipe's
# export.speculative_tokens_by_algorithm.eagle3 is what the card advertises: set it to that k).
stage check env CHECK_K="${CHECK_K:-1 2 3}" bash tests/engines/check_vllm.sh "$HEAD"
echo "reference head: $HEAD (stage times in $WORK/stages.tsv)"
