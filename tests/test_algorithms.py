"""The algorithm registry: every algorithm is complete and consistent with its head, the config and
the export formats, so that adding one is a module in eagle/algorithms plus its head class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import eagle.algorithms
from eagle.algorithms import ALGORITHMS, get_algorithm
from eagle.algorithms.head_io import head_config_from_target
from eagle.cli.app import compose
from eagle.config import ConfigError, DraftConfig, TrainConfig
from eagle.export.formats import detect_algorithm, expected_tensors
from eagle.export.registry import FORMATS, build_config, format_keys
from tests.tiny_models import make_model


def test_each_algorithm_is_one_package_one_registration_and_one_config_group():
    """Adding an algorithm is its folder and its line in ALGORITHMS: the head, the Algorithm and any
    drafting step live in eagle/algorithms/<name>/, and `draft=<name>` composes."""
    root = Path(eagle.algorithms.__file__).parent
    packages = {p.parent.name for p in root.glob("*/algorithm.py")}
    assert packages == set(ALGORITHMS)
    for name, algo in ALGORITHMS.items():
        assert algo.name == name == algo.head_class.algorithm
        assert type(algo).__module__ == f"eagle.algorithms.{name}.algorithm"
        assert algo.head_class.__module__ == f"eagle.algorithms.{name}.head"
        assert compose([f"draft={name}"]).draft.algorithm == name
    with pytest.raises(ConfigError, match=r"draft.algorithm='medusa' is not one of eagle1, eagle3"):
        compose(["draft.algorithm=medusa"])
    with pytest.raises(ConfigError, match=r"draft.algorithm='medusa' is not one of eagle1, eagle3"):
        get_algorithm("medusa")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_export_spec_is_complete_and_round_trips(name):
    algo = get_algorithm(name)
    model, _ = make_model("llama")
    cfg = head_config_from_target(model.config, DraftConfig(algorithm=name, draft_vocab_size=None, aux_layer_ids=None))
    assert len(cfg.aux_layer_ids) == algo.num_aux_layers
    assert algo.feature_rows() == algo.num_aux_layers + 1
    assert set(algo.export_formats) <= set(FORMATS)
    tensors = expected_tensors(cfg)
    for fmt in algo.export_formats:
        config = build_config(cfg, fmt, "float16", verifier={"name_or_path": "t", "architectures": []})
        # A folder written elsewhere (no eagle block) is recognised as this algorithm.
        assert detect_algorithm({k: v for k, v in config.items() if k != "eagle_export"}, "x") == name
        for ours in algo.format_tensors(tensors, fmt):
            assert algo.canonical_tensor_name(algo.export_tensor_name(ours, fmt)) == ours
        stored = format_keys(cfg, fmt)
        # What a format may leave out is exactly what it does not store of ours.
        left_out = {n for n in tensors if algo.export_tensor_name(n, fmt) not in stored}
        assert left_out <= set(algo.default_tensors(cfg, fmt)), (fmt, left_out)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_loss_settings_and_summary_weights_agree(name):
    algo = get_algorithm(name)
    train = TrainConfig(ttt_steps=4)
    settings = algo.loss_settings(DraftConfig(algorithm=name, feature_noise_std=0.3), train, pad_id=0, training=True)
    evaluation = algo.loss_settings(DraftConfig(algorithm=name, feature_noise_std=0.3), train, pad_id=0, training=False)
    # Held-out numbers: every depth (a block drafter: every block position), no noise.
    head_cfg = head_config_from_target(
        make_model("llama")[0].config, DraftConfig(algorithm=name, draft_vocab_size=None)
    )
    depth = algo.block_drafts(head_cfg) if algo.head_class.drafts_block else 4
    assert evaluation.steps == depth and evaluation.noise_std == 0.0
    weights, extra = algo.summary_weights(train, evaluation.steps)
    assert len(weights) == evaluation.steps and set(extra) <= set(algo.extra_metrics)
    assert 1 <= settings.steps <= depth
    assert torch.isfinite(torch.tensor(weights)).all()
