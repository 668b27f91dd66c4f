"""Approximate acceptance (decode.acceptance=typical|lenient): the rules, the exact law of what they emit,
the walk that applies them, and that `exact` is untouched by any of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from eagle.cli.app import compose
from eagle.config import ConfigError, DecodeConfig
from eagle.decode.accept import process_logits, walk_tree
from eagle.decode.approximate import (
    AcceptanceRule,
    acceptance_label,
    accepted_among,
    accepted_tokens,
    accepted_tokens_reference,
    emitted_law,
    emitted_law_reference,
    node_shift,
    shift,
    walk_tree_approx,
)
from eagle.decode.generator import SpeculativeGenerator
from tests.support.decode import random_head
from tests.test_accept import _vocab8_target, chi2_ok

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RULES = [
    AcceptanceRule("exact"),
    AcceptanceRule("typical"),
    AcceptanceRule("typical", 0.2, 0.8),
    AcceptanceRule("lenient"),
    AcceptanceRule("lenient", lenient_top_k=4, lenient_margin=3.0),
]


def _case(seed: int, n: int = 6, v: int = 12, k: int = 4, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Random logits [N, V], their processed law, and K distinct children per row in a random order
    (-1 padded at random)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 2.5
    p = process_logits(logits, temperature, top_k, top_p)
    children = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])  # [N, K]
    pad = torch.rand(n, k, generator=g) < 0.3
    children = torch.where(pad, -1, children)
    return logits, p, children


# --- the law of the emitted token ------------------------------------------------------------------------


def test_exact_rule_emits_the_target_law():
    """Under exact acceptance the emitted law is p itself, to float precision, and there is no shift."""
    for temperature in (0.0, 0.7, 1.0):
        logits, p, children = _case(0, temperature=temperature)
        ok = accepted_tokens(AcceptanceRule("exact"), logits, p, temperature)
        assert not ok.any()
        q = emitted_law(p, children, ok)
        law = p.double() / p.double().sum(-1, keepdim=True)  # what a draw samples (float32 p sums to 1 +- 1e-7)
        torch.testing.assert_close(q, law, atol=1e-12, rtol=0)
        tv, kl = shift(p, q)
        assert tv.abs().max() < 1e-12 and kl.abs().max() < 1e-12


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(RULES),
    st.sampled_from([0.0, 0.6, 1.0, 1.5]),
    st.sampled_from([(0, 1.0), (5, 1.0), (0, 0.8)]),
)
# Found by Hypothesis: this float32 softmax sums to 1 - 2.4e-7, and the law must still sum to 1 in float64.
@example(seed=1351, rule=AcceptanceRule("exact"), temperature=0.6, truncation=(0, 1.0))
def test_vectorised_rule_and_law_match_the_references(seed, rule, temperature, truncation):
    top_k, top_p = truncation
    logits, p, children = _case(seed, temperature=temperature, top_k=top_k, top_p=top_p)
    ok = accepted_tokens(rule, logits, p, temperature)
    q = emitted_law(p, children, ok)
    for i in range(logits.shape[0]):
        ref_ok = accepted_tokens_reference(rule, logits[i].tolist(), p[i].tolist(), temperature)
        assert ok[i].tolist() == ref_ok
        kids = [c for c in children[i].tolist() if c >= 0]
        # The walk's per-node fast path (drafted tokens only; no law built at T = 0) agrees with the mask.
        among = accepted_among(
            rule, logits[i], None if temperature <= 0 else p[i], temperature, torch.tensor(kids, dtype=torch.long)
        )
        assert among.tolist() == [ref_ok[c] for c in kids]
        ref_q = torch.tensor(emitted_law_reference(p[i].double().tolist(), kids, ref_ok), dtype=torch.float64)
        torch.testing.assert_close(q[i], ref_q, atol=1e-12, rtol=0)
        # The walk's closed-form shift equals TV / KL computed from the whole law.
        passing = [j for j, c in enumerate(kids) if ref_ok[c]]
        tv, kl = node_shift([float(p[i, c]) for c in kids], passing[0] if passing else None)
        full_tv, full_kl = shift(p[i : i + 1], q[i : i + 1])
        # (float32 p sums to 1 within ~1e-7: the closed form's 1 - p(C) and the law's p(not C) differ by that)
        assert tv == pytest.approx(float(full_tv), abs=1e-6)
        assert kl == pytest.approx(float(full_kl), abs=1e-6) or (kl == float("inf") == float(full_kl))
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0], dtype=torch.float64), atol=1e-12, rtol=0)


def test_typical_threshold_by_hand():
    """Medusa's rule: p(x) > min(epsilon, delta * exp(-H)). For p = (.5, .3, .2), H = 1.0297 and exp(-H) =
    0.357: epsilon binds at (0.25, 0.9) (threshold .25), the entropy term at (0.5, 0.3) (threshold .107)."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    assert accepted_tokens(AcceptanceRule("typical", 0.25, 0.9), p.log(), p, 1.0).tolist() == [[True, True, False]]
    assert accepted_tokens(AcceptanceRule("typical", 0.5, 0.3), p.log(), p, 1.0).tolist() == [[True, True, True]]
    flat = torch.full((1, 8), 1 / 8)  # H = log 8: threshold min(.09, .3 / 8)
    assert accepted_tokens(AcceptanceRule("typical"), flat.log(), flat, 1.0).all()
    peaked = torch.tensor([[0.90, 0.08, 0.02]])
    assert accepted_tokens(AcceptanceRule("typical"), peaked.log(), peaked, 1.0).tolist() == [[True, False, False]]


