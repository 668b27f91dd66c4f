"""Drafting a tree with the head over its own KV cache.

The head's cache holds one entry per committed pair (token x_{t+1}, target feature f_t), appended by
`DraftHead.commit` — see `eagle.heads.base` for the alignment. The last committed entry is the root
(the newest accepted token); its output hidden state `root_hidden` predicts the root's children. Each
further depth level feeds the current frontier nodes (token, their parent's output hidden) in one head
forward, where each frontier node attends to the committed prefix, its drafted ancestors and itself.
Draft entries are cropped from the head cache once the tree is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.config import DecodeConfig
from eagle.decode.accept import process_logits, sample_index
from eagle.decode.cache import cache_length, crop_cache
from eagle.decode.tree import StaticTree, Tree, chain_tree, reindex_parents, select_dynamic, tree_mask
from eagle.heads.base import DraftHead


@dataclass
class DraftPool:
    """Candidates drafted for a dynamic tree, in breadth-first order (parents before children)."""

    tokens: torch.Tensor  # [M] target ids
    parents: torch.Tensor  # [M] pool index of the parent, -1 = the root
    scores: torch.Tensor  # [M] cumulative draft log-probability
    depths: torch.Tensor  # [M] 1 for the root's children


def _log_probs(head: DraftHead, hidden: torch.Tensor) -> torch.Tensor:
    """[F, H] head output -> [F, V_draft] log-probabilities."""
    return torch.log_softmax(head.logits(hidden[None])[0].float(), dim=-1)


def _draft_forward(
    head: DraftHead,
    cache,
    committed: int,
    tokens: torch.Tensor,  # [F] target ids of the frontier
    hidden_in: torch.Tensor,  # [F, H] parents' output hidden
    position: int,
    draft_mask: torch.Tensor,  # [F, S + F] bool over draft entries already cached + the frontier
) -> torch.Tensor:
    """One depth level: frontier nodes attend to the committed prefix and their draft ancestors."""
    f = tokens.numel()
    prefix = torch.ones(f, committed, dtype=torch.bool, device=tokens.device)
    mask = torch.cat([prefix, draft_mask], dim=1)[None, None]  # [1, 1, F, committed + S + F]
    pos = torch.full((1, f), position, dtype=torch.long, device=tokens.device)
    return head(tokens[None], hidden_in[None], pos, attention_mask=mask, past_key_values=cache)[0]  # [F, H]


@torch.inference_mode()
def draft_pool(
    head: DraftHead,
    cache,
    root_hidden: torch.Tensor,  # [H]
    root_position: int,
    top_k: int,
    depth: int,
    min_gain: float = 0.0,
) -> DraftPool:
    """EAGLE-2 expansion: each level expands the top_k frontier nodes (by cumulative log-prob) into
    top_k children each; every expanded child joins the candidate pool.

    `min_gain` > 0 stops early, once the next level's expected gain is below it (`decode.tree=auto` sets
    it from the measured cost of a level, the tokens per second the decoder achieves and the head's
    calibration). The children of the frontier can add at most the frontier's probability mass M (sum
    of exp(score)) to the expected accepted tokens; in expectation about rho * M, where rho is the share
    of their parents' mass the level just drafted drew into its top_k children (for the root's
    children: their summed probability). Stopping at the bound M drafted levels whose children rarely
    made the tree: same run, int8 bf16 head, MT-bench x10 2.20 -> 1.67 levels a step, 41.8 -> 43.5
    tok/s; HumanEval x8 2.45 -> 1.99 levels, 53.9 -> 54.4 tok/s, tau 3.09 / 3.10 (ad-hoc A/B, README)."""
    committed = cache_length(cache)
    device = root_hidden.device
    logp = _log_probs(head, root_hidden[None])[0]  # [V_draft]
    top = logp.topk(top_k)
    tokens = [head.draft_to_target(top.indices)]
    scores = [top.values]
    parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    depths = [torch.ones(top_k, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device)  # pool indices
    front_tokens, front_scores = tokens[0], scores[0]  # [F] of the frontier nodes
    rho = float(top.values.float().exp().sum()) if min_gain > 0 else 1.0  # the root's mass is 1
    frontier_hidden = root_hidden[None].expand(top_k, -1)  # [F, H] input hidden of each frontier node
    anc = torch.zeros(top_k, 0, dtype=torch.bool, device=device)  # [F, S] draft ancestors in the cache
    size = top_k
    for d in range(1, depth):
        f = frontier.numel()
        if min_gain > 0:
            mass = float(front_scores.float().exp().sum())  # M
            if rho * mass < min_gain:
                break
        eye = torch.eye(f, dtype=torch.bool, device=device)
        self_anc = torch.cat([anc, eye], dim=1)  # [F, S + F]
        out = _draft_forward(head, cache, committed, front_tokens, frontier_hidden, root_position + d, self_anc)
        top = _log_probs(head, out).topk(top_k, dim=-1)  # [F, k]
        cand = (front_scores[:, None] + top.values).flatten()  # [F * k]
        if min_gain > 0:
            rho = min(1.0, float(cand.float().exp().sum()) / max(mass, 1e-30))  # top_k children <= parent
        children = head.draft_to_target(top.indices).flatten()  # [F * k] target ids
        tokens.append(children)
        scores.append(cand)
        parents.append(frontier.repeat_interleave(top_k))
        depths.append(torch.full((f * top_k,), d + 1, dtype=torch.long, device=device))
        best = cand.topk(min(top_k, cand.numel())).indices  # [F'] next frontier among the new children
        parent_row = best // top_k
        frontier = size + best
        front_tokens, front_scores = children[best], cand[best]
        frontier_hidden = out[parent_row]
        anc = self_anc[parent_row]  # a child's draft ancestors = its parent's ancestors + the parent
        size += f * top_k
    crop_cache(cache, committed)
    return DraftPool(torch.cat(tokens), torch.cat(parents), torch.cat(scores), torch.cat(depths))


def tree_from_pool(pool: DraftPool, root_token: int, total_tokens: int) -> Tree:
    """Keep the best `total_tokens` candidates as the verification tree (see `select_dynamic`)."""
    kept = select_dynamic(pool.scores, pool.parents, total_tokens)  # [N]
    device = pool.tokens.device
    root = torch.tensor([root_token], dtype=torch.long, device=device)
    return Tree(
        tokens=torch.cat([root, pool.tokens[kept]]),
        parents=torch.cat([torch.tensor([-1], device=device), reindex_parents(kept, pool.parents)]),
        depths=torch.cat([torch.zeros(1, dtype=torch.long, device=device), pool.depths[kept]]),
    )


def uses_sampled_drafts(decode: DecodeConfig) -> bool:
    """`decode.draft_choice`: sampled chains at T > 0 under sample, and under auto unless the tree is
    static (a static tree is a fixed set of top-k ranks). Never under an approximate decode.acceptance:
    those rules act on top-k trees."""
    if decode.temperature <= 0 or decode.acceptance != "exact":
        return False
    return decode.draft_choice == "sample" or (decode.draft_choice == "auto" and decode.tree != "static")


@torch.inference_mode()
def draft_sampled_chain(
    head: DraftHead,
    cache,
    root_token: int,
    root_hidden: torch.Tensor,  # [H]
    root_position: int,
    depth: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tree:
    """A chain of `depth` tokens, each *sampled* from the head's law q at its parent (after the target's
    temperature / top-k / top-p), kept with q for speculative-sampling acceptance (`walk_tree_sampled`).

    For T > 0: a sampled draft is accepted with probability sum_x min(p, q)(x), a deterministic top-1
    draft with p(top-1 of q) only, which for a broad p is much less (README: decode.draft_choice).
    """
    committed = cache_length(cache)
    device = root_hidden.device
    vocab = head.config.vocab_size
    to_target = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=device))  # [V_draft]
    tokens, probs = [root_token], {}
    hidden = root_hidden[None]  # [1, H] output hidden of the newest node
    for d in range(depth):
        if d > 0:  # node d (depth d) attends to the committed prefix, nodes 1..d-1 and itself
            mask = torch.ones(1, d, dtype=torch.bool, device=device)
            node_token = torch.tensor([tokens[d]], device=device)
            hidden = _draft_forward(head, cache, committed, node_token, hidden, root_position + d, mask)
        logits = head.logits(hidden[None])[0].float()  # [1, V_draft]
        q_draft = process_logits(logits, temperature, top_k, top_p)[0]  # [V_draft]
        i = sample_index(q_draft, generator)
        q = torch.zeros(vocab, dtype=q_draft.dtype, device=device)
        q[to_target] = q_draft  # [V] the law over target ids (zero outside the draft vocabulary)
        tokens.append(int(to_target[i]))
        probs[d + 1] = q
    crop_cache(cache, committed)
    return chain_tree(tokens, device, probs)


@torch.inference_mode()
def draft_static(
    head: DraftHead,
    cache,
    root_token: int,
    root_hidden: torch.Tensor,  # [H]
    root_position: int,
    spec: StaticTree,
) -> Tree:
    """Fill a static tree: the child of rank r is the parent's r-th most likely draft token."""
    committed = cache_length(cache)
    device = root_hidden.device
    parents = torch.tensor(spec.parents, dtype=torch.long, device=device)
    ranks = torch.tensor(spec.ranks, dtype=torch.long, device=device)
    depths = torch.tensor(spec.depths, dtype=torch.long, device=device)
    n = parents.numel()
    full_mask = tree_mask(parents)  # [N + 1, N + 1]
    has_child = torch.zeros(n, dtype=torch.bool, device=device)
    has_child[parents[1:]] = True
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    tokens[0] = root_token
    out_hidden = torch.zeros(n, root_hidden.shape[-1], dtype=root_hidden.dtype, device=device)
    out_hidden[0] = root_hidden
    fed = torch.zeros(0, dtype=torch.long, device=device)  # nodes with entries in the head cache, in order
    max_rank = int(ranks.max()) + 1 if n > 1 else 1
    for d in range(spec.max_depth):
        level = ((depths == d) & has_child).nonzero().squeeze(1)  # [F] parents of depth-(d+1) nodes
        if d > 0:  # depth 0 is the root, already in the committed prefix
            order = torch.cat([fed, level])
            hidden_in = out_hidden[parents[level]]
            out = _draft_forward(
                head, cache, committed, tokens[level], hidden_in, root_position + d, full_mask[level][:, order]
            )
            out_hidden[level] = out
            fed = order
        top = _log_probs(head, out_hidden[level]).topk(max_rank, dim=-1).indices  # [F, R]
        children = (depths == d + 1).nonzero().squeeze(1)  # [C]
        row = (parents[children][:, None] == level[None, :]).float().argmax(1)  # [C] parent's row in `level`
        tokens[children] = head.draft_to_target(top[row, ranks[children]])
    crop_cache(cache, committed)
    return Tree(tokens=tokens, parents=parents, depths=depths)
