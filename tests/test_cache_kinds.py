"""What the decoder verifies follows from what each cache layer keeps (eagle.decode.cache), not from
layer-type names: the tiny families' plans, the layers made full, and the refusal of a class it does
not know."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from eagle.decode.cache import LayerKind, StateSnapshot, layer_kind
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.errors import TargetError
from tests.tiny_models import make_config

KV, STATE, BOTH, NOTHING = (
    LayerKind.KEYS_VALUES,
    LayerKind.STATE,
    LayerKind.KEYS_VALUES_AND_STATE,
    LayerKind.NOTHING,
)


@pytest.mark.parametrize(
    "family, kinds, trees",
    [
        ("llama", (KV,) * 4, True),
        ("gemma3", (KV,) * 4, True),  # sliding layers kept whole: the mask hides the old keys
        ("gpt_oss", (KV,) * 4, True),
        ("qwen3_next", (STATE, KV, STATE, KV), False),
        ("nemotron_h", (STATE, NOTHING, KV, NOTHING), False),
        ("falcon_h1", (BOTH,) * 4, False),
        ("lfm2", (STATE, KV, STATE, KV), False),
        # LFM3 verifies chains over its own layout: its sliding layer cuts keys to the window, so it is
        # copied whole like a state.
        ("lfm3", (STATE, STATE, STATE, KV), False),
    ],
)
def test_each_family_verifies_what_its_cache_layers_allow(family, kinds, trees):
    config = make_config(family, vocab_size=64)
    plan = verify_plan(config)
    assert plan.kinds == kinds
    assert plan.trees is trees
    assert plan.holds_state is any(k.holds_state for k in kinds)
    if not trees:
        assert family in plan.why_chains
    cache = new_cache(config, plan)
    assert tuple(layer_kind(layer) for layer in cache.layers) == kinds


def test_a_cache_layer_of_an_unknown_class_is_refused_by_name(monkeypatch):
    config = make_config("llama", vocab_size=64)
    import transformers.cache_utils as cache_utils

    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", lambda **kw: StaticLayer(16))
    with pytest.raises(TargetError, match=r"llama: decoder layer 0 keeps its cache in a StaticLayer"):
        verify_plan(config)


def test_a_snapshot_puts_a_whole_state_layer_back():
    """A keys-and-more layer (a DynamicLayer subclass) is copied whole and put back as it was."""

    class Compressing(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.entries: dict[str, torch.Tensor | None] = {"compressor": None}

    layer = Compressing()
    assert layer_kind(layer) is STATE and layer_kind(DynamicLayer()) is KV
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    layer.entries["compressor"] = torch.zeros(2)
    cache = new_cache()
    cache.layers = [layer]
    snapshot = StateSnapshot.take(cache)
    layer.update(torch.full((1, 1, 2, 2), 5.0), torch.full((1, 1, 2, 2), 5.0))
    layer.entries["compressor"].add_(7.0)  # in place: the copy must not share it
    snapshot.restore()
    assert layer.keys.shape[-2] == 3 and torch.equal(layer.entries["compressor"], torch.zeros(2))


def test_a_tree_through_a_state_layer_is_refused():
    from tests.tiny_models import make_model

    model, _ = make_model("lfm2")
    cache = new_cache(model.config)
    ids = torch.tensor([1, 2, 3])
    target_forward(model, ids, torch.arange(3), cache)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with pytest.raises(TargetError, match="lfm2 keeps a state that follows the sequence.*chain"):
        target_forward(model, ids, torch.tensor([3, 4, 4]), cache, tree)
