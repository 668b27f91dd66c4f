"""Prompt-lookup chains grafted onto the head's tree: the n-gram index against a plain scan, the graft
keeps a valid tree (distinct siblings, parents first), acceptance statistics, and decoding with it
stays exactly the target's greedy decoding while lookup nodes really get accepted."""

from __future__ import annotations

import random

import pytest
import torch

from eagle.config import ConfigError
from eagle.decode import SpeculativeGenerator
from eagle.decode.autotree import verify_time
from eagle.decode.lookup import LookupStats, NgramLookup, graft_chain, propose_reference
from eagle.decode.tree import Tree, depths_of, tree_mask, tree_mask_reference
from tests.support.decode import decode_cfg, hf_greedy, prompt_ids, random_head
from tests.tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(3, 2), (2, 1), (4, 4)])
def test_ngram_index_equals_a_backward_scan_as_the_sequence_grows(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    seq = [rng.randrange(3) for _ in range(5)]  # a small vocabulary: many recurring n-grams
    index = NgramLookup(seq, max_ngram, min_ngram)
    hits = 0
    for _ in range(150):
        for n in (1, 4, 9):
            got = index.propose(n)
            assert got == propose_reference(seq, n, max_ngram, min_ngram)
            hits += bool(got)
        new = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        seq += new
        index.extend(new)
    assert index.tokens == seq and hits > 100


def test_ngram_index_prefers_the_longest_and_latest_match():
    #             0  1  2  3  4  5  6  7  8  9 10 11
    seq = [5, 1, 2, 9, 7, 1, 2, 8, 3, 2, 1, 2]
    index = NgramLookup(seq, max_ngram=3, min_ngram=1)
    assert index.propose(3) == [8, 3, 2]  # suffix (1, 2): latest earlier occurrence at 5..6, then 8
    index.extend([8])  # suffix (1, 2, 8) occurred at 5..7
    assert index.propose(2) == [3, 2]
    assert NgramLookup([1, 2, 3], 2, 2).propose(4) == []  # no suffix bigram recurs
    with pytest.raises(ValueError):
        NgramLookup([], 2, 3)


def _tree(tokens, parents):
    p = torch.tensor(parents)
    return Tree(tokens=torch.tensor(tokens), parents=p, depths=depths_of(p))


def _check_tree(tree: Tree) -> None:
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert parents[0] == -1 and all(0 <= p < c for c, p in enumerate(parents) if c)
    siblings = [(p, t) for p, t in zip(parents[1:], tokens[1:], strict=True)]
    assert len(siblings) == len(set(siblings))  # distinct tokens among siblings: acceptance is unique
    assert torch.equal(tree.depths, depths_of(tree.parents))
    assert torch.equal(tree_mask(tree.parents), tree_mask_reference(tree.parents))


def test_graft_follows_existing_nodes_then_appends_a_path():
    # root 0 (token 10) -> 1 (11), 2 (12); 1 -> 3 (13)
    tree = _tree([10, 11, 12, 13], [-1, 0, 0, 1])
    grafted, positions = graft_chain(tree, [11, 13, 14, 15])  # follows 1 -> 3, then adds 14 -> 15
    _check_tree(grafted)
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert grafted.parents.tolist()[4:] == [3, 4]
    assert positions.tolist() == [2, 3]
    fresh, positions = graft_chain(tree, [20, 11])  # disagrees at once: a new root child (token 11 again, deeper)
    _check_tree(fresh)
    assert fresh.parents.tolist()[4:] == [0, 4] and positions.tolist() == [0, 1]
    same, positions = graft_chain(tree, [11, 13])
    assert same is tree and positions.numel() == 0


def test_graft_on_random_trees_keeps_a_valid_tree():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randrange(1, 12)
        parents, tokens = [-1], [rng.randrange(5)]
        for c in range(1, n):
            p = rng.randrange(c)
            used = {tokens[i] for i in range(c) if parents[i] == p}
            free = [t for t in range(5) if t not in used]
            if not free:
                continue
            parents.append(p)
            tokens.append(rng.choice(free))
        tree = _tree(tokens, parents)
        chain = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        grafted, positions = graft_chain(tree, chain)
        _check_tree(grafted)
        # The chain is now a root path: walking it by tokens reaches depth len(chain).
        node = 0
        for tok in chain:
            node = next(
                c
                for c in range(1, grafted.size + 1)
                if int(grafted.parents[c]) == node and int(grafted.tokens[c]) == tok
            )
        assert int(grafted.depths[node]) == len(chain)
        assert grafted.size == tree.size + positions.numel()


def test_lookup_stats_expectation_and_updates():
    stats = LookupStats(max_tokens=4, decay=0.5)
    assert stats.expected(torch.tensor([0, 1, 2])) == pytest.approx([0.5, 0.75, 0.875])
    assert stats.expected(torch.tensor([2, 3])) == pytest.approx([0.125, 0.1875])  # needs chain 0..1 first
    stats.observe([4, 5, 6, 7], emitted=[4, 5, 9])
    # positions 0, 1 right, 2 wrong (the target emitted 9), 3 not judged: unchanged
    assert stats.rate == pytest.approx([0.75, 0.75, 0.25, 0.5])
    # Nothing grafted (tree=auto kept none): the emitted tokens still judge the chain.
    stats.observe([4, 5], emitted=[3])
    assert stats.rate == pytest.approx([0.375, 0.75, 0.25, 0.5])


def test_verify_time_interpolates_and_extrapolates():
    times = {1: 1.0, 4: 2.5, 8: 4.5}
    assert verify_time(times, 0) == 1.0
    assert verify_time(times, 2) == pytest.approx(1.5)
    assert verify_time(times, 8) == pytest.approx(4.5)
    assert verify_time(times, 12) == pytest.approx(6.5)


def test_config_refuses_a_minimum_ngram_above_the_maximum():
    from eagle.cli.app import compose

    with pytest.raises(ConfigError, match="lookup_min_ngram"):
        compose(["decode.lookup_min_ngram=4", "decode.lookup_max_ngram=2"])
    with pytest.raises(ConfigError, match="lookup_tokens"):
        compose(["decode.lookup_tokens=-1"])


@pytest.mark.parametrize("tree", ["dynamic", "static", "auto"])
def test_greedy_with_lookup_equals_target_greedy_and_lookup_pays(tree):
    # A tiny random target falls into loops, which the lookup predicts; a random head almost never does.
    model, tok = make_model("llama")
    head = random_head(model, "eagle3", draft_vocab_size=200)
    for text in ("Write a short poem about the sea.", "def add(a, b):"):
        ids = prompt_ids(tok, text)
        ref = hf_greedy(model, ids, 40)
        cfg = decode_cfg(
            max_new_tokens=40,
            tree=tree,
            static_paths=[[0], [1], [0, 0]],
            lookup_tokens=6,
            lookup_min_ngram=1,
            auto_candidates=[2, 4, 8],
        )
        gen = SpeculativeGenerator(model, head, tok, cfg)
        res = gen.generate(ids)
        assert res.tokens == ref, tree
        assert len(res.lookup_nodes) == len(res.accept_lengths) == res.target_forwards
        assert sum(res.lookup_accepted) > 0  # grafted nodes were accepted
        assert all(a <= g for a, g in zip(res.lookup_accepted, res.lookup_nodes, strict=True))
        plain = SpeculativeGenerator(
            model,
            head,
            tok,
            decode_cfg(max_new_tokens=40, tree=tree, static_paths=[[0], [1], [0, 0]], auto_candidates=[2, 4, 8]),
        ).generate(ids)
        assert plain.tokens == ref and not plain.lookup_nodes
        assert res.target_forwards < plain.target_forwards  # fewer verify passes for the same tokens
