"""DFlash (arXiv 2602.06036): a block of draft tokens per pass, trained on many anchors per sequence.

Feature spec: the three aux layers `HeadConfig.aux_layer_ids` (the same capture as EAGLE-3) plus the
final state, whose LM-head logits are the soft labels.

Training: each sequence gets up to `train.anchors_per_sequence` anchors a (random positions whose next
token is a loss token). Anchor a's block is [x_a, MASK, ..., MASK] at positions a..a+Q-1; it reads the
fused context f_0..f_{a-1} and itself (no causal mask), and block position j predicts x_{a+j} against
the target's law there (lm_head(f_{a+j-1})). All anchors of a batch run in one pass: the queries are
the blocks side by side, the keys [the context | every block], and `block_attention_mask` keeps each
block to its own keys and to the context before its anchor (the block-sparse mask). Position j's loss
is weighted by `train.position_weights` and measured per position (acc@j-1 in the logs).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from eagle.algorithms.base import (
    Algorithm,
    LossParts,
    LossSettings,
    own_head,
    take_positions,
    target_positions,
    token_norms,
)
from eagle.algorithms.dflash import transformers_drafter
from eagle.algorithms.dflash.head import DFlashHead
from eagle.algorithms.objectives import dpace_weights, position_weights, token_losses
from eagle.config import DraftConfig, TrainConfig
from eagle.heads.base import DraftHead, HeadConfig


def choose_anchors(
    loss_mask: torch.Tensor, valid: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[B, A] anchor positions, -1 padded: up to `count` per row, drawn without replacement among the
    positions a >= 1 (at least one context token) whose token is real and whose next token is a loss
    token (the block's first draft counts). loss_mask, valid: [B, T] bool (x_t is a loss / real token)."""
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool)
    ok[:, 1:-1] = valid[:, 1:-1].cpu() & loss_mask[:, 2:].cpu()  # a in [1, T-2], x_{a+1} a loss token
    a = min(count, t)
    keys = torch.rand(b, t, generator=generator).masked_fill(~ok, -1.0)  # [B, T] random order of candidates
    top = keys.topk(a, dim=1)
    anchors = torch.where(top.values >= 0, top.indices, -1)  # [B, A]
    return anchors.sort(dim=1, descending=True).values.to(loss_mask.device)  # real anchors first


