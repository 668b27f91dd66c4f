"""Acceptance of a verified draft tree: pure functions on the target's logits.

The rule (greedy and sampling alike). At every tree node the target picks its next token y from its
own processed distribution p (argmax at temperature 0; otherwise a sample after temperature, top-k and
top-p). Starting at the root, walk to the child whose token equals y; stop at the first node without
such a child and emit y there as the bonus token.

Why this preserves the target distribution: drafts in our trees are chosen deterministically (draft
top-k, not sampled), which is multi-draft rejection sampling with one-hot draft distributions
q = 1[x_i]: accepting sibling x_1 with probability min(1, p(x_1) / 1) = p(x_1), then continuing with
the residual norm(max(p - q, 0)) (= p without x_1), and so on, emits x_i with probability exactly
p(x_i) and otherwise a token from p restricted to non-drafted tokens. That is the same law as one draw
y ~ p followed by the walk above, which is what we implement: `walk_tree` draws at a node only when
the walk reaches it, so every reached node gets one fresh independent draw (`accept_tree` over draws
at all nodes from `target_choices` is its vectorised reference: same law, N + 1 draws). The
emitted sequence is therefore distributed exactly as target sampling, token by token, for any head;
the head only decides how often a draw lands on a drafted child. At temperature 0 this is exactly
the target's greedy decoding. The draft's own probabilities q are not needed (which is why
rejection with the head's q, as in EAGLE's code, is not used with top-k trees: it is biased there).
`multi_draft_reference` implements the sequential one-hot rejection literally; tests check that it
and `accept_tree` have the same law.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.decode.tree import child_by_token


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after temperature, top-k and top-p (nucleus).

    temperature 0 gives the one-hot argmax distribution. Top-p keeps the smallest set of most likely
    tokens whose mass reaches top_p (the token crossing the threshold included), like HF's warper.
    """
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # never drops the first token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample_index(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a [V] probability vector by inverting its float64 CDF with a single uniform.

    Same law as `torch.multinomial(probs, 1)` (zero-probability tokens are never drawn: their CDF step
    is empty) at a tenth of its CPU cost over a 49k vocabulary, where multinomial spends ~0.9 ms a row.
    """
    cdf = probs.double().cumsum(0)  # [V]
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=cdf.numel() - 1))


def sample_token(
    logits: torch.Tensor,  # [V] target logits at one position
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """The target's next token at one position: argmax at temperature 0, else one sample of p."""
    if temperature <= 0:
        return int(logits.float().argmax())  # exact cast; float argmax is faster than bf16's on CPU
    return sample_index(process_logits(logits[None], temperature, top_k, top_p)[0], generator)


