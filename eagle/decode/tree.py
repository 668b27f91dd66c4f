"""Draft trees as plain tensors: structure, attention masks, position ids and retrieval paths.

A tree of N + 1 nodes is stored in topological (breadth-first) order: node 0 is the root (the last
token already accepted, whose KV is not yet in the target cache), every parent index is smaller than
its child's index. All maths here is pure (no model calls) and each fast function has a loop-based
`*_reference` twin that the tests compare it with.

Static trees are given EAGLE-1 style as paths of child ranks: `[[0], [1], [0, 0]]` means the root's
best and second-best draft child, and the best child of the best child. Dynamic trees (EAGLE-2) are
selected from a pool of drafted candidates by cumulative draft log-probability (`select_dynamic`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle.errors import EagleError


class TreeError(EagleError):
    """A static tree specification (decode.static_paths) is malformed."""


@dataclass
class Tree:
    """A verification tree; index 0 is the root."""

    tokens: torch.Tensor  # [N + 1] target token ids (root included)
    parents: torch.Tensor  # [N + 1] parent index, -1 for the root
    depths: torch.Tensor  # [N + 1] 0 for the root
    # Nodes whose token was sampled from the head (decode.draft_choice=sample): node -> [V] the law it
    # was drawn from, which acceptance needs (`walk_tree_sampled`). Other nodes are deterministic drafts.
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of drafted nodes (root excluded)."""
        return int(self.tokens.numel()) - 1

    def mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool ancestor-or-self mask (True = may attend)."""
        return tree_mask(self.parents)

    def retrieval_paths(self) -> torch.Tensor:
        """[P, D + 1] node indices root -> leaf, padded with -1."""
        return retrieval_paths(self.parents)


# --- ancestry and masks ----------------------------------------------------------------------------


def ancestor_table(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N, D + 1] ancestors: column k = k-th ancestor (column 0 = self), -1 past the root.

    Pointer chasing over depth (D + 1 gathers) instead of a Python loop over nodes.
    """
    n = parents.numel()
    cols = [torch.arange(n, device=parents.device)]
    while True:
        prev = cols[-1]
        nxt = torch.where(prev >= 0, parents[prev.clamp(min=0)], prev)  # [N]; -1 stays -1
        if bool((nxt < 0).all()):
            break
        cols.append(nxt)
    return torch.stack(cols, dim=1)  # [N, D + 1]


def child_by_token(tokens: list[int], parents: list[int]) -> dict[tuple[int, int], int]:
    """(parent node, token) -> child node. Siblings carry distinct tokens, so the key is unique."""
    return {(p, t): c for c, (p, t) in enumerate(zip(parents, tokens, strict=True)) if p >= 0}


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N] parent indices (-1 root, parents before children) -> [N, N] bool ancestor-or-self mask."""
    n = parents.numel()
    anc = ancestor_table(parents)  # [N, D + 1]
    mask = torch.zeros(n, n + 1, dtype=torch.bool, device=parents.device)  # extra column absorbs -1
    mask.scatter_(1, torch.where(anc >= 0, anc, n), True)
    return mask[:, :n]


def tree_mask_reference(parents: list[int] | torch.Tensor) -> torch.Tensor:
    """Loop version of `tree_mask`: walk up from every node."""
    parents = [int(p) for p in parents]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N] depths (root 0)."""
    return (ancestor_table(parents) >= 0).sum(dim=1) - 1


