"""P-EAGLE's drafting step: the root's output and K - 1 parallel slots give the laws of K tokens.

The head cache holds the committed entries (as EAGLE-3's); the slots are appended for the pass and
cropped after it, so the cache again holds only verified tokens. The laws are over the target
vocabulary (a reduced draft vocabulary scattered into it, -inf elsewhere), as the decoder verifies
target ids (`eagle.decode.block`).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from eagle.decode.cache import cache_length, crop_cache
from eagle.heads.base import DraftHead


class ParallelSlots(Protocol):
    """P-EAGLE's head (`PEagleHead`), as the drafting step reads it: the projected feature of n slots."""

    def slot_hidden(self, n: int) -> torch.Tensor: ...


def draft_to_target_log_probs(head: DraftHead, logits: torch.Tensor) -> torch.Tensor:
    """[N, Vd] draft logits -> [N, V] log-probabilities over the target vocabulary."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, Vd]
    cfg = head.config
    if cfg.draft_vocab_size == cfg.vocab_size:
        return logp
    ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=logp.device))  # [Vd]
    full = logp.new_full((logp.shape[0], cfg.vocab_size), float("-inf"))
    return full.index_copy_(1, ids, logp)


@torch.inference_mode()
def parallel_log_probs(head: DraftHead, cache, root_hidden: torch.Tensor, root_position: int) -> torch.Tensor:
    """[K, V] log-probabilities of the K = block_size tokens after the root; `root_hidden` [H] is the
    root's output (`DraftHead.commit`)."""
    k = head.config.block_size
    device = root_hidden.device
    committed = cache_length(cache)
    ids = torch.full((1, k - 1), head.config.block_mask_id(), dtype=torch.long, device=device)
    pos = torch.arange(root_position + 1, root_position + k, device=device)[None]  # [1, K-1]
    slots = cast(ParallelSlots, head)  # PEagleHead.draft_block, the one caller, passes itself
    hidden = slots.slot_hidden(k - 1).to(root_hidden.dtype)[None]  # [1, K-1, H]
    out = head(ids, hidden, pos, attention_mask=None, past_key_values=cache)[0]  # [K-1, H], causal
    crop_cache(cache, committed)
    return draft_to_target_log_probs(head, head.logits(torch.cat([root_hidden[None], out])[None])[0])  # [K, V]
