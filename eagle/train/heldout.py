"""Held-out evaluation during training: the loss, acc@k and tau_sim that pick `best/`.

Not the eval stage (`eagle.evaluate`, real speculative decoding on held-out prompts): this runs the
training loss on the capture's held-out split, unrolled `train.ttt_steps` deep and without noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eagle.algorithms import get_algorithm
from eagle.config import RootConfig
from eagle.errors import TrainingError
from eagle.heads.base import DraftHead
from eagle.train.batches import eval_batch_count, eval_batches
from eagle.train.metrics import MetricSums


@torch.no_grad()
def evaluate_heldout(
    head: DraftHead, lm_head: nn.Module, split: Any, cfg: RootConfig, accelerator: Any, pad_id: int
) -> dict[str, float]:
    """Held-out metrics over the first `eval_batches x batch_size` conversations (fixed, all ranks)."""
    t = cfg.train
    algo = get_algorithm(cfg.draft.algorithm)
    settings = algo.loss_settings(cfg.draft, t, pad_id, training=False)
    micro = max(1, t.batch_size // (t.grad_accum * accelerator.num_processes))
    sums = MetricSums()
    was_training = head.training
    head.eval()
    num_items, done = t.eval_batches * t.batch_size, 0
    try:
        for batch in eval_batches(
            split, num_items, micro, t.max_length, pad_id, accelerator.process_index, accelerator.num_processes
        ):
            batch = split.featurize(batch, accelerator.device)
            done += 1
            with accelerator.autocast():
                parts = algo.forward_loss(head, lm_head, batch, settings, norms=None)
            sums.add(
                parts.step_loss,
                parts.step_correct,
                parts.step_tokens,
                parts.extra,
                float(batch["attention_mask"].sum()),
            )
        # Ranks can hold one micro-batch fewer than rank 0; a sharded target's forwards must stay in step.
        for _ in range(eval_batch_count(num_items, len(split), micro, accelerator.num_processes) - done):
            split.idle_forward(accelerator.device)
    finally:
        head.train(was_training)
    if not sums.step_tokens:  # this rank had no held-out items: contribute zeros to the reduce
        zeros = [0.0] * settings.steps
        sums.add(zeros, zeros, zeros, dict.fromkeys(algo.extra_metrics, 0.0))
    return sums.reduce(accelerator).summary(*algo.summary_weights(t, settings.steps))


def check_heldout_finite(metrics: dict[str, float], head: nn.Module, when: str) -> None:
    """A non-finite held-out metric means the run cannot be trusted: stop and say why."""
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if not bad:
        return
    weights_ok = all(bool(torch.isfinite(p).all()) for p in head.parameters())
    cause = (
        "the held-out data give non-finite losses (inf/nan features, or target logits that overflow)"
        if weights_ok
        else "the head's weights are no longer finite (training diverged: lower train.lr, keep train.grad_clip > 0)"
    )
    raise TrainingError(
        f"held-out metrics of {when} are not finite ({', '.join(bad)}): {cause}; checkpoints written so far are kept"
    )
