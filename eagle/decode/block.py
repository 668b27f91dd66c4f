"""Verifying a block drafter's laws (DFlash, P-EAGLE): one head pass (`DraftHead.draft_block`) gives
the law q_j of every block position j = 1..D after the root; from them the decoder verifies
  - a chain of each position's top-1 (greedy) or of draws from q_j (sampled, kept with q_j for
    speculative sampling: each q_j is fixed before the target's draws, so the walk stays lossless);
  - a tree: position j's top-k as the children of each kept depth-(j-1) node, kept by cumulative
    log-probability as EAGLE-2 keeps its pool (`eagle.decode.draft.tree_from_pool`).
"""

from __future__ import annotations

import torch

from eagle.decode.accept import process_logits, sample_index
from eagle.decode.draft import DraftPool
from eagle.decode.tree import Tree, chain_tree


def sampled_chain(
    log_probs: torch.Tensor,
    root_token: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tree:
    """One draw from each block position's law q_j (after the target's temperature / top-k / top-p),
    kept with q_j for `walk_tree_sampled`; log_probs [Q - 1, V]."""
    tokens, probs = [], {}
    for j in range(log_probs.shape[0]):
        q = process_logits(log_probs[j], temperature, top_k, top_p)  # [V]
        tokens.append(sample_index(q, generator))
        probs[j + 1] = q
    return chain_tree([root_token] + tokens, log_probs.device, probs)


def block_pool(log_probs: torch.Tensor, top_k: int) -> DraftPool:
    """Candidates for a dynamic tree from per-position laws [D, V]: depth 1 is position 1's top-k; each
    later depth gives position j's top-k to the top_k best nodes (by cumulative log-probability) of the
    depth before, as `eagle.decode.draft.draft_pool` expands the frontier."""
    device = log_probs.device
    top = log_probs.topk(top_k, dim=-1)  # [D, k]
    tokens, scores = [top.indices[0]], [top.values[0]]
    parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    depths = [torch.ones(top_k, dtype=torch.long, device=device)]
    frontier, front_scores, size = torch.arange(top_k, device=device), top.values[0], top_k
    for d in range(1, log_probs.shape[0]):
        f = frontier.numel()
        cand = (front_scores[:, None] + top.values[d][None]).flatten()  # [F * k]
        tokens.append(top.indices[d].repeat(f))
        scores.append(cand)
        parents.append(frontier.repeat_interleave(top_k))
        depths.append(torch.full((f * top_k,), d + 1, dtype=torch.long, device=device))
        best = cand.topk(min(top_k, cand.numel())).indices  # next frontier among the new nodes
        frontier, front_scores = size + best, cand[best]
        size += f * top_k
    return DraftPool(torch.cat(tokens), torch.cat(parents), torch.cat(scores), torch.cat(depths))
