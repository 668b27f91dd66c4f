"""EAGLE-1 (Li et al., 2024): predict the target's next final feature; the target's LM head decodes it.

Feature spec: the target's final post-norm state only.
Loss (training): smooth-L1 on the predicted feature f_{t+1} + soft CE of the target's LM head on it,
on noisy input features (`eagle.algorithms.losses.eagle1_loss`), one step. Held-out evaluation also
unrolls the head on its own predictions to report acc_1.. (soft CE per step, no feature noise).
Export: vLLM `EagleLlamaForCausalLM` (fc without bias), SGLang `LlamaForCausalLMEagle` (fc with
bias); no speculators or llama.cpp format (neither engine has an EAGLE-1 draft).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from eagle.algorithms.base import (
    Algorithm,
    LossParts,
    LossSettings,
    aligned_inputs,
    token_norms,
    unroll_aligned,
    unrolled_soft_ce,
)
from eagle.algorithms.eagle1.head import Eagle1Head
from eagle.algorithms.losses import add_feature_noise, eagle1_loss, packed_positions, shift_left
from eagle.config import DraftConfig, TrainConfig
from eagle.errors import ExportError
from eagle.heads.base import DraftHead, HeadConfig, weight_of

# Formats whose EAGLE-1 model builds fc without a bias (vLLM's EagleLlamaForCausalLM); SGLang's has one.
_NO_FC_BIAS = ("vllm",)


class Eagle1(Algorithm):
    name: ClassVar[str] = Eagle1Head.algorithm
    title: ClassVar[str] = "EAGLE-1"
    head_class: ClassVar[type[DraftHead]] = Eagle1Head
    takes_lk_losses: ClassVar[bool] = False  # its loss is a feature regression plus a token loss
    export_formats: ClassVar[tuple[str, ...]] = ("vllm", "sglang", "hf")
    format_refusals: ClassVar[dict[str, str]] = {
        "speculators": "speculators 0.9.0 has no EAGLE-1 model (it registers eagle3, peagle, dflash, dflash2, "
        "dspark, mtp and xpress: speculators/models/*/core.py)",
        "llamacpp": "llama.cpp b11434 has no EAGLE-1 draft (convert_hf_to_gguf.py registers only the EAGLE-3 "
        "architectures, conversion/llama.py; --spec-type offers draft-eagle3, common/speculative.cpp)",
    }
    architectures: ClassVar[dict[str, str]] = {
        "vllm": "EagleLlamaForCausalLM",
        "sglang": "LlamaForCausalLMEagle",
        "hf": "EagleLlamaForCausalLM",
    }
    known_architectures: ClassVar[tuple[str, ...]] = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
    speculators_model_type: ClassVar[str | None] = None
    vllm_method: ClassVar[str] = "eagle"
    sglang_algorithm: ClassVar[str] = "EAGLE"
    extra_metrics: ClassVar[tuple[str, ...]] = ("feature_loss",)

    def loss_settings(self, draft: DraftConfig, train: TrainConfig, pad_id: int, training: bool) -> LossSettings:
        s = super().loss_settings(draft, train, pad_id, training)
        if not training:
            return s
        # Training is one step on noisy features; evaluation unrolls train.ttt_steps without noise.
        return LossSettings(1, s.decay, s.feature_weight, s.token_weight, draft.feature_noise_std, pad_id)

    def summary_weights(self, train: TrainConfig, steps: int) -> tuple[list[float], dict[str, float]]:
        return [train.token_loss_weight] + [0.0] * (steps - 1), {"feature_loss": train.feature_loss_weight}

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
        feats = add_feature_noise(batch["final_hidden"], s.noise_std, training=s.noise_std > 0)  # [B, T, H]
        hidden0 = head.project_features(feats[:, :, None])  # [B, T, H]
        outs = unroll_aligned(head, a, hidden0, s)  # steps x [B, T, H]
        with torch.no_grad():
            next_feature = shift_left(batch["final_hidden"], 1)  # [B, T, H] f_{t+1}
        mask = a["loss_mask"] & a["valid"]
        if s.steps == 1:
            r = eagle1_loss(outs[0], next_feature, weight_of(lm_head), mask, s.feature_weight, s.token_weight)
            count = torch.tensor(float(r.count), device=r.loss.device)  # eagle1_loss syncs anyway: it chunks by count
            objective = r.loss * (count / token_norms([count], norms)[0])
            return LossParts(
                objective,
                [r.token_loss.detach() * count],
                [(r.accuracy.to(count.device) * count).round()],
                [count],
                {"feature_loss": r.feature_loss.detach() * count},
                torch.isfinite(r.loss.detach()),
            )
        # Evaluation: the full-vocabulary soft CE per unroll step, plus step 0's feature loss as in training.
        labels, masks, rows = packed_positions(a["loss_mask"], a["valid"], s.steps)
        step_logits = [head.logits(o[m]) for o, m in zip(outs, masks, strict=True)]  # steps x [N_i, V]
        with torch.no_grad():
            target_logits = lm_head(next_feature[labels].to(weight_of(lm_head).dtype))  # [N, V]
        v = target_logits.shape[-1]
        t2d = torch.ones(v, dtype=torch.bool, device=target_logits.device)
        d2t = torch.zeros(v, dtype=torch.long, device=target_logits.device)
        objective, step_loss, step_correct, step_tokens, _ = unrolled_soft_ce(
            step_logits, target_logits, rows, t2d, d2t, s.decay, norms
        )
        diff = torch.nn.functional.smooth_l1_loss(outs[0][mask].float(), next_feature[mask].float(), reduction="none")
        return LossParts(
            objective,
            step_loss,
            step_correct,
            step_tokens,
            {"feature_loss": diff.mean(-1).sum().detach()},
            torch.isfinite(objective.detach()),
        )

    # --- export --------------------------------------------------------------------------------
    def default_tensors(self, cfg: HeadConfig, fmt: str) -> dict[str, torch.Tensor]:
        if fmt in (*_NO_FC_BIAS, "third-party"):  # vLLM's EAGLE-1 has no fc bias; old checkpoints often do
            return {"fc.bias": torch.zeros(cfg.hidden_size)}
        return {}

    def format_tensors(self, spec: dict[str, Any], fmt: str) -> dict[str, Any]:
        if fmt not in _NO_FC_BIAS:
            return spec
        return {k: v for k, v in spec.items() if k != "fc.bias"}  # vLLM's EagleLlamaForCausalLM: fc without bias

    def export_tensors(self, cfg: HeadConfig, tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
        if fmt not in _NO_FC_BIAS or "fc.bias" not in tensors:
            return tensors
        tensors = dict(tensors)
        bias = tensors.pop("fc.bias")
        if bool(bias.abs().max() > 0):
            raise ExportError(
                "vLLM's EAGLE-1 model (EagleLlamaForCausalLM) builds fc without a bias, and this "
                f"head's fc.bias is non-zero (max |b| = {float(bias.abs().max()):.3g}): a vLLM "
                "export would change its outputs. Use format=sglang (fc with bias) or format=hf."
            )
        return tensors

    def config_fields(self, cfg: HeadConfig, fmt: str) -> dict[str, Any]:
        return {"eagle_fc_bias": fmt not in _NO_FC_BIAS}
