"""The engine checks as opt-in tests: the real vLLM, speculators and llama.cpp load and serve what eagle exports
(`make check-engines`, or `pytest --engines -m engines tests/engines`; never part of `make test`: each installs
an engine once and runs for minutes). Each test gets its engine's venv from a fixture (scripts/engine_venv.sh,
cached under ${EAGLE_CACHE:-~/.cache/eagle}/venvs), runs the check script on the shipped head, and passes when
the script prints PASS: greedy output identical with and without the head (vLLM, llama.cpp), the same draft
logits (speculators), the same capture (vLLM), the same training from vLLM servers as from a capture (vLLM
stream). The scripts stay runnable by hand: `tests/engines/check_vllm.sh HEAD` (their headers list the CHECK_*
settings). ENGINE_HEAD=DIR checks another head."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from eagle.assets import has_asset

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(not has_asset("smollm2-135m-instruct"), reason="the checks serve the bundled SmolLM2"),
]


def _shell(function: str, script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run one function of a sourced scripts/ file (it prints a path on stdout, FAIL lines on failure)."""
    return subprocess.run(
        ["bash", "-c", f"source scripts/{script} && {function}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _engine_venv(engine: str) -> Path:
    """The engine installed once into its own venv, next to torch==2.13.0 (scripts/engine_venv.sh)."""
    done = _shell(f"{engine}_venv", "engine_venv.sh", timeout=3600)
    if done.returncode != 0:
        pytest.fail(f"{engine}'s venv could not be set up:\n{done.stdout}{done.stderr[-2000:]}")
    venv = Path(done.stdout.strip().splitlines()[-1])
    assert (venv / "bin" / "python").is_file()
    return venv


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return _engine_venv("vllm")


@pytest.fixture(scope="session")
def speculators_venv() -> Path:
    return _engine_venv("speculators")


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """llama.cpp b11434's llama-server, built beforehand (~17 min on 2 cores; never here)."""
    done = subprocess.run(
        ["bash", "-c", "source scripts/engine_llamacpp.sh && llamacpp_server"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "LLAMACPP_NO_BUILD": "1"},
        timeout=120,
    )
    if done.returncode != 0:
        pytest.skip(f"no llama.cpp build: {done.stdout.strip() or done.stderr.strip()[-300:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _check(script: str, timeout: int, **env: str) -> str:
    head = os.environ.get("ENGINE_HEAD", "heads/smollm2-135m-instruct-eagle3")
    done = subprocess.run(
        ["bash", str(HERE / script), head],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0 and "PASS" in done.stdout, f"{script} failed:\n{tail}"
    return done.stdout


def test_vllm_serves_the_head_with_the_same_greedy_output(vllm_venv):
    _check("check_vllm.sh", timeout=3600, CHECK_K="1")


def test_vllm_captures_what_transformers_captures(vllm_venv):
    _check("check_vllm_capture.sh", timeout=3600, CHECK_STOCK="0", CHECK_CONVERSATIONS="8")


def test_vllm_stream_trains_what_the_vllm_capture_trains(vllm_venv):
    """train.mode=stream from two real vLLM servers, one killed mid-run: the offline run's step losses."""
    _check("check_vllm_stream.sh", timeout=3600, CHECK_CONVERSATIONS="24", CHECK_STEPS="8", CHECK_ONE_SERVER="0")


def test_speculators_loads_the_export_and_computes_the_same_logits(speculators_venv):
    _check("check_speculators.sh", timeout=1800)


def test_llamacpp_serves_the_head_with_the_same_greedy_output(llama_server):
    _check(
        "check_llamacpp.sh",
        timeout=3600,
        LLAMA_SERVER=str(llama_server),
        CHECK_VERIFY="0",
        CHECK_N="1 2",
        CHECK_PROMPTS="4",
    )
