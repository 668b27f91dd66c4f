"""EAGLE-3 draft head: fused low/mid/high target features, one decoder layer, reduced vocabulary.

    h0      = fc(cat(f_low, f_mid, f_high))                          [B, T, 3Ht] -> [B, T, H]
    x       = cat(input_layernorm(embed(x_{t+1})), hidden_norm(h))   [B, T, 2H]
    out     = midlayer(x, residual=h)                                [B, T, H]  (fed back as h)
    logits  = lm_head(norm(out))                                     [B, T, V_draft]

EAGLE-3.1 options (`HeadConfig`): fc_norm normalises each aux layer before fc,
h0 = fc(cat(fc_norm.0(f_low), fc_norm.1(f_mid), fc_norm.2(f_high))); norm_output returns norm(out)
from `forward`, so the normed state is fed back, and `logits` applies lm_head to it directly.

Draft id d maps to target id d + d2t[d]; t2d[v] says whether target id v is in the draft vocab.
Both are buffers saved with the head (vLLM / SGLang read them under these names).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from eagle.config import ConfigError
from eagle.heads.base import BorrowedModules, CausalLM, DraftHead, HeadConfig
from eagle.heads.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from eagle.heads.target_layer import copy_target_layer, effective_gain, target_final_norm
from eagle.heads.vocab import coverage, draft_vocab_from_counts, special_token_ids

log = logging.getLogger(__name__)


class Eagle3Head(DraftHead):
    """The EAGLE-3 head; sizes from `HeadConfig`, token embeddings borrowed from the target."""

    algorithm: ClassVar[str] = "eagle3"
    num_aux_layers: ClassVar[int] = 3
    reduced_vocab: ClassVar[bool] = True
    eagle31_options: ClassVar[bool] = True
    d2t: torch.Tensor  # [Vd] buffer: target id - draft id
    t2d: torch.Tensor  # [V] bool buffer: target ids in the draft vocabulary

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        if len(config.aux_layer_ids) != self.num_aux_layers:
            raise ValueError(f"EAGLE-3 needs {self.num_aux_layers} aux layer ids, got {config.aux_layer_ids}")
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, h, bias=False)
        self.midlayer = DecoderLayer(config, fused_input=True)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in config.aux_layer_ids
            )
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        # Identity vocab maps until `set_draft_vocab` (or a checkpoint) fills them in.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Borrowed, frozen target modules live in a plain dict: not submodules, so they are never
        # in parameters() / state_dict() / DDP's view of the head.
        self._borrowed = BorrowedModules()

    # --- target-owned pieces -------------------------------------------------------------------
    @property
    def target_embed_tokens(self) -> nn.Module:
        if "embed_tokens" not in self._borrowed:
            raise RuntimeError("attach_target(target_model) must be called before using the head")
        return self._borrowed["embed_tokens"]

    def attach_target(self, target: CausalLM) -> None:
        self._borrowed["embed_tokens"] = target.get_input_embeddings()

    def feature_layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary maps (see `eagle.heads.vocab.build_vocab_maps`)."""
        self.d2t.copy_(d2t.to(self.d2t))
        self.t2d.copy_(t2d.to(self.t2d))

    def init_from_target(
        self, target_model: CausalLM | None, vocab_counts: torch.Tensor | None, special_ids: Sequence[int] | None
    ) -> None:
        """Choose the draft vocabulary (a reduced one needs the training data's token counts [V];
        special ids, default the target's eos/bos/pad, are always kept) and start `lm_head` from the
        target's LM-head rows of that vocabulary."""
        cfg = self.config
        if cfg.draft_vocab_size < cfg.vocab_size:
            if vocab_counts is None:
                raise ConfigError(
                    f"draft.draft_vocab_size={cfg.draft_vocab_size} < vocabulary "
                    f"{cfg.vocab_size}: token counts of the training data are needed to "
                    "choose the draft vocabulary (or set draft.draft_vocab_size=null)"
                )
            if vocab_counts.numel() != cfg.vocab_size:
                raise ConfigError(
                    f"vocab_counts has {vocab_counts.numel()} entries, the target vocabulary {cfg.vocab_size}"
                )
            if special_ids is None:
                special_ids = special_token_ids(target_model) if target_model is not None else []
            ids, d2t, t2d = draft_vocab_from_counts(vocab_counts.cpu(), cfg.draft_vocab_size, special_ids)
            self.set_draft_vocab(d2t, t2d)
            log.info(
                "draft vocabulary: %d ids cover %.1f%% of the training tokens",
                ids.numel(),
                100 * coverage(vocab_counts.cpu(), t2d),
            )
        if target_model is not None:
            out = target_model.get_output_embeddings()
            weight = getattr(out, "weight", None)  # [V, H] the target's LM head (None: it has none)
            if isinstance(weight, torch.Tensor) and weight.shape[0] >= cfg.vocab_size:
                with torch.no_grad():
                    rows = weight[: cfg.vocab_size][self.t2d.to(weight.device)]  # [Vd, H]
                    self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def start_from_target_layer(self, target_layer: nn.Module) -> list[str]:
        """The decoder layer from `target_layer` (`copy_target_layer`), and `fc` as a pass-through of
        the last (highest) aux layer: the copied layer then starts on the residual stream it was made
        for, not on a random mix of three layers."""
        left = copy_target_layer(self.midlayer, target_layer)
        h, ht, k = self.config.hidden_size, self.config.target_hidden_size, len(self.config.aux_layer_ids)
        if h == ht:
            with torch.no_grad():
                self.fc.weight.zero_()  # [H, k * Ht]
                self.fc.weight[:, (k - 1) * ht :].copy_(torch.eye(h))
        return left

    def freeze_lm_head(self, target_model: CausalLM | None) -> None:
        """`lm_head` (the target's LM-head rows of the draft vocabulary, from `init_from_target`, or a
        warm start's) stops training. With `target_model` the final norm starts from the target's:
        then norm + lm_head read the head's output as the target's own output layer reads its last
        hidden state (SmolLM2's final-norm gain averages 1.8, not the fresh 1.0)."""
        if target_model is not None:
            final = target_final_norm(target_model)
            if final is None:
                log.info(
                    "train.freeze_lm_head: the target has no final norm by a known name; the head's "
                    "norm keeps its own initialisation"
                )
            elif self.config.hidden_size != self.config.target_hidden_size:
                log.info(
                    "train.freeze_lm_head: the head is %d wide, the target %d; the head's norm keeps its "
                    "own initialisation",
                    self.config.hidden_size,
                    self.config.target_hidden_size,
                )
            else:
                with torch.no_grad():
                    self.norm.weight.copy_(effective_gain(final, self.config.hidden_size, self.norm.weight))
        self.lm_head.requires_grad_(False)

    # --- the four steps ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.target_embed_tokens(input_ids)  # [B, T, H]
        return emb.to(self.fc.weight.dtype)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        b, t, k, ht = features.shape  # [B, T, 3, Ht]
        features = features.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            features = torch.stack([norm(features[:, :, i]) for i, norm in enumerate(self.fc_norm)], dim=2)
        return self.fc(features.reshape(b, t, k * ht))  # [B, T, H]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        embeds = self.embed(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(
            hidden, cos, sin, embeds=embeds, attention_mask=attention_mask, past_key_values=past_key_values
        )  # [B, T, H]
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = hidden if self.config.norm_output else self.norm(hidden)  # norm_output: already normed
        return self.lm_head(normed)  # [B, T, V_draft]