def test_lenient_rule_by_hand():
    rule = AcceptanceRule("lenient", lenient_top_k=2, lenient_margin=1.0)
    logits = torch.tensor([[3.0, 2.5, 2.4, 0.0]])
    p = process_logits(logits, 0.0)
    assert accepted_tokens(rule, logits, p, 0.0).tolist() == [[True, True, False, False]]  # rank 3 is out
    wide = AcceptanceRule("lenient", lenient_top_k=3, lenient_margin=0.55)
    assert accepted_tokens(wide, logits, p, 0.0).tolist() == [[True, True, False, False]]  # 0.6 below: out
    # Sampling with top-k = 1: the runner-up is outside the target's support and never accepted.
    assert accepted_tokens(rule, logits, process_logits(logits, 1.0, top_k=1), 1.0).tolist() == [
        [True, False, False, False]
    ]


def test_the_shift_is_the_missed_mass():
    """Children {1, 2} of p = (.5, .2, .1, .2), token 1 passes: the missed draws (tokens 0 and 3, mass .7)
    all become token 1: q = (0, .9, .1, 0), TV .7, KL(q || p) = .9 log(.9 / .2)."""
    p = torch.tensor([[0.5, 0.2, 0.1, 0.2]])
    ok = torch.tensor([[False, True, False, False]])
    q = emitted_law(p, torch.tensor([[2, 1]]), ok)
    torch.testing.assert_close(q, torch.tensor([[0.0, 0.9, 0.1, 0.0]], dtype=torch.float64))
    tv, kl = shift(p, q)
    assert float(tv) == pytest.approx(0.7) and float(kl) == pytest.approx(0.9 * torch.log(torch.tensor(4.5)).item())
    assert node_shift([0.2, 0.1], 0) == (pytest.approx(0.7), pytest.approx(float(kl)))
    # Greedy (one-hot p) with a non-argmax child accepted: TV 1 and an infinite KL.
    assert node_shift([0.0], 0) == (1.0, float("inf"))


# --- the walk ------------------------------------------------------------------------------------------


def test_approximate_walk_emits_its_computed_law():
    """Chi-square: the first token the walk emits at a root with four children follows `emitted_law`
    (not p: the rule moves the law by a TV of the non-drafted mass)."""
    g = torch.Generator().manual_seed(4)
    v = 10
    logits = (torch.randn(v, generator=g) * 1.5).expand(5, v).contiguous()  # every node: the same law
    parents, tokens = [-1, 0, 0, 0, 0], [9, 1, 4, 6, 7]
    rule, temperature = AcceptanceRule("typical", typical_epsilon=0.09, typical_delta=0.3), 1.0
    p = process_logits(logits[:1], temperature)
    order = sorted(tokens[1:], key=lambda t: -float(logits[0, t]))
    q = emitted_law(p, torch.tensor([order]), accepted_tokens(rule, logits[:1], p, temperature))[0]
    tv, _ = shift(p, q[None])
    assert float(tv) > 0.1  # the rule fires here: a real change of law to detect
    counts = torch.zeros(v)
    for _ in range(3000):
        acc, _ = walk_tree_approx(torch.tensor(tokens), torch.tensor(parents), logits, rule, temperature, generator=g)
        counts[acc.tokens[0]] += 1
    ok, stat, crit = chi2_ok(counts, q.float())
    assert ok, (stat, crit)
    ok_p, _, _ = chi2_ok(counts, p[0])
    assert not ok_p  # and it is detectably not p


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.8]))
def test_a_rule_that_never_fires_walks_exactly_as_exact(seed, temperature):
    """Same draws, same randomness: where no child passes, the approximate walk is `walk_tree`. Lenient with
    top_k = 1 and no margin passes only the target's top-1, which we keep out of the children."""
    g = torch.Generator().manual_seed(seed)
    n, v = 7, 9
    logits = torch.randn(n, v, generator=g) * 2
    parents = [-1, 0, 0, 1, 1, 2, 3]
    top = logits.argmax(-1)
    tokens = [0]
    for c in range(1, n):
        siblings = {tokens[s] for s in range(1, c) if parents[s] == parents[c]}
        tokens.append(next(t for t in range(v) if t != int(top[parents[c]]) and t not in siblings))
    rule = AcceptanceRule("lenient", lenient_top_k=1, lenient_margin=0.0)
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    approx, stats = walk_tree_approx(
        torch.tensor(tokens), torch.tensor(parents), logits, rule, temperature, generator=a
    )
    exact = walk_tree(torch.tensor(tokens), torch.tensor(parents), logits, temperature, generator=b)
    assert approx.tokens == exact.tokens and approx.nodes.tolist() == exact.nodes.tolist()
    assert stats.tv == 0.0 and stats.kl == 0.0 and stats.positions == len(exact.tokens)


