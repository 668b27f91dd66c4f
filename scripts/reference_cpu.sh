#!/usr/bin/env bash
# How the shipped reference head heads/smollm2-135m-instruct-eagle3 is made on a 2-core CPU:
# capture ShareGPT features, train the recipe, evaluate, export (hf format) into heads/ with its card.
# Every stage resumes when re-run, so the run can be split over several sessions.
#   STEPS=350 bash scripts/reference_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-350}
WORK=${WORK:-outputs/ref}
HEAD=heads/smollm2-135m-instruct-eagle3
R=(recipe=smollm2-135m-instruct)

eagle-capture "${R[@]}" output_dir="$WORK/capture"
eagle-train "${R[@]}" train.data_dir="$WORK/capture" train.max_steps="$STEPS" output_dir="$WORK/train"
# Held-out prompts only (MT-bench / HumanEval are removed from the training data at capture time).
# MT-bench at T=0 through the decode benchmark (tree size auto-tuned, decoder overhead reported).
python scripts/bench_decode.py "$WORK/train" --max-prompts ${MT_PROMPTS:-16} --max-new-tokens 96 --tree auto \
  --output-dir "$WORK/eval-mtbench-t0"
eagle-eval "${R[@]}" draft.path="$WORK/train" eval.prompts=humaneval eval.max_prompts=${HE_PROMPTS:-8} \
  decode.max_new_tokens=96 output_dir="$WORK/eval-humaneval-t0"
eagle-eval "${R[@]}" draft.path="$WORK/train" eval.prompts=mt_bench eval.max_prompts=${MT_PROMPTS_T1:-8} \
  decode.temperature=1.0 decode.max_new_tokens=96 eval.baselines=[hf_generate] output_dir="$WORK/eval-mtbench-t1"
eagle-publish "${R[@]}" draft.path="$WORK/train" format=vllm publish.dry_run=true \
  publish.repo_id=eagle/smollm2-135m-instruct-eagle3 \
  "publish.reports=[$WORK/eval-mtbench-t0,$WORK/eval-humaneval-t0,$WORK/eval-mtbench-t1]" output_dir="$WORK/publish"
rm -rf "$HEAD" && mkdir -p heads && cp -r "$WORK/publish/hub" "$HEAD"
mkdir -p "$HEAD/reports"
for d in eval-mtbench-t0 eval-humaneval-t0 eval-mtbench-t1; do cp "$WORK/$d/report.json" "$HEAD/reports/$d.json"; done
eagle-export --check "$HEAD"
echo "reference head written to $HEAD"
