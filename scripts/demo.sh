#!/usr/bin/env bash
# `make demo`: every stage at small scale on the bundled SmolLM2-135M-Instruct, on CPU.
#   capture 64 ShareGPT conversations -> train an EAGLE-3 head for a few minutes (40 steps) -> evaluate it on a
#   slice of MT-bench against HF generate / prompt lookup (and, when that ran in bf16, again in float32,
#   where greedy output must equal HF generate's) -> export it for vLLM -> evaluate the shipped reference
#   head (if the repo has one). The summary (eagle/evaluate/summary.py) puts the float32 exactness first.
# Everything lands in outputs/demo/ (override with DEMO_DIR=...). Re-running resumes each stage.
set -euo pipefail
OUT=${DEMO_DIR:-outputs/demo}
N_CONV=${DEMO_CONVERSATIONS:-64}
STEPS=${DEMO_STEPS:-40}
PROMPTS=${DEMO_PROMPTS:-4}
COMMON=(recipe=smollm2-135m-instruct data.max_length=512)

echo "== 1/5 capture: $N_CONV ShareGPT conversations through SmolLM2-135M =="
eagle-capture "${COMMON[@]}" data.max_conversations="$N_CONV" capture.shard_size=16 output_dir="$OUT/capture"

echo "== 2/5 train: EAGLE-3 head, $STEPS steps =="
# A few minutes on 2 cores: short sequences, a high learning rate. It prints the untrained head's
# held-out acc@k / tau_sim next to the trained one's.
eagle-train "${COMMON[@]}" train.mode=offline train.data_dir="$OUT/capture" train.max_steps="$STEPS" \
  train.batch_size=4 train.max_length=256 train.lr=1e-3 train.warmup_steps=5 train.ttt_steps=4 \
  train.eval_every=20 train.save_every=20 train.eval_batches=4 train.log_every=5 output_dir="$OUT/train"

echo "== 3/5 evaluate on $PROMPTS MT-bench prompts (speculative vs HF generate vs prompt lookup) =="
eagle-eval "${COMMON[@]}" draft.path="$OUT/train" eval.prompts=mt_bench eval.max_prompts="$PROMPTS" \
  decode.max_new_tokens=64 output_dir="$OUT/eval"
# Greedy decoding is exact in float32 only (bf16 verify passes flip near-ties): where the run above was not
# float32, the same head and prompts again in float32 against HF generate, the summary's exactness line.
DTYPE=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["settings"]["dtype"])' "$OUT/eval/report.json")
if [ "$DTYPE" != float32 ]; then
  echo "== 3/5 exactness: the same head and prompts in float32 (the run above was $DTYPE) =="
  eagle-eval "${COMMON[@]}" draft.path="$OUT/train" target.dtype=float32 eval.prompts=mt_bench \
    eval.max_prompts="$PROMPTS" decode.max_new_tokens=64 'eval.baselines=[hf_generate]' output_dir="$OUT/eval-float32"
fi

echo "== 4/5 export for vLLM =="
eagle-export "${COMMON[@]}" draft.path="$OUT/train" format=vllm output_dir="$OUT/export-vllm"
eagle-export --check "$OUT/export-vllm"

HEAD=heads/smollm2-135m-instruct-eagle3
if [ -d "$HEAD" ]; then
  echo "== 5/5 evaluate the shipped reference head $HEAD =="
  eagle-eval "${COMMON[@]}" draft.path="$HEAD" eval.prompts=mt_bench eval.max_prompts="$PROMPTS" \
    decode.max_new_tokens=64 output_dir="$OUT/eval-reference"
else
  echo "== 5/5 no shipped reference head under $HEAD: skipped =="
fi

echo
echo "== demo summary =="
python -m eagle.evaluate.summary "$OUT"
