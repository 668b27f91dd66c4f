# Sourced first by every engine check (tests/engines/check_*.sh), with the check's name:
#
#   source "$(dirname "$0")/check_common.sh" NAME
#
# leaves the shell in the repository root with scripts/engine_venv.sh's functions (fail, vllm_venv,
# speculators_venv) and sets what every check reads: TARGET (default smollm2-135m-instruct), WORK (CHECK_DIR,
# default outputs/integration/NAME), OURS (.venv/bin, which must exist). `finish CMD...` runs the check's
# report step, with its PASS/FAIL line, copies its output to $WORK/result.txt and exits with its status.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
source scripts/engine_venv.sh

TARGET=${TARGET:-smollm2-135m-instruct}
WORK=${CHECK_DIR:-outputs/integration/$1}
OURS=.venv/bin
[ -x "$OURS/python" ] || fail "no .venv here: run 'make test' (or 'make venv') first"

finish() {
  "$@" | tee "$WORK/result.txt"
  exit "${PIPESTATUS[0]}"
}
