"""A recipe's settings fit every algorithm: the README's commands compose with `draft=dflash` and
`draft=peagle` appended, and its export command, run unchanged on a DFlash, P-EAGLE, EAGLE-1 or EAGLE-3
head, gives each head its own chain length: a value the recipe measured for EAGLE-3 heads
(`export.speculative_tokens_by_algorithm.eagle3`) reaches EAGLE-3 heads only, while a user's
`export.speculative_tokens` that contradicts a block drafter's block is still refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle.algorithms.head_io import save_head
from eagle.cli.app import compose
from eagle.config import ConfigError
from eagle.errors import ExportError
from eagle.export.exporter import run_export, served_chain_length
from tests.support.decode import random_head
from tests.test_docs import README, _commands, _override_sets
from tests.tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Per algorithm: the options a head of it is built with here, and the chain length its export must advertise.
HEADS = {
    "dflash": ({"block_size": 6, "aux_layer_ids": [1, 2, 3]}, 5),
    "peagle": ({"parallel_tokens": 3, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64}, 3),
    "eagle3": ({"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64}, 1),  # the recipe's measured value
    "eagle1": ({}, 4),  # no measured value for EAGLE-1: decode=cpu's tree_depth
}


def _readme_commands(stage: str) -> list[list[str]]:
    return [words for s, words in _commands(README) if s == stage]


@pytest.fixture(scope="module")
def head_folders(tmp_path_factory) -> dict[str, Path]:
    """One saved head folder per algorithm, on a tiny Qwen3 target."""
    model, _ = make_model("qwen3")
    root = tmp_path_factory.mktemp("heads")
    folders = {}
    for algorithm, (options, _) in HEADS.items():
        head = random_head(model, algorithm, **options)
        if getattr(head, "fc", None) is not None and head.fc.bias is not None:
            torch.nn.init.zeros_(head.fc.bias)  # vLLM's EAGLE-1 fc has no bias
        folders[algorithm] = root / algorithm
        save_head(head, folders[algorithm])
    return folders


@pytest.mark.parametrize("algorithm", ["dflash", "peagle"])
def test_every_readme_command_composes_with_a_block_drafter(algorithm):
    commands = [(s, w) for s, w in _commands(README)]
    assert {s for s, _ in commands} >= {"eagle-capture", "eagle-train", "eagle-eval", "eagle-export"}
    for stage, words in commands:
        for overrides in _override_sets(words):
            cfg = compose([*overrides, f"draft={algorithm}"])
            assert cfg.draft.algorithm == algorithm, (stage, overrides)


@pytest.mark.parametrize("algorithm", list(HEADS))
def test_the_readme_export_command_serves_each_algorithm_its_own_chain(algorithm, head_folders, tmp_path):
    """`eagle-export recipe=smollm2-135m-instruct draft.path=... format=vllm output_dir=...` as the README
    writes it (only the two paths swapped): the export runs and its model card's chain is the head's."""
    (words,) = [w for w in _readme_commands("eagle-export") if "format=vllm" in w and "--check" not in w][:1]
    paths = {"draft.path": str(head_folders[algorithm]), "output_dir": str(tmp_path / "export")}
    overrides = [f"{k}={paths[k]}" if (k := w.partition("=")[0]) in paths else w for w in words]
    cfg = compose(overrides)
    head = run_export(cfg)
    assert head.config.algorithm == algorithm
    assert served_chain_length(cfg, head.config) == HEADS[algorithm][1]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"]


def test_a_users_chain_length_still_contradicts_a_block_by_name(head_folders):
    from eagle.export.validate import read_folder

    dflash = read_folder(head_folders["dflash"]).config
    eagle3 = read_folder(head_folders["eagle3"]).config
    recipe = "recipe=smollm2-135m-instruct"
    with pytest.raises(ExportError, match=r"export.speculative_tokens=2: a dflash head drafts 5"):
        served_chain_length(compose([recipe, "export.speculative_tokens=2"]), dflash)
    assert served_chain_length(compose([recipe, "export.speculative_tokens=5"]), dflash) == 5
    assert served_chain_length(compose([recipe, "export.speculative_tokens=2"]), eagle3) == 2  # the user's wins
    wrong = "+export.speculative_tokens_by_algorithm.dflash=7"
    with pytest.raises(ExportError, match=r"export.speculative_tokens_by_algorithm.dflash=7"):
        served_chain_length(compose([recipe, wrong]), dflash)


def test_per_algorithm_values_are_checked_at_start():
    with pytest.raises(ConfigError, match="eagle33 is not an algorithm"):
        compose(["+export.speculative_tokens_by_algorithm.eagle33=1"])
    with pytest.raises(ConfigError, match="export.speculative_tokens_by_algorithm.eagle1=0"):
        compose(["+export.speculative_tokens_by_algorithm.eagle1=0"])
