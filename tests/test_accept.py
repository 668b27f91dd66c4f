"""Acceptance maths: logits processing, the tree walk, and the law of sampled speculative decoding."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle.config import DecodeConfig
from eagle.decode.accept import (
    accept_tree,
    accept_tree_reference,
    multi_draft_reference,
    process_logits,
    sample_index,
    sample_token,
    target_choices,
    walk_tree,
)
from eagle.decode.generator import SpeculativeGenerator
from eagle.decode.tree import retrieval_paths
from tests.support.decode import random_head
from tests.tiny_models import STATE_FAMILIES, make_config

# Tiny models are latency-bound: one torch thread (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chi2_ok(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.09) -> tuple[bool, float, float]:
    """Pearson chi-square goodness of fit at alpha ~ 1e-3 (Wilson-Hilferty critical value).

    Cells with expected count < 5 are pooled into one.
    """
    n = counts.sum().item()
    exp = probs.double() * n
    big = exp >= 5
    obs_c = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = exp_c > 0
    assert bool((obs_c[~keep] == 0).all()), "an outcome of probability 0 was sampled"
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    df = int(keep.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 7, 0.6)])
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ref = warpers(None, logits.clone()).softmax(-1)
    ours = process_logits(logits, temperature, top_k, top_p)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_process_logits_greedy_is_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert process_logits(logits, 0.0).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert target_choices(logits, 0.0).tolist() == [1, 0]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_accept_tree_matches_reference(data):
    n = data.draw(st.integers(1, 20))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    vocab = 5
    # Siblings get distinct tokens, as draft top-k guarantees.
    tokens = [data.draw(st.integers(0, vocab - 1))]
    used: dict[int, set[int]] = {}
    for i in range(1, n):
        free = sorted(set(range(vocab)) - used.setdefault(parents[i], set()))
        tok = data.draw(st.sampled_from(free)) if free else None
        if tok is None:  # more siblings than vocabulary: re-parent to the root's first child-free slot
            parents[i] = i - 1
            free = sorted(set(range(vocab)) - used.setdefault(parents[i], set()))
            tok = data.draw(st.sampled_from(free))
        used[parents[i]].add(tok)
        tokens.append(tok)
    choices = [data.draw(st.integers(0, vocab - 1)) for _ in range(n)]
    acc = accept_tree(torch.tensor(tokens), retrieval_paths(torch.tensor(parents)), torch.tensor(choices))
    nodes, emitted = accept_tree_reference(tokens, parents, choices)
    assert acc.nodes.tolist() == nodes
    assert acc.tokens == emitted
    # The lazy walk, given logits whose argmax is each node's choice, takes the same path.
    logits = torch.nn.functional.one_hot(torch.tensor(choices), vocab).float() * 3 + torch.rand(n, vocab)
    walked = walk_tree(torch.tensor(tokens), torch.tensor(parents), logits.to(torch.bfloat16), 0.0)
    assert walked.nodes.tolist() == nodes
    assert walked.tokens == emitted


def test_sample_index_has_the_law_of_its_probabilities():
    p = torch.tensor([0.25, 0.0, 0.05, 0.3, 0.0, 0.15, 0.2, 0.05])  # zeros must never be drawn
    gen = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.tensor([sample_index(p, gen) for _ in range(6000)]), minlength=8)
    ok, stat, crit = chi2_ok(counts.float(), p)
    assert ok, (stat, crit)
    assert sample_token(torch.tensor([0.1, 2.0, -1.0]).to(torch.bfloat16), 0.0) == 1
    # Nucleus and top-k zeros are respected through sample_token.
    logits = torch.tensor([2.0, 1.9, -3.0, 0.5, -8.0])
    kept = {sample_token(logits, 1.0, top_k=2, generator=gen) for _ in range(300)}
    assert kept == {0, 1}


def _walk_law(parents: list[int], tokens: list[int], p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted tokens: enumerate the target's draw at every node the walk reaches."""
    law: dict[tuple[int, ...], float] = {}

    def visit(node: int, prefix: tuple[int, ...], prob: float) -> None:
        for y in range(p.shape[1]):
            child = [c for c in range(len(parents)) if parents[c] == node and tokens[c] == y]
            if child:
                visit(child[0], prefix + (y,), prob * float(p[node, y]))
            elif p[node, y] > 0:
                law[prefix + (y,)] = prob * float(p[node, y])

    visit(0, (), 1.0)
    return law


