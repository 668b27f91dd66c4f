#!/usr/bin/env bash
# Rewrite constraints.txt from the current .venv (run after a green `make test` on a fresh clone).
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Versions the test suite is known to pass with (make test / make demo build .venv with these)."
  echo "# pyproject.toml keeps ranges for library users; refresh this file with scripts/freeze_constraints.sh"
  echo "# after a green 'make test' on a fresh clone."
  .venv/bin/pip freeze --exclude-editable | grep -v '^#' | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/'
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
