#!/usr/bin/env bash
# `make demo`: every stage at small scale on the bundled SmolLM2-135M-Instruct, on CPU.
#   capture 64 ShareGPT conversations -> train an EAGLE-3 head for a few minutes (40 steps) -> evaluate it on a
#   slice of MT-bench against HF generate / prompt lookup -> export it for vLLM -> evaluate the
#   shipped reference head (if the repo has one).
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
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
man = json.loads((out / "capture" / "manifest.json").read_text())
print(f"capture: {out/'capture'}  (manifest: {', '.join(k for k in man if k != 'shards')})")
for name in ("eval", "eval-reference"):
    rep = out / name / "report.json"
    if rep.is_file():
        r = json.loads(rep.read_text())
        d = r.get("divergence") or {}
        verdict = ""
        if d.get("divergent_turns"):
            verdict = (f" ({d['divergent_turns']} divergent turns, "
                       f"{'all numeric' if d['all_numeric'] else 'NOT numeric: a bug'}, max fp32 margin {d['max_margin']:.3f})")
        print(f"{name} [{r['settings'].get('dtype', 'float32')}]: tau={r['tau']:.2f}  speedup vs HF generate={r['speedup']:.2f}x  "
              f"vs prompt lookup={r['speedup_vs_prompt_lookup']:.2f}x  greedy_match={r['greedy_match']}{verdict}")
print(f"export: {out/'export-vllm'}")
PY
