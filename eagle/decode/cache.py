"""What each layer of a cache keeps between forward passes, and how a verify pass is undone.

The decoder decides what it can verify from the cache's own layer classes (transformers' cache_utils),
never from a family's layer-type names. Every layer keeps one of four things:

  * keys and values (`DynamicLayer`): a verify pass appends the root and all drafted nodes; only the
    root and the accepted nodes survive, gathered into consecutive slots (`keep_cache_entries`), the
    rest cropped. Trees verify as well as chains, and accepted tokens are never recomputed.
  * a state that follows the sequence: a recurrent or convolution state (`LinearAttentionLayer`:
    Gated DeltaNet, Mamba2, LFM2's short convolutions), or keys and values kept together with more
    than keys and values (a `DynamicLayer` subclass: DeepSeek-V4's compressed entries and their
    window-cut keys, sparse-attention indexer keys). It cannot be cropped: a copy of it is taken
    before a verify pass (`StateSnapshot`), put back after a partial acceptance, and the accepted
    tokens are run again. Such a layer reads a pass in order, so a pass must be a chain.
  * both (`LinearAttentionAndFullAttentionLayer`: Falcon-H1's attention and Mamba2 side by side):
    the state is copied and restored, the keys and values cropped.
  * nothing (`DummyLayer`: MLP or MoE-only layers, layers that reuse another layer's keys).

A layer of any other class is refused by name (`classify_layers`). The same crop/gather code serves the
head's own cache (plain `DynamicLayer`s).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
)


class LayerKind(enum.Enum):
    KEYS_VALUES = "keys and values"
    STATE = "a state that follows the sequence"
    KEYS_VALUES_AND_STATE = "keys, values and a state"
    NOTHING = "nothing"

    @property
    def holds_state(self) -> bool:
        return self in (LayerKind.STATE, LayerKind.KEYS_VALUES_AND_STATE)

    @property
    def holds_keys_values(self) -> bool:
        return self in (LayerKind.KEYS_VALUES, LayerKind.KEYS_VALUES_AND_STATE)


def layer_kind(layer: Any) -> LayerKind | None:
    """What a cache layer keeps, from its class; None for a class the decoder does not know."""
    if isinstance(layer, DummyLayer):
        return LayerKind.NOTHING
    if type(layer) is LinearAttentionAndFullAttentionLayer:
        return LayerKind.KEYS_VALUES_AND_STATE
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        # Another mix of a linear state with keys and values (sliding, static) is not one we crop: refused.
        return None if isinstance(layer, DynamicLayer) else LayerKind.STATE
    if type(layer) is DynamicLayer:
        return LayerKind.KEYS_VALUES
    if isinstance(layer, DynamicLayer):
        # A subclass keeps more than its keys and values (compressed entries, indexer keys, keys cut to
        # a window): cropping only its keys would leave the rest wrong, so the whole layer is a state.
        return LayerKind.STATE
    return None


def cache_layers(cache: Cache) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__} has no .layers; expected a transformers 5 DynamicCache")
    return layers


def crop_cache(cache: Cache, length: int) -> None:
    """Drop every key/value entry at or after `length` (layers of keys and values only)."""
    for layer in cache_layers(cache):
        if _has_entries(layer):
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_cache_entries(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep slots `start + keep` (sorted, keep[j] >= j) at start .. start + len(keep) - 1; drop the rest.

    keep: [K] offsets relative to `start` (the accepted path, root first). State layers are left alone:
    the decoder restores and replays them (`StateSnapshot`).
    """
    n = int(keep.numel())
    contiguous = bool((keep == torch.arange(n, device=keep.device)).all())
    for layer in cache_layers(cache):
        if not _has_entries(layer):
            continue
        if contiguous:  # a chain prefix is already in place
            layer.keys = layer.keys[..., : start + n, :]
            layer.values = layer.values[..., : start + n, :]
            continue
        idx = (keep + start).to(layer.keys.device)
        # index_select copies before the slice assignment, so overlapping source/destination is safe.
        k = layer.keys.index_select(-2, idx)  # [B, H, K, D]
        v = layer.values.index_select(-2, idx)
        layer.keys = torch.cat([layer.keys[..., :start, :], k], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], v], dim=-2)


def _has_entries(layer: Any) -> bool:
    kind = layer_kind(layer)
    if kind is None or not kind.holds_keys_values:
        return False
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def _copied(value: Any) -> Any:
    """`value` with every tensor in it cloned (dicts, lists and tuples followed; other values shared)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


@dataclass
class _LinearCopy:
    """A linear-attention layer's conv and recurrent states (restored in place: their addresses stay)."""

    layer: LinearAttentionCacheLayerMixin
    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]

    def restore(self) -> None:
        for held, saved in ((self.layer.conv_states, self.conv), (self.layer.recurrent_states, self.recurrent)):
            for i, t in saved.items():
                current = held[i]
                if t is None or current is None or current.shape != t.shape:
                    held[i] = t
                else:
                    current.copy_(t)


@dataclass
class _WholeCopy:
    """Every attribute of a layer that keeps more than keys and values, tensors cloned."""

    layer: Any
    attributes: dict[str, Any]

    def restore(self) -> None:
        self.layer.__dict__.update(self.attributes)


@dataclass
class StateSnapshot:
    """Copies of every state layer of a cache, taken before a verify pass, to put back after a partial
    acceptance (keys and values are cropped instead: nothing of them is copied)."""

    copies: list[_LinearCopy | _WholeCopy]

    @classmethod
    @torch.inference_mode()  # the states are inference tensors (written by target forwards)
    def take(cls, cache: Cache) -> StateSnapshot:
        copies: list[_LinearCopy | _WholeCopy] = []
        for layer in cache_layers(cache):
            kind = layer_kind(layer)
            if kind is None or not kind.holds_state:
                continue
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                copies.append(_LinearCopy(layer, _copied(layer.conv_states), _copied(layer.recurrent_states)))
            else:
                copies.append(_WholeCopy(layer, _copied(dict(layer.__dict__))))
        return cls(copies)

    @torch.inference_mode()
    def restore(self) -> None:
        for copy in self.copies:
            copy.restore()
