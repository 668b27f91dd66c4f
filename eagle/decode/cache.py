"""Keep only the accepted path in a KV cache after a tree verification.

A verify pass appends the root and all N tree nodes to the cache (slots past_len .. past_len + N).
Only the root and the accepted nodes survive: their entries are gathered into consecutive slots and
the rest is cropped, so accepted tokens are never recomputed. The same code serves the target's and
the head's `transformers.DynamicCache`.

Recurrent layers (a hybrid target's linear attention) hold one state for the whole sequence, which
cannot be cropped: `RecurrentSnapshot` keeps a copy of it from before a verify pass so that the
decoder can put it back and replay only the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def _layers(cache: Cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__} has no .layers; expected a transformers 5 DynamicCache")
    return layers


def crop_cache(cache: Cache, length: int) -> None:
    """Drop every entry at or after `length`."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_cache_entries(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep slots `start + keep` (sorted, keep[j] >= j) at start .. start + len(keep) - 1; drop the rest.

    keep: [K] offsets relative to `start` (the accepted path, root first).
    """
    n = int(keep.numel())
    contiguous = bool((keep == torch.arange(n, device=keep.device)).all())
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
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


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


@dataclass
class RecurrentSnapshot:
    """Copies of every recurrent layer's conv and recurrent states, to restore after a partial acceptance."""

    states: list[tuple[LinearAttentionCacheLayerMixin, dict[int, torch.Tensor | None], dict[int, torch.Tensor | None]]]

    @classmethod
    @torch.inference_mode()  # the states are inference tensors (written by target forwards)
    def take(cls, cache: Cache) -> RecurrentSnapshot:
        states = []
        for layer in _layers(cache):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                conv = {i: None if t is None else t.clone() for i, t in layer.conv_states.items()}
                rec = {i: None if t is None else t.clone() for i, t in layer.recurrent_states.items()}
                states.append((layer, conv, rec))
        return cls(states)

    @torch.inference_mode()
    def restore(self) -> None:
        """Put the states back in place (copy_: the layers' tensors keep their addresses)."""
        for layer, conv, rec in self.states:
            for held, saved in ((layer.conv_states, conv), (layer.recurrent_states, rec)):
                for i, t in saved.items():
                    current = held[i]
                    if t is None or current is None or current.shape != t.shape:
                        held[i] = t
                    else:
                        current.copy_(t)
