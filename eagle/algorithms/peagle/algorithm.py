"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 head that drafts K = `draft.parallel_tokens` tokens a pass.

Feature spec: EAGLE-3's (the three aux layers plus the final state, whose LM-head logits are the soft
labels); a capture made for EAGLE-3 trains it as it is.

Training, one forward per micro-batch over [the sequence | the parallel slots of its anchors]:
  - depth 0: every index t reads (x_{t+1}, f_t) causally and predicts x_{t+2}, as EAGLE-3's first step;
  - depth j (1..K-1): up to `train.anchors_per_sequence` anchors a per sequence (random indices whose
    depth-1 label is a loss token) each get slots (mask token, `mask_hidden`) at positions a+1+j that
    see the real context up to a and their own earlier slots, and predict x_{a+2+j}.
An anchor keeps slot j with probability max(cod_ratio^j, cod_floor), always a prefix of its slots
(the paper's subsampling: deep slots cost as much as shallow ones and matter less to acceptance).
Depth j's loss is the soft CE (or `train.loss`) against the target's law there, weighed decay^j as
EAGLE-3 weighs its unroll steps; the logs' acc@j is depth j.

Export: vLLM's EAGLE-3 folder plus `mask_hidden` and a top-level `mask_token_id`, served with
`speculative_config = {"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}`.
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
    own_head,
    take_positions,
    unroll_decay,
    unrolled_soft_ce,
)
from eagle.algorithms.eagle3.algorithm import Eagle3
from eagle.algorithms.losses import packed_positions, step_loss_mask
from eagle.algorithms.peagle.head import PEagleHead
from eagle.config import DraftConfig, TrainConfig
from eagle.heads.base import DraftHead, HeadConfig


def keep_thresholds(slots: int, ratio: float, floor: float) -> torch.Tensor:
    """[slots] probability that an anchor keeps slot j = 1..slots: max(ratio^j, floor), the paper's
    geometric share of depth j (speculators' `down_sample_ratio` / `down_sample_ratio_min`)."""
    return torch.clamp(ratio ** torch.arange(1, slots + 1, dtype=torch.float64), min=floor).float()


