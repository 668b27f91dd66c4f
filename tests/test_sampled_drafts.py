"""decode.draft_choice=sample: chains drawn from the head's law, accepted by speculative sampling."""

from __future__ import annotations

import pytest
import torch

from eagle.cli.app import compose
from eagle.config import ConfigError
from eagle.decode.accept import process_logits, speculative_sampling_reference, walk_tree_sampled
from eagle.decode.autotree import choose_chain_length, expected_chain_tokens
from eagle.decode.cache import cache_length
from eagle.decode.draft import draft_sampled_chain
from eagle.decode.lookup import LookupStats
from eagle.decode.target import new_cache
from tests.support.decode import random_head
from tests.test_accept import _sampled_law_check, chi2_ok
from tests.tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
Q1 = torch.tensor([0.10, 0.30, 0.25, 0.05, 0.05, 0.05, 0.10, 0.10])
Q2 = torch.tensor([0.0, 0.0, 0.50, 0.0, 0.0, 0.50, 0.0, 0.0])


def test_literal_rule_with_sampled_and_one_hot_drafts_emits_the_target_law():
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    accepted_first = 0
    n = 6000
    for _ in range(n):
        x1 = int(torch.multinomial(Q1, 1, generator=gen))
        x2 = int(torch.multinomial(Q2, 1, generator=gen))
        idx, tok = speculative_sampling_reference(P, [(x1, Q1), (6, None), (x2, Q2)], generator=gen)
        counts[tok] += 1
        accepted_first += idx == 0
    ok, stat, crit = chi2_ok(counts, P)
    assert ok, (stat, crit)
    # The first round accepts sum min(p, q1) of the time (0.6 here), not p(x1) on average.
    expected = float(torch.minimum(P, Q1).sum())
    assert abs(accepted_first / n - expected) < 4 * (expected * (1 - expected) / n) ** 0.5


def test_tree_walk_has_the_law_of_the_literal_rule():
    """Root with a sampled child (q1, which has a sampled child of its own) and a one-hot sibling: the
    walk's (first accepted child, first token) law is the literal rule's, and the emitted token is p's."""
    logits = P.clamp(min=1e-30).log().expand(4, 8)
    gen = torch.Generator().manual_seed(2)
    walk, lit = torch.zeros(3, 8), torch.zeros(3, 8)
    for _ in range(3000):
        x1 = int(torch.multinomial(Q1, 1, generator=gen))
        xd = int(torch.multinomial(Q2, 1, generator=gen))
        one_hot = 4
        tokens = torch.tensor([7, x1, one_hot, xd])  # node 3 is node 1's sampled child
        parents = torch.tensor([-1, 0, 0, 1])
        acc = walk_tree_sampled(tokens, parents, logits, {1: Q1, 3: Q2}, 1.0, generator=gen)
        first = int(acc.nodes[1]) if acc.nodes.numel() > 1 else 0
        walk[first, acc.tokens[0]] += 1
        idx, tok = speculative_sampling_reference(P, [(x1, Q1), (one_hot, None)], generator=gen)
        lit[0 if idx is None else idx + 1, tok] += 1
    for counts in (walk, lit):
        ok, stat, crit = chi2_ok(counts.sum(0), P)  # the first token follows p
        assert ok, (stat, crit)
    # Same joint law of (which child, token): compare the two empirical tables cell by cell.
    both = walk + lit
    expected = both / 2
    keep = expected >= 5
    stat = float(
        (((walk - expected) ** 2 / expected.clamp(min=1e-9))[keep]).sum()
        + (((lit - expected) ** 2 / expected.clamp(min=1e-9))[keep]).sum()
    )
    df = int(keep.sum()) - 1
    assert stat < df + 3.09 * (2 * df) ** 0.5 + 10, (stat, df)