def target_choices(
    logits: torch.Tensor,  # [N + 1, V] target logits at every tree node
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[N + 1] the target's next token at every node: argmax, or one independent sample per node."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = process_logits(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@dataclass
class Acceptance:
    nodes: torch.Tensor  # [A + 1] accepted tree nodes, root first
    tokens: list[int]  # accepted draft tokens followed by the bonus token (A + 1 tokens)


def accept_tree(
    tree_tokens: torch.Tensor,  # [N + 1] node tokens (root included)
    paths: torch.Tensor,  # [P, D + 1] retrieval paths, -1 padded
    choices: torch.Tensor,  # [N + 1] target's token at each node
) -> Acceptance:
    """Longest root path whose every node's token equals the target's choice at its parent.

    Siblings carry distinct tokens, so at most one path can match at each depth: the result is unique.
    """
    valid = paths >= 0  # [P, D + 1]
    safe = paths.clamp(min=0)
    # Node at column c (c >= 1) matches iff its token equals the choice at column c - 1.
    match = (tree_tokens[safe[:, 1:]] == choices[safe[:, :-1]]) & valid[:, 1:]  # [P, D]
    run = match.long().cumprod(dim=1).sum(dim=1)  # [P] accepted drafts along each path
    best = int(run.argmax())
    n = int(run[best])
    nodes = safe[best, : n + 1]  # [A + 1]
    tokens = tree_tokens[nodes[1:]].tolist() + [int(choices[nodes[-1]])]
    return Acceptance(nodes=nodes, tokens=tokens)


def walk_tree(
    tree_tokens: torch.Tensor,  # [N + 1] node tokens (root included)
    parents: torch.Tensor,  # [N + 1] parent index, -1 for the root
    logits: torch.Tensor,  # [N + 1, V] target logits at every tree node
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """`accept_tree` with the target's choice drawn only at the nodes the walk reaches.

    Same law as `accept_tree(..., target_choices(logits, ...))`: a node's draw matters only if the
    walk reaches it, and every reached node gets one fresh independent draw. It processes A + 1 rows
    of logits instead of N + 1 (tests compare both).
    """
    tokens, parent_of = tree_tokens.tolist(), parents.tolist()
    children = child_by_token(tokens, parent_of)
    node, nodes = 0, [0]
    while True:
        y = sample_token(logits[node], temperature, top_k, top_p, generator)
        child = children.get((node, y))  # siblings carry distinct tokens: at most one match
        if child is None:
            break
        node = child
        nodes.append(node)
    return Acceptance(nodes=torch.tensor(nodes, device=tree_tokens.device), tokens=[tokens[n] for n in nodes[1:]] + [y])


def walk_tree_sampled(
    tree_tokens: torch.Tensor,  # [N + 1] node tokens (root included)
    parents: torch.Tensor,  # [N + 1] parent index, -1 for the root
    logits: torch.Tensor,  # [N + 1, V] target logits at every tree node
    draft_probs: dict[int, torch.Tensor],  # node -> [V] the law its token was *sampled* from
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Multi-draft speculative sampling over a tree whose nodes are sampled drafts (with their law q)
    or deterministic ones (one-hot q), for temperature > 0.

    At each reached node, with p the target's processed law there, the children are tried in order
    (sampled ones first, then by index): child c with token x is accepted with probability
    min(1, p(x) / q_c(x)); on rejection p becomes norm(max(p - q_c, 0)) (one-hot q_c: p without x).
    If every child is rejected the bonus token is drawn from the last p. Each round emits x with
    probability min(p, q_c)(x) and otherwise continues with the residual, whose mass is exactly the
    rest of p, so the emitted token follows p whatever the drafts were (Leviathan et al.'s argument,
    applied round by round); the drafts only decide how often a round accepts. With one-hot drafts
    only this is `walk_tree`'s law (`multi_draft_reference`); `speculative_sampling_reference` is
    the literal rule at one node, which tests compare with.
    """
    tokens, parent_of = tree_tokens.tolist(), parents.tolist()
    kids: dict[int, list[int]] = {}
    for c, par in enumerate(parent_of):
        if par >= 0:
            kids.setdefault(par, []).append(c)
    node, nodes = 0, [0]
    while True:
        p = process_logits(logits[node][None], temperature, top_k, top_p)[0].double()  # [V]
        order = sorted(kids.get(node, []), key=lambda c: (c not in draft_probs, c))
        chosen = None
        for c in order:
            x = tokens[c]
            q = draft_probs.get(c)
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
            if q is None:  # one-hot draft: accept with p(x), else remove x
                if u < float(p[x]):
                    chosen = c
                    break
                p[x] = 0.0
            else:
                q = q.to(p)
                if u * float(q[x]) < float(p[x]):  # u < min(1, p(x) / q(x)); q(x) > 0: x was drawn from q
                    chosen = c
                    break
                p = (p - q).clamp(min=0.0)
            total = float(p.sum())
            if total <= 0.0:  # p == q up to rounding: rejection had probability ~0
                p = process_logits(logits[node][None], temperature, top_k, top_p)[0].double()
                total = float(p.sum())
            p = p / total
        if chosen is None:
            y = sample_index(p, generator)
            break
        node = chosen
        nodes.append(node)
    return Acceptance(nodes=torch.tensor(nodes, device=tree_tokens.device), tokens=[tokens[n] for n in nodes[1:]] + [y])


def speculative_sampling_reference(
    p: torch.Tensor, drafts: list[tuple[int, torch.Tensor | None]], generator: torch.Generator | None = None
) -> tuple[int | None, int]:
    """The literal multi-round rule at one node: drafts are (token, q) in the order tried, q None for a
    one-hot draft. Returns (index of the accepted draft or None, emitted token)."""
    residual = p.double().clone()
    for i, (x, q) in enumerate(drafts):
        residual = residual / residual.sum()
        qx = torch.zeros_like(residual)
        if q is None:
            qx[x] = 1.0
        else:
            qx = q.double()
        accept = min(1.0, float(residual[x]) / float(qx[x]))
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < accept:
            return i, x
        residual = (residual - qx).clamp(min=0.0)
        if float(residual.sum()) <= 0:
            residual = p.double().clone()
    token = int(torch.multinomial(residual.float(), 1, generator=generator))
    return None, token


def accept_tree_reference(
    tree_tokens: list[int], parents: list[int], choices: list[int]
) -> tuple[list[int], list[int]]:
    """Loop version of `accept_tree`: (accepted nodes root first, emitted tokens)."""
    node, nodes = 0, [0]
    while True:
        nxt = [c for c in range(len(parents)) if parents[c] == node and tree_tokens[c] == choices[node]]
        if not nxt:
            break
        node = nxt[0]
        nodes.append(node)
    return nodes, [tree_tokens[n] for n in nodes[1:]] + [choices[node]]


def multi_draft_reference(
    p: torch.Tensor, drafts: list[int], generator: torch.Generator | None = None
) -> tuple[int | None, int]:
    """Sequential multi-draft rejection with one-hot draft distributions at one node (the literal rule).

    p: [V] processed target distribution; drafts: sibling tokens in rank order. Returns
    (index of the accepted sibling or None, emitted token).
    """
    residual = p.double().clone()
    for i, x in enumerate(drafts):
        total = float(residual.sum())
        if total <= 0:
            break
        accept_prob = float(residual[x]) / total  # min(1, p'(x) / q(x)) with q = one-hot(x)
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < accept_prob:
            return i, x
        residual[x] = 0.0  # norm(max(p' - q, 0)): the rejected draft loses all its mass
    token = int(torch.multinomial(residual.float(), 1, generator=generator))
    return None, token