def test_lazy_walk_has_the_law_of_draws_at_every_node():
    """walk_tree (draws only where it walks) emits sequences with the exact law that accept_tree over
    target_choices (one draw at every node) has; both checked against exact enumeration."""
    parents, tokens = [-1, 0, 0, 1, 1, 2], [4, 2, 0, 1, 3, 5]
    gen = torch.Generator().manual_seed(5)
    p = torch.rand(6, 6, generator=gen) ** 2
    p[:, 4] = 0.0  # a token the target never picks
    p = p / p.sum(-1, keepdim=True)
    logits = p.clamp(min=1e-30).log()
    law = _walk_law(parents, tokens, p)
    outcomes = sorted(law)
    index = {o: i for i, o in enumerate(outcomes)}
    exact = torch.tensor([law[o] for o in outcomes])
    paths = retrieval_paths(torch.tensor(parents))
    lazy, eager = torch.zeros(len(outcomes)), torch.zeros(len(outcomes))
    for _ in range(4000):
        lazy[
            index[tuple(walk_tree(torch.tensor(tokens), torch.tensor(parents), logits, 1.0, generator=gen).tokens)]
        ] += 1
        eager[
            index[tuple(accept_tree(torch.tensor(tokens), paths, target_choices(logits, 1.0, generator=gen)).tokens)]
        ] += 1
    for counts in (lazy, eager):
        ok, stat, crit = chi2_ok(counts, exact)
        assert ok, (stat, crit)


def test_multi_draft_reference_preserves_target_law():
    """The literal one-hot multi-draft rejection rule emits tokens distributed exactly as p."""
    p = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    for _ in range(6000):
        _, tok = multi_draft_reference(p, [2, 3, 7], generator=gen)
        counts[tok] += 1
    ok, stat, crit = chi2_ok(counts, p)
    assert ok, (stat, crit)


def test_tree_walk_has_the_law_of_multi_draft_rejection():
    """Per node, P(accept sibling i) and P(bonus = y) of the walk equal the literal rule's."""
    p = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
    drafts = [2, 0, 5]
    tree_tokens = torch.tensor([7] + drafts)
    paths = retrieval_paths(torch.tensor([-1, 0, 0, 0]))
    logits = p.clamp(min=1e-30).log().expand(4, 8)
    gen = torch.Generator().manual_seed(1)
    walk = torch.zeros(4, 8)  # [accepted child index (0 = none), emitted first token]
    lit = torch.zeros(4, 8)
    for _ in range(2500):
        acc = accept_tree(tree_tokens, paths, target_choices(logits, 1.0, generator=gen))
        walk[int(acc.nodes[1]) if acc.nodes.numel() > 1 else 0, acc.tokens[0]] += 1
        idx, tok = multi_draft_reference(p, drafts, generator=gen)
        lit[0 if idx is None else idx + 1, tok] += 1
    # Both follow the exact joint law: child i <-> its token; otherwise a non-drafted token.
    exact = torch.zeros(4, 8)
    for i, d in enumerate(drafts):
        exact[i + 1, d] = p[d]
    for t in range(8):
        if t not in drafts:
            exact[0, t] = p[t]
    for counts in (walk, lit):
        ok, stat, crit = chi2_ok(counts.flatten(), exact.flatten())
        assert ok, (stat, crit)