def label_positions(
    anchors: torch.Tensor, block_size: int, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, A, Q-1] of the tokens block positions 1..Q-1 predict (a + j), where each counts
    [B, A, Q-1]: a real anchor, inside the sequence, a loss token)."""
    t = loss_mask.shape[1]
    j = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + j  # [B, A, Q-1]
    inside = (anchors[..., None] >= 0) & (pos < t)
    safe = pos.clamp(0, t - 1)
    counts = inside & loss_mask.to(torch.bool).gather(1, safe.flatten(1)).view_as(pos)
    return safe, counts


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [B, A*Q]: the anchor's token then mask tokens, positions [B, A*Q]: a..a+Q-1)."""
    b, a = anchors.shape
    safe = anchors.clamp(min=0)
    ids = torch.full((b, a, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, safe)
    pos = safe[..., None] + torch.arange(block_size, device=anchors.device)  # [B, A, Q]
    return ids.view(b, a * block_size), pos.view(b, a * block_size)


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [B, 1, A*Q, T + A*Q]: anchor a's block sees the real context tokens before a and its own
    block; a padding anchor (-1) sees only its own block (its outputs never count)."""
    b, a = anchors.shape
    t = valid.shape[1]
    ctx = (torch.arange(t, device=anchors.device) < anchors[..., None]) & valid[:, None, :].to(torch.bool)  # [B, A, T]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, A*Q, T]
    owner = torch.arange(a * block_size, device=anchors.device) // block_size  # [A*Q] block of each query/key
    own = (owner[:, None] == owner[None, :]).expand(b, -1, -1)  # [B, A*Q, A*Q]
    return torch.cat((ctx, own), dim=-1)[:, None]


def reference_block_mask(anchors: list[list[int]], valid: list[list[bool]], block_size: int) -> torch.Tensor:
    """`block_attention_mask` with loops over every query and key: the definition."""
    b, a, t = len(anchors), len(anchors[0]), len(valid[0])
    mask = torch.zeros(b, 1, a * block_size, t + a * block_size, dtype=torch.bool)
    for r in range(b):
        for i, anchor in enumerate(anchors[r]):
            for j in range(block_size):
                q = i * block_size + j
                for s in range(t):
                    mask[r, 0, q, s] = s < anchor and valid[r][s]
                for k in range(block_size):
                    mask[r, 0, q, t + i * block_size + k] = True
    return mask


class DFlash(Algorithm):
    name: ClassVar[str] = DFlashHead.algorithm
    title: ClassVar[str] = "DFlash"
    head_class: ClassVar[type[DraftHead]] = DFlashHead
    takes_dpace: ClassVar[bool] = True
    # vllm: vLLM's `DFlashDraftModel` (qwen3_dflash.py): top-level fc / hidden_norm / norm / layers.N.*, the
    # target's embeddings and LM head shared (the folder holds neither), dflash_config.{mask_token_id,
    # target_layer_ids}; z-lab's layout, which llama.cpp's converter (conversion/qwen.py DFlashModel) reads too.
    # llamacpp: the vLLM folder, which llama.cpp b11434's converter reads as DFlashDraftModel (conversion/qwen.py),
    # served with --spec-type draft-dflash.
    # transformers: transformers' own DFlash drafter (`MuseGlimmerAssistantModel`), which its `generate` runs with
    # speculation_type="dflash"; fc / hidden_norm under `encoder.` (eagle/algorithms/dflash/transformers_drafter.py).
    export_formats: ClassVar[tuple[str, ...]] = ("vllm", "hf", "llamacpp", "transformers")
    format_refusals: ClassVar[dict[str, str]] = {
        "speculators": "not written yet: speculators 0.9.0 has a DFlash speculator (speculators/models/dflash) whose "
        "checkpoint names have not been mapped to eagle's; export format=vllm",
        "sglang": "not written yet: SGLang's DFlash loader has not been read against this layout",
    }
    architectures: ClassVar[dict[str, str]] = {
        "vllm": "DFlashDraftModel",
        "hf": "DFlashDraftModel",
        "llamacpp": "DFlashDraftModel",
        "transformers": transformers_drafter.ARCHITECTURE,
    }
    llamacpp_spec_type: ClassVar[str] = "draft-dflash"
    known_architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel", transformers_drafter.ARCHITECTURE)
    vllm_method: ClassVar[str] = "dflash"
    sglang_algorithm: ClassVar[str] = "DFLASH"

    def block_drafts(self, cfg: HeadConfig) -> int | None:
        return cfg.block_size - 1  # the anchor is the newest accepted token, not a draft

    # --- training ------------------------------------------------------------------------------
    def loss_settings(self, draft: DraftConfig, train: TrainConfig, pad_id: int, training: bool) -> LossSettings:
        return LossSettings(
            steps=draft.block_size - 1,
            decay=1.0,
            feature_weight=0.0,
            token_weight=1.0,
            noise_std=0.0,
            pad_id=pad_id,
            loss=train.loss,
            position_weights="decay" if train.position_weights == "auto" else train.position_weights,
            position_gamma=train.position_gamma,
            anchors=train.anchors_per_sequence,
            block_size=draft.block_size,
        )

    def summary_weights(self, train: TrainConfig, steps: int) -> tuple[list[float], dict[str, float]]:
        # dpace weighs tokens, not positions: the logged total uses DFlash's static decay in its place.
        rule = "decay" if train.position_weights in ("auto", "dpace") else train.position_weights
        return position_weights(rule, steps, train.position_gamma).tolist(), {}

    def plan_batch(self, batch: dict[str, Any], settings: LossSettings) -> dict[str, Any]:
        """Draw this micro-batch's anchors (before the token counts, which depend on them)."""
        if "anchors" not in batch:
            valid = batch["attention_mask"].to(torch.bool)
            batch["anchors"] = choose_anchors(batch["loss_mask"].to(torch.bool), valid, settings.anchors)
        return batch

    def step_token_counts(self, batch: dict[str, Any], settings: LossSettings) -> list[float]:
        _, counts = label_positions(
            self.plan_batch(batch, settings)["anchors"], settings.block_size, batch["loss_mask"]
        )
        return [float(c) for c in counts.sum((0, 1))]  # per block position 1..Q-1

    def forward_loss(
        self,
        head: DraftHead,
        lm_head: nn.Module,
        batch: dict[str, Any],
        settings: LossSettings,
        norms: torch.Tensor | None,
        label_rows: torch.Tensor | None = None,
    ) -> LossParts:
        s, q_len = settings, settings.block_size
        batch = self.plan_batch(batch, s)
        anchors, valid = batch["anchors"], batch["attention_mask"].to(torch.bool)  # [B, A], [B, T]
        b, t = valid.shape
        ctx = head.project_features(batch["aux_hidden"])  # [B, T, 3, Ht] -> [B, T, H]
        rows = target_positions(batch)  # [3, B, T] an M-RoPE target's; the head reads the time row
        seq = torch.arange(t, device=ctx.device).expand(b, t) if rows is None else rows  # [B, T] or [3, B, T]
        context_kv = own_head(head, DFlashHead).context_kv(ctx, seq)
        ids, pos = block_inputs(batch["input_ids"], anchors, q_len, head.config.block_mask_id())  # [B, A*Q]
        if rows is not None:  # block position j: the anchor's target position + j
            pos = take_positions(rows, anchors.clamp(min=0)).unsqueeze(-1) + torch.arange(q_len, device=pos.device)
            pos = pos.flatten(-2)  # [3, B, A*Q]
        mask = block_attention_mask(anchors, valid, q_len)  # [B, 1, A*Q, T + A*Q]
        out = head(ids, None, pos, attention_mask=mask, past_key_values=context_kv)  # [B, A*Q, H]
        out = out.view(b, -1, q_len, out.shape[-1])[:, :, 1:]  # [B, A, Q-1, H] the draft positions
        labels, counts = label_positions(anchors, q_len, batch["loss_mask"])  # [B, A, Q-1]
        rows = counts.nonzero()  # [N, 3] (b, anchor, j - 1)
        logq = torch.log_softmax(head.logits(out[counts]).float(), dim=-1)  # [N, V]
        with torch.no_grad():
            teacher = batch["final_hidden"][rows[:, 0], labels[counts] - 1]  # [N, H] f_{a+j-1}
            target_logits = lm_head(teacher.to(lm_head.weight.dtype)).float()  # [N, V]
            p = torch.softmax(target_logits, -1)
        losses = token_losses(s.loss, logq, p)  # [N]
        j, n_pos = rows[:, 2], q_len - 1  # [N] block position - 1
        if s.position_weights == "dpace":
            ce = losses if s.loss == "ce" else -(p * logq).sum(-1)
            confidence = torch.zeros(counts.shape, device=logq.device)
            confidence[counts] = torch.exp(-ce.detach())  # the head's probability of the target's draw
            weights = dpace_weights(confidence, counts)[counts]  # [N]
        else:
            weights = position_weights(s.position_weights, n_pos, s.position_gamma).to(logq.device)[j]  # [N]
        step_tokens = list(torch.bincount(j, minlength=n_pos).float())  # n_pos x 0-d
        denom = torch.stack(token_norms(step_tokens, norms))
        objective = (torch.zeros(n_pos, device=logq.device).index_add(0, j, weights * losses) / denom).sum()
        with torch.no_grad():
            step_sum = torch.zeros(n_pos, device=logq.device).index_add(0, j, losses.detach())
            correct = (logq.argmax(-1) == target_logits.argmax(-1)).float()
            step_correct = torch.zeros(n_pos, device=logq.device).index_add(0, j, correct)
        return LossParts(
            objective, list(step_sum), list(step_correct), step_tokens, {}, torch.isfinite(objective.detach())
        )

    # --- export --------------------------------------------------------------------------------
    def export_refusals(self, cfg: HeadConfig, fmt: str) -> list[str]:
        out = super().export_refusals(cfg, fmt)
        if 0 in cfg.aux_layer_ids:
            # dflash_config.target_layer_ids names layer outputs (ours: layer inputs, id - 1); the embedding
            # output (our id 0) has no such name, in vLLM or in llama.cpp's converter.
            out.append(
                f"aux_layer_ids={cfg.aux_layer_ids}: id 0 (the embeddings) is not a decoder layer's output, "
                "which is what DFlash's target_layer_ids name; train with draft.aux_layer_ids >= 1"
            )
        if check := _FORMAT_REFUSALS.get(fmt):
            out += check(cfg)
        return out

    def export_tensor_name(self, name: str, fmt: str) -> str:
        return _STORED_NAMES.get(fmt, _same_name)(name)

    def canonical_tensor_name(self, name: str) -> str:
        return transformers_drafter.canonical_name(name)  # the other layouts use our names

    def config_fields(self, cfg: HeadConfig, fmt: str) -> dict[str, Any]:
        if own := _OWN_CONFIGS.get(fmt):  # a folder whose whole config is another library's class
            return own(cfg)
        # Qwen3-shaped draft layers (per-head q/k norms) whatever the target family, as the engines build them.
        return {
            "model_type": "qwen3",
            "num_hidden_layers": cfg.num_layers,
            "block_size": cfg.block_size,
            "target_hidden_size": cfg.target_hidden_size,
            "dflash_config": {
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
            },
        }


def _same_name(name: str) -> str:
    return name


# Per format (tables, not name comparisons: eagle/export/registry.py owns those): stored tensor names, a config
# that replaces the Llama layer config, and what the format's class cannot express.
_STORED_NAMES = {"transformers": transformers_drafter.stored_name}
_OWN_CONFIGS = {"transformers": transformers_drafter.drafter_config}
_FORMAT_REFUSALS = {"transformers": transformers_drafter.refusals}