@pytest.mark.parametrize("choice", ["sample", "topk"])
def test_sampled_decoding_follows_target_distribution_for_each_draft_choice(choice):
    """End to end through the generator (tiny vocabulary target, exact law of tokens 2-3)."""
    _sampled_law_check(400, draft_choice=choice)


def test_sampled_chain_with_prompt_lookup_follows_target_distribution():
    _sampled_law_check(400, prompt=(5, 7, 4), lookup_tokens=2, lookup_min_ngram=1, tree_depth=1, draft_choice="sample")


def test_chain_laws_are_the_heads_own_at_each_node():
    """Each chain node's q is the head's processed law given the chain so far: recomputed here by
    committing the chain tokens one at a time on a fresh cache (no tree masks involved)."""
    model = make_model("llama")[0]
    head = random_head(model, "eagle3", draft_vocab_size=64)
    h = head.config.target_hidden_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, head.config.vocab_size, (6,), generator=g)
    feats = torch.randn(6, 3, h, generator=g)
    temp, top_k, top_p = 0.8, 20, 0.9
    cache = new_cache()
    with torch.inference_mode():
        root_hidden = head.commit(cache, prompt, feats, torch.arange(0, 6))
        tree = draft_sampled_chain(
            head,
            cache,
            int(prompt[-1]),
            root_hidden,
            6,
            3,
            temp,
            top_k,
            top_p,
            generator=torch.Generator().manual_seed(1),
        )
        assert cache_length(cache) == 6  # drafted entries cropped
        assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.depths.tolist() == [0, 1, 2, 3]
        to_target = head.draft_to_target(torch.arange(64))
        hidden = root_hidden
        for d in range(1, 4):
            q_draft = process_logits(head.logits(hidden[None, None])[0].float(), temp, top_k, top_p)[0]
            expected = torch.zeros(head.config.vocab_size)
            expected[to_target] = q_draft
            torch.testing.assert_close(tree.draft_probs[d], expected, rtol=1e-4, atol=1e-6)
            assert float(tree.draft_probs[d][int(tree.tokens[d])]) > 0  # drawn from q
            # The chain's next node reads its parent's output, as the head's own recurrence does.
            out = head(tree.tokens[d][None, None], hidden[None, None], torch.tensor([[6 + d]]), past_key_values=cache)
            hidden = out[0, -1]


def test_chain_stats_and_length_choice():
    stats = LookupStats(3)
    assert expected_chain_tokens(stats, 3) == [0.0, 0.5, 0.75, 0.875]
    for _ in range(50):
        stats.observe([5, 6, 7], [9])  # the first node always rejected (the bonus token is another)
    assert stats.rate[0] < 0.01 and stats.rate[1:] == [0.5, 0.5]  # deeper nodes never judged
    times = {1: 0.10, 2: 0.10, 4: 0.11}
    assert choose_chain_length(stats, times, level_s=0.01, fixed_s=0.0, max_depth=3) == 0
    good = LookupStats(3, rate=[0.9, 0.9, 0.9])
    assert choose_chain_length(good, times, level_s=0.005, fixed_s=0.0, max_depth=3) == 3
    assert choose_chain_length(good, times, level_s=0.2, fixed_s=0.0, max_depth=3) == 0  # levels too dear
    assert choose_chain_length(good, {}, level_s=0.0, fixed_s=0.0, max_depth=3) == 3  # untimed: full depth


def test_config_refuses_sampling_at_t0_and_static_trees():
    with pytest.raises(ConfigError, match="draft_choice=sample needs decode.temperature > 0"):
        compose(["decode.draft_choice=sample"])
    with pytest.raises(ConfigError, match="draft_choice=sample drafts a chain"):
        compose(
            ["decode.draft_choice=sample", "decode.temperature=0.7", "decode.tree=static", "decode.static_paths=[[0]]"]
        )
    with pytest.raises(ConfigError, match="decode.draft_choice"):
        compose(["decode.draft_choice=sampled"])
    assert compose(["decode.temperature=0.7"]).decode.draft_choice == "auto"