def _vocab8_target(family: str = "llama"):
    """An 8-token target (Llama, a hybrid Qwen3.5 with one linear-attention and one full layer, or one of
    the tiny STATE_FAMILIES)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig

    common = dict(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if family == "qwen3_5":
        cfg = Qwen3_5TextConfig(
            **common,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            layer_types=["linear_attention", "full_attention"],
        )
    elif family in STATE_FAMILIES:  # the tiny family's own layer pattern over 8 tokens
        cfg = make_config(family, vocab_size=8)
        cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    else:
        cfg = LlamaConfig(**common)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # non-uniform but not peaked next-token laws
    model.generation_config.eos_token_id = None
    return model.eval()


def _sampled_law_check(
    samples: int,
    prompt: tuple[int, int, int] = (1, 5, 2),
    head_options: dict | None = None,
    family: str = "llama",
    min_accepted: float = 1 / 8,
    **decode_kw,
) -> None:
    """Tokens 2 and 3 of speculative sampling follow the target's exact law (token 1 is marginalised).

    Token 1 comes from the prefill; tokens 2-3 come from the first verify pass (an accepted draft plus
    the choice at that node) or from two passes, so both acceptance outcomes are exercised. With
    `lookup_tokens` the prompt-lookup chain (unigram matches against the prompt and token 1) joins the
    tree, sometimes as new nodes, sometimes along the head's.
    """
    model = _vocab8_target(family)
    tok = SimpleNamespace(eos_token_id=None)
    prompt = list(prompt)
    t, k, tp = 0.9, 6, 0.95
    cfg = DecodeConfig(
        **{
            **dict(
                tree="dynamic",
                tree_top_k=3,
                tree_depth=2,
                tree_total_tokens=5,
                max_new_tokens=3,
                temperature=t,
                top_k=k,
                top_p=tp,
                seed=0,
            ),
            **decode_kw,
        }
    )
    grid = torch.cartesian_prod(torch.arange(8), torch.arange(8))  # [64, 2] (t1, t2)
    seqs = torch.cat([torch.tensor(prompt).expand(64, 3), grid], dim=1)  # [64, 5]
    with torch.no_grad():
        logits = model(input_ids=seqs).logits  # [64, 5, 8]
    p1 = process_logits(logits[0, 2], t, k, tp)  # [8]
    p2 = process_logits(logits[::8, 3], t, k, tp)  # [8 (t1), 8 (t2)]
    p3 = process_logits(logits[:, 4], t, k, tp).view(8, 8, 8)  # [t1, t2, t3]
    exact = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()  # [64] law of (t2, t3)
    options = {"algorithm": "eagle1", **(head_options or {})}
    gen = SpeculativeGenerator(model, random_head(model, seed=0, **options), tok, cfg)
    counts = torch.zeros(64)
    accepted = grafted_accepted = 0
    for _ in range(samples):
        res = gen.generate(prompt)
        assert len(res.tokens) == 3
        counts[res.tokens[1] * 8 + res.tokens[2]] += 1
        accepted += int(res.accept_lengths[0] >= 2)
        grafted_accepted += sum(res.lookup_accepted)
    if decode_kw.get("lookup_tokens"):
        assert grafted_accepted > samples // 50, grafted_accepted  # lookup-only nodes were accepted too
    ok, stat, crit = chi2_ok(counts, exact)
    assert ok, (stat, crit)
    # Only meaningful if drafts were accepted often (the bonus-only path is trivially exact).
    assert accepted > samples * min_accepted, accepted


@pytest.mark.parametrize("lookup", [0, 2])
def test_sampled_decoding_follows_target_distribution(lookup):
    # With lookup the head drafts one node, so that the chain often adds nodes of its own, and the prompt
    # is one whose lookup proposals this target often takes (~0.8 accepted lookup nodes per run).
    if lookup:
        _sampled_law_check(
            400,
            prompt=(5, 7, 4),
            lookup_tokens=lookup,
            lookup_min_ngram=1,
            tree_top_k=1,
            tree_depth=1,
            tree_total_tokens=1,
        )
    else:
        _sampled_law_check(400)


@pytest.mark.slow
def test_sampled_decoding_follows_target_distribution_many_samples():
    _sampled_law_check(5000)