def choose_slots(
    depth1: torch.Tensor, count: int, slots: int, ratio: float, floor: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor [B, S], depth [B, S]) of each row's kept parallel slots, -1 / 0 padded.

    depth1 [B, T] bool: index a may anchor (its depth-1 label counts). Up to `count` anchors per row,
    drawn without replacement; each keeps the slots j with u < max(ratio^j, floor) for one draw u, a
    prefix of 1..slots since the threshold never rises with j (possibly empty: the anchor then trains
    depth 0 only, as every index does)."""
    b, t = depth1.shape
    keys = torch.rand(b, t, generator=generator).masked_fill(~depth1.cpu(), -1.0)  # [B, T]
    top = keys.topk(min(count, t), dim=1)
    anchors = torch.where(top.values >= 0, top.indices, -1)  # [B, A]
    u = torch.rand(anchors.shape, generator=generator)  # [B, A]
    keep = (u[..., None] < keep_thresholds(slots, ratio, floor)) & (anchors[..., None] >= 0)  # [B, A, J]
    depth = torch.arange(1, slots + 1).expand_as(keep)  # [B, A, J]
    order = keep.flatten(1).to(torch.int8).sort(dim=1, descending=True, stable=True).indices  # kept first
    s = max(int(keep.flatten(1).sum(1).max()), 1)
    kept = keep.flatten(1).gather(1, order)[:, :s]  # [B, S]
    slot_anchor = anchors[..., None].expand_as(keep).flatten(1).gather(1, order)[:, :s].masked_fill(~kept, -1)
    slot_depth = depth.flatten(1).gather(1, order)[:, :s].masked_fill(~kept, 0)
    return slot_anchor.to(depth1.device), slot_depth.to(depth1.device)


def parallel_attention_mask(valid: torch.Tensor, slot_anchor: torch.Tensor, slot_depth: torch.Tensor) -> torch.Tensor:
    """Bool [B, 1, T + S, T + S] over [sequence | slots]: index t sees the real indices up to t (and
    itself); slot (a, j) sees the real indices up to a and the slots (a, 1..j); a padding slot only itself."""
    b, t = valid.shape
    s = slot_anchor.shape[1]
    dev = valid.device
    idx = torch.arange(t, device=dev)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    real = causal & (valid[:, None, :] | torch.eye(t, dtype=torch.bool, device=dev))  # [B, T, T]
    slot_real = (idx <= slot_anchor[..., None]) & valid[:, None, :]  # [B, S, T]; anchor -1 sees nothing
    same = (slot_anchor[:, :, None] == slot_anchor[:, None, :]) & (slot_anchor[:, :, None] >= 0)  # [B, S, S]
    slot_slot = (same & (slot_depth[:, None, :] <= slot_depth[:, :, None])) | torch.eye(s, dtype=torch.bool, device=dev)
    top = torch.cat([real, torch.zeros(b, t, s, dtype=torch.bool, device=dev)], dim=2)  # [B, T, T + S]
    return torch.cat([top, torch.cat([slot_real, slot_slot], dim=2)], dim=1)[:, None]


def reference_parallel_mask(
    valid: list[list[bool]], slot_anchor: list[list[int]], slot_depth: list[list[int]]
) -> torch.Tensor:
    """`parallel_attention_mask` with a loop over every query and key: the definition."""
    b, t, s = len(valid), len(valid[0]), len(slot_anchor[0])
    mask = torch.zeros(b, 1, t + s, t + s, dtype=torch.bool)
    for r in range(b):
        for q in range(t):
            for k in range(t):
                mask[r, 0, q, k] = k <= q and (valid[r][k] or k == q)
        for i in range(s):
            a, j = slot_anchor[r][i], slot_depth[r][i]
            mask[r, 0, t + i, t + i] = True
            if a < 0:
                continue
            for k in range(t):
                mask[r, 0, t + i, k] = k <= a and valid[r][k]
            for i2 in range(s):
                if slot_anchor[r][i2] == a and slot_depth[r][i2] <= j:
                    mask[r, 0, t + i, t + i2] = True
    return mask


class PEagle(Eagle3):
    name: ClassVar[str] = PEagleHead.algorithm
    title: ClassVar[str] = "P-EAGLE"
    head_class: ClassVar[type[DraftHead]] = PEagleHead
    export_formats: ClassVar[tuple[str, ...]] = ("vllm", "hf")
    format_refusals: ClassVar[dict[str, str]] = {
        "speculators": "not written yet: speculators 0.9.0 has a P-EAGLE speculator (speculators/models/peagle) whose "
        "checkpoint names have not been mapped to eagle's; export format=vllm",
        "sglang": "not written yet: SGLang's parallel drafting has not been read against this layout",
        "llamacpp": "llama.cpp b11434 has no parallel drafting for EAGLE-3 (neither its converter nor "
        "src/models/eagle3.cpp reads mask_hidden); export format=vllm",
    }
    architectures: ClassVar[dict[str, str]] = {"vllm": "LlamaForCausalLMEagle3", "hf": "LlamaForCausalLMEagle3"}
    speculators_model_type: ClassVar[str | None] = None
    vllm_options: ClassVar[dict[str, Any]] = {"parallel_drafting": True}

    def block_drafts(self, cfg: HeadConfig) -> int | None:
        return cfg.block_size  # the root's own output, then block_size - 1 slots

    # --- training ------------------------------------------------------------------------------
    def loss_settings(self, draft: DraftConfig, train: TrainConfig, pad_id: int, training: bool) -> LossSettings:
        return LossSettings(
            steps=draft.parallel_tokens,
            decay=unroll_decay(train),
            feature_weight=0.0,
            token_weight=1.0,
            noise_std=0.0,
            pad_id=pad_id,
            loss=train.loss,
            anchors=train.anchors_per_sequence,
            cod_ratio=train.cod_ratio,
            cod_floor=train.cod_floor,
        )

    def plan_batch(self, batch: dict[str, Any], settings: LossSettings) -> dict[str, Any]:
        """Draw this micro-batch's anchors and kept slots (before the token counts, which depend on them)."""
        if "slot_anchor" not in batch:
            a = aligned_inputs(batch, settings.pad_id)
            depth1 = step_loss_mask(a["loss_mask"], a["valid"], 1)  # [B, T] slot 1 of an anchor here counts
            batch["slot_anchor"], batch["slot_depth"] = choose_slots(
                depth1, settings.anchors, settings.steps - 1, settings.cod_ratio, settings.cod_floor
            )
        return batch

    def _slot_labels(self, batch: dict[str, Any], loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(label index a + j [B, S], whether it counts [B, S]: a kept slot whose label is a loss token)."""
        anchor, depth = batch["slot_anchor"], batch["slot_depth"]
        t = loss_mask.shape[1]
        label = anchor + depth  # [B, S]
        safe = label.clamp(0, t - 1)
        counts = (anchor >= 0) & (label < t) & loss_mask.gather(1, safe)
        return safe, counts

    def step_token_counts(self, batch: dict[str, Any], settings: LossSettings) -> list[float]:
        a = aligned_inputs(self.plan_batch(batch, settings), settings.pad_id)
        _, counts = self._slot_labels(batch, a["loss_mask"])
        depth = batch["slot_depth"]
        first = float(step_loss_mask(a["loss_mask"], a["valid"], 0).sum())
        return [first] + [float((counts & (depth == j)).sum()) for j in range(1, settings.steps)]

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
        batch = self.plan_batch(batch, s)
        a = aligned_inputs(batch, s.pad_id)
        anchor, depth = batch["slot_anchor"], batch["slot_depth"]  # [B, S]
        b, t = a["valid"].shape
        n_slots = anchor.shape[1]
        hidden0 = head.project_features(batch["aux_hidden"])  # [B, T, 3, Ht] -> [B, T, H]
        slot_hidden = (
            own_head(head, PEagleHead).slot_hidden(b * n_slots).view(b, n_slots, -1).to(hidden0.dtype)
        )  # [B, S, H]
        ids = torch.cat([a["input_ids"], torch.full_like(anchor, head.config.block_mask_id())], dim=1)  # [B, T + S]
        base = a.get("positions", torch.arange(1, t + 1, device=ids.device).expand(b, t))  # [B, T] or [3, B, T]
        pos = torch.cat([base, take_positions(base, anchor.clamp(min=0)) + depth], -1)  # slot: anchor's + 1 + j
        mask = parallel_attention_mask(a["valid"], anchor, depth)  # [B, 1, T + S, T + S]
        out = head(ids, torch.cat([hidden0, slot_hidden], dim=1), pos, attention_mask=mask)  # [B, T + S, H]
        labels, masks, rows = packed_positions(a["loss_mask"], a["valid"], 1)  # depth 0, as EAGLE-3's step 0
        row_of = labels.flatten().cumsum(0).view_as(labels) - 1  # [B, T] label row of each loss index
        slot_label, counts = self._slot_labels(batch, a["loss_mask"])
        slot_row = row_of.gather(1, slot_label)  # [B, S] label row of each slot (valid where it counts)
        step_logits, step_rows = [head.logits(out[:, :t][masks[0]])], [rows[0]]
        for j in range(1, s.steps):
            at = counts & (depth == j)  # [B, S]
            step_logits.append(head.logits(out[:, t:][at]))  # [N_j, Vd]
            step_rows.append(slot_row[at])  # [N_j]
        target_logits, t2d, d2t = self.soft_labels(head, lm_head, batch, labels, label_rows)
        objective, step_loss, step_correct, step_tokens, r = unrolled_soft_ce(
            step_logits, target_logits, step_rows, t2d, d2t, s.decay, norms, s.loss
        )
        extra = {}
        if r.coverage is not None and label_rows is None:
            extra["coverage"] = r.coverage * step_tokens[0]
        return LossParts(objective, step_loss, step_correct, step_tokens, extra, torch.isfinite(objective.detach()))

    # --- export --------------------------------------------------------------------------------
    def config_fields(self, cfg: HeadConfig, fmt: str) -> dict[str, Any]:
        # vLLM fills the parallel slots with `mask_token_id` (llm_base_proposer._init_parallel_drafting_params).
        return {**super().config_fields(cfg, fmt), "mask_token_id": cfg.mask_token_id}

    def recognises(self, config: dict[str, Any]) -> bool:
        # EAGLE-3's architecture, and the key vLLM's parallel drafting reads (Eagle3.recognises: without it).
        return Algorithm.recognises(self, config) and "mask_token_id" in config