def test_approximate_walk_accepts_where_exact_stops():
    """Greedy, the target's top-1 not drafted, its runner-up drafted within the margin: exact emits the
    top-1 as bonus; lenient accepts the runner-up and walks on (TV 1 at that position, KL infinite)."""
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0], [0.0, -1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    tokens, parents = torch.tensor([0, 2, 0]), torch.tensor([-1, 0, 0])
    exact = walk_tree(tokens, parents, logits, 0.0)
    assert exact.tokens == [1]
    acc, stats = walk_tree_approx(tokens, parents, logits, AcceptanceRule("lenient"), 0.0)
    assert acc.tokens == [2, 3] and acc.nodes.tolist() == [0, 1]
    assert stats.positions == 2 and stats.tv == 1.0 and stats.kl_infinite == 1


# --- in the decoder ------------------------------------------------------------------------------------


def _generate(acceptance: str, temperature: float, **kw):
    model = _vocab8_target()
    cfg = DecodeConfig(
        tree="dynamic",
        tree_top_k=3,
        tree_depth=2,
        tree_total_tokens=5,
        max_new_tokens=24,
        temperature=temperature,
        seed=0,
        acceptance=acceptance,
        **kw,
    )
    gen = SpeculativeGenerator(model, random_head(model, "eagle1", seed=0), SimpleNamespace(eos_token_id=None), cfg)
    return gen.generate([1, 5, 2])


def test_decoder_exact_has_no_shift_and_typical_is_exact_at_temperature_0():
    exact = _generate("exact", 0.0)
    assert exact.shift.tv == 0.0 and exact.shift.kl == 0.0 and exact.shift.positions >= sum(exact.accept_lengths)
    typical = _generate("typical", 0.0)  # p is one-hot at T = 0: only the argmax can pass
    assert typical.tokens == exact.tokens and typical.shift.tv == 0.0


def test_decoder_lenient_accepts_more_and_measures_its_shift():
    exact = _generate("exact", 0.0)
    lenient = _generate("lenient", 0.0, lenient_top_k=8, lenient_margin=100.0)  # any drafted child passes
    assert sum(lenient.accept_lengths) / len(lenient.accept_lengths) > sum(exact.accept_lengths) / len(
        exact.accept_lengths
    )
    assert lenient.shift.tv > 0 and lenient.shift.kl_infinite > 0  # greedy: any change is a different token
    sampled = _generate("typical", 1.0)
    assert sampled.shift.positions > 0 and sampled.shift.kl_infinite == 0  # typical only emits tokens p can emit


# --- configuration and labels --------------------------------------------------------------------------


def test_defaults_are_exact():
    cfg = compose([])
    assert cfg.decode.acceptance == "exact" and AcceptanceRule.from_config(cfg.decode).lossless
    assert cfg.eval.divergence_check is None


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["decode.acceptance=loose"], "decode.acceptance"),
        (["decode.typical_epsilon=0"], "decode.typical_epsilon"),
        (["decode.typical_epsilon=1.0"], "decode.typical_epsilon"),
        (["decode.typical_delta=1.5"], "decode.typical_delta"),
        (["decode.lenient_top_k=0"], "decode.lenient_top_k"),
        (["decode.lenient_margin=-0.5"], "decode.lenient_margin"),
        (["decode.acceptance=typical", "eval.divergence_check=true"], "eval.divergence_check"),
        (["decode.acceptance=lenient", "decode.temperature=1", "decode.draft_choice=sample"], "decode.draft_choice"),
    ],
)
def test_bad_settings_are_refused_at_start_naming_the_setting(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose(overrides)


def test_approximate_rules_draft_top_k_trees_and_exact_may_check_divergence():
    from eagle.decode.draft import uses_sampled_drafts

    assert not uses_sampled_drafts(compose(["decode.acceptance=typical", "decode.temperature=1"]).decode)
    assert uses_sampled_drafts(compose(["decode.temperature=1"]).decode)
    assert compose(["eval.divergence_check=true"]).eval.divergence_check is True


def test_labels():
    assert acceptance_label(None) == "" and acceptance_label("exact") == ""
    assert (
        acceptance_label(AcceptanceRule("typical").settings())
        == "APPROXIMATE acceptance: typical (epsilon=0.09, delta=0.3), not lossless"
    )
    assert (
        acceptance_label(AcceptanceRule("lenient").settings())
        == "APPROXIMATE acceptance: lenient (top_k=2, margin=1.0), not lossless"
    )


# --- transformers' assistant_ensemble_weight beside our rules (docs/acceptance.md) ----------------------


def _chain_case(seed: int, k: int = 3, v: int = 8):
    """A chain of K drafts sampled from q, the draft logits [K, V] and the target logits [K + 1, V]."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, v, generator=g) * 2
    draft = target[:k] + torch.randn(k, v, generator=g) * 1.5
    tokens = torch.multinomial(draft.softmax(-1), 1, generator=g).squeeze(1)
    return tokens, draft, target


@pytest.mark.parametrize("weight", [None, 0.3, 0.7, 0.95])
def test_ensemble_accepts_exactly_what_transformers_accepts(weight):
    """Fed transformers' own uniforms (`_speculative_sampling` draws them with `rand_like` after the seed),
    `ensemble_accept` accepts the same drafts, for w = None (lossless) and for w in (0, 1)."""
    from transformers.generation.utils import _speculative_sampling

    from eagle.decode.approximate import ensemble_accept

    matched = []
    for seed in range(40):
        tokens, draft, target = _chain_case(seed)
        k = tokens.numel()
        ids = torch.cat([torch.tensor([5, 1]), tokens])[None]  # [1, prompt + K]
        torch.manual_seed(seed)
        _, n_matches = _speculative_sampling(ids, draft[None], k, target[None], assistant_ensemble_weight=weight)
        torch.manual_seed(seed)
        u = torch.rand(k)  # what `rand_like` drew there (float32, [K])
        uniforms = torch.cat([u.double(), torch.tensor([0.5], dtype=torch.float64)])
        accepted, _ = ensemble_accept(
            tokens, draft.softmax(-1), target.softmax(-1), uniforms, 1.0 if weight is None else weight
        )
        assert accepted == tokens[: int(n_matches)].tolist()
        matched.append(len(accepted))
    assert 0 < sum(matched) < 40 * 3  # both outcomes exercised


def test_ensemble_weight_0_accepts_every_draft_and_1_is_speculative_sampling():
    """w = 0 accepts every draft whatever the uniforms (the bonus then comes from p after K drafts); w = 1
    emits the target's law (chi-square), w = 0.4 emits `ensemble_law` = 0.4 p + 0.6 q, detectably not p."""
    from eagle.decode.approximate import ensemble_accept, ensemble_law

    tokens, draft, target = _chain_case(3)
    q, p = draft.softmax(-1), target.softmax(-1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        accepted, bonus = ensemble_accept(tokens, q, p, torch.rand(4, generator=g, dtype=torch.float64), 0.0)
        assert accepted == tokens.tolist() and p[3, bonus] > 0
    with pytest.raises(ValueError, match="weight"):
        ensemble_accept(tokens, q, p, torch.rand(4, dtype=torch.float64), 1.5)
    for weight in (1.0, 0.4):
        counts = torch.zeros(8)
        for _ in range(4000):  # the first emitted token, the draft sampled from q as the chain would
            x = torch.multinomial(q[0], 1, generator=g)
            accepted, bonus = ensemble_accept(x, q[:1], p[:2], torch.rand(2, generator=g, dtype=torch.float64), weight)
            counts[accepted[0] if accepted else bonus] += 1
        law = ensemble_law(p[0], q[0], weight)
        assert chi2_ok(counts, law)[0]
        assert chi2_ok(counts, p[0])[0] == (weight == 1.0)


def _simulate(setup, rule, ctx, gamma: int, samples: int, seed: int):
    """Monte Carlo of the study's process through the decoder's own functions: per pass, a chain of gamma
    drafts (sampled from q for the ensemble, top-1 of q for ours) accepted by `ensemble_accept` or
    `walk_tree_approx` / `walk_tree`; passes until gamma + 1 tokens are out. Returns (joint counts, mean
    tokens of the first pass)."""
    from eagle.decode.approximate import ensemble_accept

    v = 8
    g = torch.Generator().manual_seed(seed)
    n = gamma + 1
    counts = torch.zeros(v**n)
    first_pass = 0
    for _ in range(samples):
        c, out = ctx, []
        while len(out) < n:
            cs, drafts = [c], []
            for _ in range(gamma):
                q = setup.draft_logits[cs[-1]].softmax(-1)
                x = int(torch.multinomial(q, 1, generator=g)) if rule.sampled else int(q.argmax())
                drafts.append(x)
                cs.append((cs[-1][1], x))
            if rule.kind == "ensemble":
                q = torch.stack([setup.draft_logits[ci].softmax(-1) for ci in cs[:-1]])
                if not rule.sampled:
                    q = torch.nn.functional.one_hot(torch.tensor(drafts), v).double()
                p = torch.stack([setup.target_logits[ci].softmax(-1) for ci in cs])
                u = torch.rand(gamma + 1, generator=g, dtype=torch.float64)
                accepted, bonus = ensemble_accept(torch.tensor(drafts), q, p, u, rule.weight)
                emitted = accepted + [bonus]
            else:
                tree, parents = torch.tensor([0, *drafts]), torch.tensor(list(range(-1, gamma)))
                logits = torch.stack([setup.target_logits[ci] for ci in cs]).float()
                if rule.kind == "exact":
                    emitted = walk_tree(tree, parents, logits, 1.0, generator=g).tokens
                else:
                    emitted = walk_tree_approx(tree, parents, logits, rule.approx, 1.0, generator=g)[0].tokens
            if not out:
                first_pass += len(emitted)
            out += emitted
            c = (c[1], out[0]) if len(out) == 1 else (out[-2], out[-1])
        counts[sum(t * v ** (n - 1 - i) for i, t in enumerate(out[:n]))] += 1
    return counts, first_pass / samples


@pytest.mark.parametrize("which", ["exact-top1", "ensemble-sampled", "ensemble-top1", "typical", "lenient"])
def test_exact_laws_of_the_side_by_side_study_match_monte_carlo(which):
    """`benchmarks approximate_rules` enumerates the joint law of the first gamma + 1 tokens and tau; a fixed-
    seed Monte Carlo through the decoder's functions agrees: chi-square on the joint law, tau within 4
    standard errors, and the estimated TV from the target within 0.03."""
    from benchmarks.studies.approximate_rules import Rule, Setup, first_token, joint_law, pass_law, target_joint_law, tv

    rule = {
        "exact-top1": Rule("exact"),
        "ensemble-sampled": Rule("ensemble", sampled=True, weight=0.5),
        "ensemble-top1": Rule("ensemble", weight=0.6),
        "typical": Rule("typical", approx=AcceptanceRule("typical")),
        "lenient": Rule("lenient", approx=AcceptanceRule("lenient", lenient_top_k=3, lenient_margin=1.5)),
    }[which]
    setup, gamma, ctx, samples = Setup.seeded(0), 2, (3, 6), 3000
    law = torch.tensor(joint_law(setup, rule, ctx, gamma + 1, gamma), dtype=torch.float64)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    passes = pass_law(setup, rule, ctx, gamma)
    tau = sum(len(s) * m for s, m in passes.items())
    second = sum(len(s) ** 2 * m for s, m in passes.items())
    counts, tau_mc = _simulate(setup, rule, ctx, gamma, samples, seed=11)
    ok, stat, crit = chi2_ok(counts, law)
    assert ok, (stat, crit)
    assert abs(tau_mc - tau) < 4 * ((second - tau**2) / samples) ** 0.5 + 1e-9
    target = target_joint_law(setup, ctx, gamma + 1)
    first = first_token(law.tolist(), gamma + 1)
    empirical = first_token((counts / samples).tolist(), gamma + 1)
    assert abs(tv(empirical, first_token(target, gamma + 1)) - tv(first, first_token(target, gamma + 1))) < 0.03
    if which == "exact-top1":
        assert tv(law.tolist(), target) < 1e-12