def retrieval_paths(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [P, D + 1] root-to-leaf node indices (one row per leaf), padded with -1."""
    n = parents.numel()
    has_child = torch.zeros(n, dtype=torch.bool, device=parents.device)
    has_child[parents[parents >= 0]] = True
    leaves = (~has_child).nonzero().squeeze(1)  # [P]
    anc = ancestor_table(parents)[leaves]  # [P, D + 1], leaf first
    depth = (anc >= 0).sum(dim=1)  # [P] path lengths incl. root
    width = anc.shape[1]
    # Reverse each row's valid prefix so the root comes first: position k takes ancestor depth-1-k.
    k = torch.arange(width, device=parents.device).unsqueeze(0)  # [1, D + 1]
    src = (depth.unsqueeze(1) - 1 - k).clamp(min=0)  # [P, D + 1]
    paths = anc.gather(1, src)
    return torch.where(k < depth.unsqueeze(1), paths, torch.full_like(paths, -1))


def retrieval_paths_reference(parents: list[int] | torch.Tensor) -> torch.Tensor:
    """Loop version of `retrieval_paths`."""
    parents = [int(p) for p in parents]
    n = len(parents)
    children = {p for p in parents if p >= 0}
    rows = []
    for leaf in range(n):
        if leaf in children:
            continue
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = parents[j]
        rows.append(path[::-1])
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


# --- static trees ----------------------------------------------------------------------------------


@dataclass
class StaticTree:
    """A compiled static tree: nodes in breadth-first order with their parent index and child rank."""

    parents: list[int]  # [N + 1], -1 for the root
    ranks: list[int]  # [N + 1] rank among the parent's draft top-k (root: -1)
    depths: list[int]

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def compile_static_tree(paths: list[list[int]]) -> StaticTree:
    """Paths of child ranks -> breadth-first node list. Every proper prefix of a path must be a path."""
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        t = tuple(int(r) for r in p)
        if not t or any(r < 0 for r in t):
            raise TreeError(f"decode.static_paths entry {list(p)} must be a non-empty list of ranks >= 0")
        if t in seen:
            raise TreeError(f"decode.static_paths lists {list(p)} twice")
        seen.add(t)
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise TreeError(f"decode.static_paths has {list(t)} but not its parent {list(t[:-1])}; add it")
    order = sorted(seen, key=lambda t: (len(t), t))
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, ranks, depths = [-1], [-1], [0]
    for t in order:
        index[t] = len(parents)
        parents.append(index[t[:-1]])
        ranks.append(t[-1])
        depths.append(len(t))
    return StaticTree(parents=parents, ranks=ranks, depths=depths)


# --- dynamic selection (EAGLE-2) ---------------------------------------------------------------------


def select_dynamic(scores: torch.Tensor, parents: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Keep the `total_tokens` best candidates by cumulative log-prob; return kept pool indices, sorted.

    scores: [M] cumulative draft log-probabilities of the candidate pool, parents: [M] pool index of
    each candidate's parent (-1 = the root); parents come before children in the pool. A child's
    score is never above its parent's (log-probs are <= 0), and the stable sort keeps the earlier
    (parent) entry first on ties, so the kept set is closed under ancestry. Ties at the cut are broken
    toward earlier (shallower) candidates.
    """
    k = min(total_tokens, scores.numel())
    order = torch.sort(-scores, stable=True).indices[:k]
    kept = torch.sort(order).values  # pool order = breadth-first, parents first
    return kept


def select_dynamic_reference(scores: list[float], parents: list[int], total_tokens: int) -> list[int]:
    """Loop version of `select_dynamic` (greedy best-first over the candidate pool)."""
    items = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:total_tokens]
    return sorted(items)


def reindex_parents(kept: torch.Tensor, pool_parents: torch.Tensor) -> torch.Tensor:
    """Map pool parent indices of kept candidates to tree node indices (root = 0, kept[i] -> i + 1)."""
    m = pool_parents.numel()
    pos = torch.full((m + 1,), -1, dtype=torch.long, device=kept.device)  # last slot: the root's "-1"
    pos[kept] = torch.arange(1, kept.numel() + 1, device=kept.device)
    pos[m] = 0
    par = pool_parents[kept]
    mapped = pos[torch.where(par >= 0, par, m)]  # [N]
    if bool((mapped < 0).any()):
        raise AssertionError("dynamic tree selection dropped an ancestor of a kept node")
    return mapped


def chain_tree(tokens: list[int], device: torch.device, draft_probs: dict[int, torch.Tensor] | None = None) -> Tree:
    """A chain tokens[0] (the root) -> tokens[1] -> ... as a `Tree`; `draft_probs` keyed by depth."""
    n = len(tokens)
    return Tree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.arange(-1, n - 1, device=device),
        depths=torch.arange(n, device=device),
        draft_probs=draft_probs or {},
    )
