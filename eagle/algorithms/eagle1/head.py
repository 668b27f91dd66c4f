"""EAGLE-1 draft head: predicts the target's next final feature, decoded by the target's LM head.

    x       = fc(cat(embed(x_{t+1}), f_t))          [B, T, 2H] -> [B, T, H]   (fc has a bias)
    out     = layers.0(x)                           [B, T, H]  predicted f_{t+1}
    logits  = target_lm_head(out)                   [B, T, V]  (full vocabulary)

The feature is the target's final post-norm hidden state (`output_hidden_states[-1]`), which is
what the target's LM head reads; so the head's output can go straight into that LM head.
Layer 0 has no input norm, as vLLM's EagleLlamaForCausalLM expects.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
from torch import nn

from eagle.heads.base import BorrowedModules, BorrowsTargetOutput, DraftHead, HeadConfig, weight_of
from eagle.heads.layers import DecoderLayer, RotaryEmbedding
from eagle.heads.target_layer import copy_target_layer


class Eagle1Head(BorrowsTargetOutput, DraftHead):
    """The EAGLE-1 head; token embeddings and LM head borrowed from the target."""

    algorithm: ClassVar[str] = "eagle1"

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError("EAGLE-1 uses the target's full vocabulary (draft_vocab_size must equal vocab_size)")
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(config, fused_input=False)])
        self.rotary_emb = RotaryEmbedding(config)
        self._borrowed = BorrowedModules()  # not submodules: never trained, never saved

    # --- target-owned pieces (attach_target: `BorrowsTargetOutput`) ---------------------------
    @property
    def target_embed_tokens(self) -> nn.Module:
        return self.borrowed("embed_tokens")

    @property
    def target_lm_head(self) -> nn.Module:
        return self.borrowed("lm_head")

    def feature_layer_ids(self) -> list[int]:
        return [-1]

    def start_from_target_layer(self, target_layer: nn.Module) -> list[str]:
        """The decoder layer from `target_layer` (`copy_target_layer`), and `fc` as a pass-through of
        the target feature (embedding half and bias zero), so the copied layer starts on the target's
        own state."""
        left = copy_target_layer(cast(DecoderLayer, self.layers[0]), target_layer)  # __init__: one DecoderLayer
        h = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()  # [H, 2H]: cat(embed, feature)
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.bias.zero_()
        return left

    # --- the four steps ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target_embed_tokens(input_ids).to(self.fc.weight.dtype)  # [B, T, H]

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[2] != 1:
            raise ValueError(f"EAGLE-1 takes one feature layer, got {features.shape[2]}")
        return features[:, :, 0].to(self.fc.weight.dtype)  # [B, T, H]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        x = self.fc(torch.cat((self.embed(input_ids), hidden), dim=-1))  # [B, T, 2H] -> [B, T, H]
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        return self.layers[0](x, cos, sin, attention_mask=attention_mask, past_key_values=past_key_values)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.target_lm_head
        return lm_head(hidden.to(weight_of(lm_head).dtype))  # [B, T, V]
