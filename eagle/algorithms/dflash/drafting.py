"""DFlash's drafting step: one head pass gives the law of every block position.

The head's cache holds the fused target context of every committed token (`DFlashContextCache`); a
step runs the block [root, MASK, ..., MASK] at positions root_position .. root_position + Q - 1 over
that context and itself, and block position j >= 1 gives q_j, the head's law of the token j after the
root. Nothing of the block is cached. The decoder turns the laws into a chain or a tree
(`eagle.decode.block`).
"""

from __future__ import annotations

import torch

from eagle.heads.base import DraftHead


@torch.inference_mode()
def block_log_probs(head: DraftHead, cache, root_token: int, root_position: int) -> torch.Tensor:
    """[Q - 1, V] log-probabilities of the block_size - 1 tokens after the root."""
    q_len = head.config.block_size
    device = next(head.parameters()).device
    ids = torch.full((1, q_len), head.config.block_mask_id(), dtype=torch.long, device=device)
    ids[0, 0] = root_token
    pos = torch.arange(root_position, root_position + q_len, device=device)[None]  # [1, Q]
    out = head(ids, None, pos, attention_mask=None, past_key_values=cache)  # [1, Q, H]
    return torch.log_softmax(head.logits(out[:, 1:])[0].float(), dim=-1)  # [Q - 1, V]
