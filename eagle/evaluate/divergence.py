"""Why a low-precision greedy run left HF `generate`'s output: numerics or a bug.

In float32 the speculative decoder's greedy output is token-identical to HF `generate`. In bfloat16 /
float16 the target's logits for a token depend slightly on how it was computed: a verify pass over
17 tree tokens runs other kernels (other summation orders) than 17 one-token steps, so at a near-tie
the argmax can flip, and the two outputs part ways there. HF `generate` shows the same flips when
the same sequence is computed in other chunk sizes. A decoder bug (a wrong accepted path, a cache
off by one) emits a token the target does not rank first by a clear margin.

So for every greedy divergence we recompute, in float32 and from the shared context, the target's
logits at the first differing position and record
  * `margin`: top-1 minus top-2 logit (how close to a tie the target was there), and
  * `gap`: |logit(our token) - logit(HF's token)| (how close the two choices were).
A numeric flip has both small; `eval.divergence_margin_limit` is the bound the report checks.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def divergence_at(
    model_fp32: Any,
    prompt_ids: torch.Tensor,  # [1, T]
    ours: list[int],
    theirs: list[int],
    position: int,
) -> dict[str, Any]:
    """Float32 logits at the first differing position of two greedy continuations of one prompt."""
    device = next(model_fp32.parameters()).device
    context = torch.cat([prompt_ids[0].cpu(), torch.tensor(ours[:position], dtype=torch.long)])[None].to(device)
    logits = model_fp32(input_ids=context, use_cache=False).logits[0, -1].float()  # [V]
    top = logits.topk(2)
    rec: dict[str, Any] = {
        "position": position,
        "fp32_top1": int(top.indices[0]),
        "margin": float(top.values[0] - top.values[1]),
    }
    a = ours[position] if position < len(ours) else None
    b = theirs[position] if position < len(theirs) else None
    rec["ours"], rec["theirs"] = a, b
    # One output ended (EOS / length) where the other went on: compare against the fp32 choice.
    a_logit = float(logits[a]) if a is not None else float(top.values[0])
    b_logit = float(logits[b]) if b is not None else float(top.values[0])
    rec["gap"] = abs(a_logit - b_logit)
    return rec


def summarize(records: list[dict[str, Any] | None], limit: float) -> dict[str, Any]:
    """Run-level figures over per-turn divergence records (None = that turn matched)."""
    found = [r for r in records if r is not None]
    worst = max((max(r["margin"], r["gap"]) for r in found), default=0.0)
    return {
        "divergent_turns": len(found),
        "turns": len(records),
        "max_margin": max((r["margin"] for r in found), default=None),
        "max_gap": max((r["gap"] for r in found), default=None),
        "margin_limit": limit,
        # True: every divergence sits at a float32 near-tie (numerics); False: at least one does not.
        "all_numeric": worst <= limit,
    }


__all__ = ["divergence_at", "summarize"]
