"""EAGLE-3 (Li et al., 2025): fused low/mid/high target features, training-time test, reduced vocabulary.

Feature spec: the three aux layers `HeadConfig.aux_layer_ids` (the input of decoder layer i, vLLM's
convention) plus the final state, whose LM-head logits are the soft labels.
Loss: `ttt_steps`-step unroll on the head's own outputs, sum_i decay^i soft CE against the target's
distribution restricted to the draft vocabulary (`eagle.algorithms.losses.eagle3_loss`).
Export: vLLM / SGLang `LlamaForCausalLMEagle3`, speculators `Eagle3Speculator` (which renames
`midlayer.` to `layers.0.`), aux ids top-level (vLLM) or in SGLang's `eagle_config` (ids - 1);
llama.cpp gets the vLLM folder plus the commands that convert and serve it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from eagle.algorithms.base import (
    Algorithm,
    LossParts,
    LossSettings,
    aligned_inputs,
    own_head,
    unroll_aligned,
    unrolled_soft_ce,
)
from eagle.algorithms.eagle3.head import Eagle3Head
from eagle.algorithms.losses import packed_positions, shift_left
from eagle.heads.base import DraftHead, HeadConfig, weight_of

_SPECULATORS_PREFIX, _OURS_PREFIX = "layers.0.", "midlayer."
# Formats that store the decoder layer under another prefix than ours (vLLM renames midlayer. itself).
_LAYER_PREFIX = {"speculators": _SPECULATORS_PREFIX}
# Formats whose config lists the aux layer ids in `eagle_config` shifted by this much: SGLang captures
# layer (id + 1)'s input for each id listed there.
_EAGLE_CONFIG_ID_SHIFT = {"sglang": -1}


# What each engine cannot express of an EAGLE-3 head, read in its code (docs/serving.md keeps the table
# with the files and lines): per format, checks that return the reason a head of that config is refused.
# vLLM 0.32, SGLang 0.5.23 and speculators 0.9.0 build `fc_norm.{i}` and `norm_output` from the config keys
# of those names, so those formats serve both options.
_ENGINE_LIMITS: dict[str, tuple[Callable[[HeadConfig], str | None], ...]] = {
    "llamacpp": (
        lambda c: (
            (
                "fc_norm=true: llama.cpp b11434 has no per-layer norm before fc; its converter knows one "
                "norm_before_fc over the whole concatenation of the aux layers and stops at 'fc_norm.0.weight' "
                "(convert_hf_to_gguf.py: conversion/llama.py LlamaModel.modify_tensors), and "
                "src/models/eagle3.cpp has no per-layer norms"
            )
            if c.fc_norm
            else None
        ),
        lambda c: (
            (
                "norm_output=true: llama.cpp b11434 feeds the pre-norm state back (src/models/eagle3.cpp sets "
                "t_h_nextn before output_norm) and its converter never reads norm_output (conversion/llama.py), "
                "so the GGUF would silently draft from other values"
            )
            if c.norm_output
            else None
        ),
        lambda c: (
            (
                "attention_bias=true: llama.cpp b11434's draft-eagle3 layer has no q/k/v/o biases "
                "(src/models/eagle3.cpp load_arch_tensors)"
            )
            if c.attention_bias
            else None
        ),
    ),
    "speculators": (
        lambda c: (
            (
                f"target_hidden_size={c.target_hidden_size} != hidden_size={c.hidden_size}: speculators 0.9.0 "
                "sizes fc and fc_norm from the draft's hidden size (speculators/models/eagle3/core.py "
                "Eagle3DraftModel.__init__)"
            )
            if c.target_hidden_size != c.hidden_size
            else None
        ),
    ),
}


class Eagle3(Algorithm):
    name: ClassVar[str] = Eagle3Head.algorithm
    title: ClassVar[str] = "EAGLE-3"
    head_class: ClassVar[type[DraftHead]] = Eagle3Head
    owns_lm_head: ClassVar[bool] = True
    export_formats: ClassVar[tuple[str, ...]] = ("vllm", "sglang", "speculators", "hf", "llamacpp")
    # llamacpp: the vLLM folder, which llama.cpp's converter reads under this name (conversion/llama.py).
    architectures: ClassVar[dict[str, str]] = {
        "vllm": "LlamaForCausalLMEagle3",
        "sglang": "LlamaForCausalLMEagle3",
        "hf": "LlamaForCausalLMEagle3",
        "llamacpp": "LlamaForCausalLMEagle3",
    }
    known_architectures: ClassVar[tuple[str, ...]] = (
        "LlamaForCausalLMEagle3",
        "Eagle3LlamaForCausalLM",
        "Eagle3Qwen3vlForCausalLM",  # vLLM's names of the same draft for vision-language targets
        "Eagle3Qwen2_5vlForCausalLM",
    )
    speculators_model_type: ClassVar[str | None] = "eagle3"
    vllm_method: ClassVar[str] = "eagle3"
    sglang_algorithm: ClassVar[str] = "EAGLE3"
    extra_metrics: ClassVar[tuple[str, ...]] = ("coverage",)

    def recognises(self, config: dict[str, Any]) -> bool:
        # A parallel-drafting folder (P-EAGLE: mask_token_id for its slots) has the same architecture.
        return super().recognises(config) and "mask_token_id" not in config

    def label_rows(self, head: DraftHead, lm_head: nn.Module) -> torch.Tensor | None:
        """The frozen LM head's rows for the draft vocabulary ([Vd, H]) when it is reduced: the soft
        labels then cost a [Vd, H] matmul per step instead of [V, H]."""
        cfg = head.config
        if cfg.draft_vocab_size >= cfg.vocab_size or getattr(lm_head, "bias", None) is not None:
            return None
        d2t = own_head(head, Eagle3Head).d2t
        weight = weight_of(lm_head)
        ids = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t  # [Vd] target ids
        return weight.detach()[ids.to(weight.device)].to(d2t.device)  # [Vd, H]

    def forward_loss(
        self,
        head: DraftHead,
        lm_head: nn.Module,
        batch: dict[str, Any],
        settings: LossSettings,
        norms: torch.Tensor | None,
        label_rows: torch.Tensor | None = None,
    ) -> LossParts:
        s = settings
        a = aligned_inputs(batch, s.pad_id)
        hidden0 = head.project_features(batch["aux_hidden"])  # [B, T, 3, Ht] -> [B, T, H]
        outs = unroll_aligned(head, a, hidden0, s)  # steps x [B, T, H]
        # Logits only where a step's loss reads them, labels only at loss tokens (not at prompts or padding).
        labels, masks, rows = packed_positions(a["loss_mask"], a["valid"], s.steps)
        step_logits = [head.logits(o[m]) for o, m in zip(outs, masks, strict=True)]  # steps x [N_i, Vd]
        target_logits, t2d, d2t = self.soft_labels(head, lm_head, batch, labels, label_rows)
        objective, step_loss, step_correct, step_tokens, r = unrolled_soft_ce(
            step_logits, target_logits, rows, t2d, d2t, s.decay, norms, s.loss
        )
        extra = {}
        if r.coverage is not None and label_rows is None:  # with label rows every label is in the draft vocab
            extra["coverage"] = r.coverage * step_tokens[0]
        return LossParts(objective, step_loss, step_correct, step_tokens, extra, torch.isfinite(objective.detach()))

    @torch.no_grad()
    def soft_labels(
        self,
        head: DraftHead,
        lm_head: nn.Module,
        batch: dict[str, Any],
        labels: torch.Tensor,
        label_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the target's logits [N, V or Vd] at the label positions `labels` [B, T] (index t: the law of
        x_{t+2}, from f_{t+1}), the t2d / d2t maps that compare them with the head's draft ids)."""
        next_feature = shift_left(batch["final_hidden"], 1)[labels]  # [N, H] f_{t+1} at the labels
        if label_rows is None:
            own = own_head(head, Eagle3Head)
            return lm_head(next_feature.to(weight_of(lm_head).dtype)), own.t2d, own.d2t  # [N, V]
        # Soft labels from the draft vocabulary's LM-head rows only (Vd instead of V columns): the same
        # renormalised target distribution; accuracy is then against the target's best draft-vocabulary
        # token (equal to the full top-1 whenever that is in the draft vocab).
        target_logits = next_feature.to(label_rows.dtype) @ label_rows.T  # [N, Vd]
        vd = label_rows.shape[0]
        t2d = torch.ones(vd, dtype=torch.bool, device=target_logits.device)
        d2t = torch.zeros(vd, dtype=torch.long, device=target_logits.device)  # compare draft ids directly
        return target_logits, t2d, d2t

    # --- export --------------------------------------------------------------------------------
    def export_tensor_name(self, name: str, fmt: str) -> str:
        prefix = _LAYER_PREFIX.get(fmt)
        if prefix is not None and name.startswith(_OURS_PREFIX):
            return prefix + name[len(_OURS_PREFIX) :]
        return name

    def canonical_tensor_name(self, name: str) -> str:
        if name.startswith(_SPECULATORS_PREFIX):
            return _OURS_PREFIX + name[len(_SPECULATORS_PREFIX) :]
        return name

    def default_tensors(self, cfg: HeadConfig, fmt: str) -> dict[str, torch.Tensor]:
        if cfg.draft_vocab_size != cfg.vocab_size:
            return {}
        # A full-vocabulary head may store no maps: they are the identity.
        return {
            "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
            "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool),
        }

    # What each engine cannot express of an EAGLE-3 head, read in its code (docs/serving.md keeps the
    # table with the files and lines). vLLM 0.32, SGLang 0.5.23 and speculators 0.9.0 build `fc_norm.{i}`
    # and `norm_output` from the config keys of those names, so those formats serve both options.
    def export_refusals(self, cfg: HeadConfig, fmt: str) -> list[str]:
        out = super().export_refusals(cfg, fmt)
        return out + [reason for limit in _ENGINE_LIMITS.get(fmt, ()) if (reason := limit(cfg))]

    def config_fields(self, cfg: HeadConfig, fmt: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": False,
        }
        for name in ("fc_norm", "norm_output"):  # written only when on: older exports, and runtimes, default off
            if getattr(cfg, name):
                out[name] = True
        shift = _EAGLE_CONFIG_ID_SHIFT.get(fmt)
        if shift is not None:
            out["eagle_config"] = {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": [i + shift for i in cfg.aux_layer_ids],
            }
        else:
            out["eagle_config"] = {"use_aux_hidden_state": True}
            out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
        return out
