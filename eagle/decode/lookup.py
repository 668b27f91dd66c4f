"""Prompt-lookup drafts grafted onto the head's tree (`decode.lookup_tokens`).

Chat answers and code copy long stretches of their context (names, signatures, quoted passages,
earlier lines of the answer itself). An n-gram match of the newest tokens against the context
predicts such a stretch for free, and often further than the head drafts. `NgramLookup` keeps, for
every n-gram of the context, the position after its latest occurrence; each step it looks up the
longest suffix n-gram (from `max_ngram` down to `min_ngram` tokens) and proposes the tokens that
followed it. `graft_chain` adds that proposal to the head's tree as one root path: it follows the
tree's existing nodes while their tokens agree and appends the rest as new nodes, so siblings keep
distinct tokens and the tree stays topologically ordered. Acceptance needs nothing else: the walk
(`eagle.decode.accept.walk_tree`) treats grafted nodes like drafted ones, which keeps the output
lossless in every mode (drafts are deterministic), and the head commits grafted tokens with the
verify pass's features like any accepted token.

`LookupStats` measures how often grafted nodes are accepted, by their position in the chain, so
`decode.tree=auto` can keep only the part of a proposal that pays for its share of the verify pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle.decode.tree import Tree, child_by_token


class NgramLookup:
    """Latest-occurrence index of a growing token sequence for prompt-lookup proposals.

    `extend` appends tokens (O(max_ngram) dict updates per token); `propose` returns up to `n`
    tokens that followed the latest earlier occurrence of the longest matching suffix n-gram.
    """

    def __init__(self, tokens: list[int], max_ngram: int, min_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # (n-gram tuple) -> index just after its latest occurrence that has a following token.
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for tok in tokens:
            # The n-grams ending at the current last token gain a successor now (`tok`): index them.
            end = len(seq)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._next[tuple(seq[end - n : end])] = end
            seq.append(tok)

    def propose(self, n: int) -> list[int]:
        """Up to `n` tokens predicted to follow the sequence (empty if no suffix n-gram recurs)."""
        seq = self.tokens
        for size in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            start = self._next.get(tuple(seq[len(seq) - size :]))
            if start is not None:
                return seq[start : start + n]
        return []


def propose_reference(tokens: list[int], n: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Loop version of `NgramLookup(tokens, ...).propose(n)`: scan backwards for the suffix n-gram."""
    for size in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - size :]
        for start in range(len(tokens) - size - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + n]
    return []


def graft_chain(tree: Tree, chain: list[int]) -> tuple[Tree, torch.Tensor]:
    """Add `chain` below the root as one path; return the tree and [G] the new nodes' chain positions.

    Existing nodes are followed while their tokens agree with the chain (they cost nothing more); the
    first disagreement starts the new nodes, appended after all existing ones (parents stay before
    children). Chain position i (0-based) sits at depth i + 1.
    """
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = child_by_token(tokens, parents)
    node, i = 0, 0
    while i < len(chain) and (node, chain[i]) in children:
        node = children[(node, chain[i])]
        i += 1
    if i == len(chain):
        return tree, torch.zeros(0, dtype=torch.long)
    device = tree.tokens.device
    new = chain[i:]
    n0 = len(tokens)
    new_parents = [node] + list(range(n0, n0 + len(new) - 1))
    depth0 = int(tree.depths[node]) + 1
    grafted = Tree(
        tokens=torch.cat([tree.tokens, torch.tensor(new, dtype=torch.long, device=device)]),
        parents=torch.cat([tree.parents, torch.tensor(new_parents, dtype=torch.long, device=device)]),
        depths=torch.cat([tree.depths, torch.arange(depth0, depth0 + len(new), device=device)]),
        draft_probs=tree.draft_probs,  # existing nodes keep their indices
    )
    return grafted, torch.arange(i, len(chain))


@dataclass
class LookupStats:
    """Running acceptance of proposed chains by chain position (exponential moving averages).

    rate[i]: how often chain token i was the target's token when chain tokens 0..i-1 were. The prior
    (0.5) stands until proposals have been judged. The head's sampled draft chains
    (`decode.draft_choice=sample`) are measured with it too: a sampled node is emitted exactly when it
    is accepted (a rejected x has p(x) < q(x), so the residual holds none of it).
    """

    max_tokens: int
    decay: float = 0.9
    rate: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rate:
            self.rate = [0.5] * self.max_tokens

    def expected(self, positions: torch.Tensor) -> list[float]:
        """[G] consecutive chain positions of grafted nodes -> expected accepted grafted nodes for
        each prefix length 1..G (a grafted node needs the whole chain before it accepted)."""
        pos = positions.tolist()
        if not pos:
            return []
        p = 1.0
        for j in range(pos[0]):
            p *= self.rate[j]
        out, total = [], 0.0
        for j in pos:
            p *= self.rate[j]
            total += p
            out.append(total)
        return out

    def observe(self, chain: list[int], emitted: list[int]) -> None:
        """A step proposed `chain` and emitted `emitted` (accepted drafts + the bonus token).

        The emitted tokens are the target's own choices, so chain token i is judged right or wrong
        whenever the step emitted past i - 1 along the chain, whether or not it was grafted: rates
        keep learning even while tree=auto grafts nothing.
        """
        for i in range(min(len(chain), len(emitted))):
            hit = chain[i] == emitted[i]
            self.rate[i] = self.decay * self.rate[i] + (1 - self.decay) * float(hit)
            if not hit:
                break
