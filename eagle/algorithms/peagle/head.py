"""P-EAGLE draft head: an EAGLE-3 head that drafts K tokens in one forward pass.

The root's own output (the hidden `commit` returns, as in EAGLE-3) gives the first draft; K - 1 slots
follow it in one pass, each with the mask token's embedding and a learned target feature:

    slot j (1..K-1):  token = mask_token_id, feature = mask_hidden [k * Ht] (pre-fc, like the three aux
                      layers it stands in for), position = root_position + j
    attention:        causal over the committed context, the root and the slots before it
    out_j             predicts the token j + 1 after the root

so a slot sees what an EAGLE-3 unroll step would, except that the drafts before it are unknown (the
mask) instead of sampled. vLLM's EAGLE-3 parallel drafting (`speculative_config.parallel_drafting`)
runs the same pass: it reads `mask_hidden` [1, k * Ht], applies fc (and the EAGLE-3.1 fc_norm) to it
once, and fills the slots with `mask_token_id` (llama_eagle3.py, llm_base_proposer.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from eagle.algorithms.eagle3.head import Eagle3Head
from eagle.algorithms.peagle.drafting import parallel_log_probs
from eagle.config import DraftConfig
from eagle.heads.base import HeadConfig


class PEagleHead(Eagle3Head):
    """The P-EAGLE head: EAGLE-3's parts plus `mask_hidden`; `block_size` = K tokens a pass."""

    algorithm: ClassVar[str] = "peagle"
    drafts_block: ClassVar[bool] = True

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        if config.block_size < 2 or config.mask_token_id is None:
            raise ValueError(
                f"P-EAGLE needs block_size >= 2 and a mask token, got {config.block_size} and {config.mask_token_id}"
            )
        # Unit scale: fc's input is the raw aux layers (hidden_norm follows fc in `forward`, and a zero
        # start would sit where that norm's gradient is largest).
        k = len(config.aux_layer_ids)
        self.mask_hidden = nn.Parameter(torch.randn(1, k * config.target_hidden_size))  # [1, k * Ht]

    @classmethod
    def block_fields(cls, draft: DraftConfig) -> dict[str, int]:
        return {"block_size": int(draft.parallel_tokens)}

    def slot_hidden(self, n: int) -> torch.Tensor:
        """[n, H] the projected feature of n parallel slots (fc, and fc_norm, over `mask_hidden`)."""
        k = len(self.config.aux_layer_ids)
        feat = self.mask_hidden.view(1, 1, k, self.config.target_hidden_size)  # [1, 1, k, Ht]
        return self.project_features(feat)[0].expand(n, -1)  # [n, H]

    def draft_block(
        self, cache: Any, root_token: int, root_hidden: torch.Tensor | None, root_position: int
    ) -> torch.Tensor:
        if root_hidden is None:
            raise ValueError("P-EAGLE drafts from the root's output hidden (what commit returns)")
        return parallel_log_probs(self, cache, root_hidden, root_position)  # [K, V]
