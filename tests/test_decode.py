"""Speculative decoding is lossless: greedy output equals the target's own greedy decoding, stops
are exact even when several tokens are accepted at once, and the tree modes all work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle.decode import SpeculativeGenerator, autoregressive_generate, choose_tree_size, expected_tokens
from eagle.decode.autotree import monotone_envelope
from eagle.errors import EagleError
from tests.support.decode import OracleHead, decode_cfg, hf_greedy, prompt_ids, random_head
from tests.tiny_models import make_model

# Tiny models are latency-bound: one torch thread (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Write a short poem about the sea.", "def add(a, b):", "Explain relativity"]
STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_greedy_equals_target_greedy(tiny_target, tree):
    model, tok = tiny_target
    heads = {
        "eagle1": random_head(model, "eagle1"),
        "eagle3": random_head(model, "eagle3", draft_vocab_size=200),
        "eagle3.1": random_head(model, "eagle3", draft_vocab_size=200, fc_norm=True, norm_output=True),
    }
    for i, text in enumerate(PROMPTS[:2]):
        ids = prompt_ids(tok, text)
        n = 20 + 7 * i
        ref = hf_greedy(model, ids, n)
        base = autoregressive_generate(model, tok, ids, decode_cfg(max_new_tokens=n))
        assert base.tokens == ref
        heads["oracle"] = OracleHead(ids + ref, len(tok))
        for name, head in heads.items():
            cfg = decode_cfg(max_new_tokens=n, tree=tree, static_paths=STATIC)
            res = SpeculativeGenerator(model, head, tok, cfg).generate(ids)
            assert res.tokens == ref, (name, tree)
            assert sum(res.accept_lengths) + 1 == len(res.tokens)
            assert res.target_forwards == len(res.accept_lengths)
            if name == "oracle":
                assert max(res.accept_lengths) >= 3  # long accepted runs really happened
            assert res.timings.total_s >= res.timings.target_s + res.timings.draft_s - 1e-9


def test_greedy_long_generation_crosses_sliding_window():
    model, tok = make_model("gemma3")
    ids = prompt_ids(tok, "Write a short poem about the sea. " * 3)  # ~50 tokens; window is 64
    ref = hf_greedy(model, ids, 60)
    res = SpeculativeGenerator(model, OracleHead(ids + ref, len(tok)), tok, decode_cfg(max_new_tokens=60)).generate(ids)
    assert res.tokens == ref


@pytest.fixture(scope="module")
def stop_case():
    # Qwen2 seed 1 on this prompt gives a varied greedy continuation (many distinct tokens), which the
    # EOS / stop-string cases need; most tiny random targets repeat one token.
    model, tok = make_model("qwen2", seed=1)
    model.generation_config.eos_token_id = None  # stops under test control
    ids = prompt_ids(tok, "def add(a, b):")
    ref = hf_greedy(model, ids, 40)
    return model, tok, ids, ref


def _gen(model, tok, ids, ref, **kw):
    vocab = model.get_output_embeddings().weight.shape[0]
    return SpeculativeGenerator(model, OracleHead(ids + ref, vocab), tok, decode_cfg(**kw))


def test_max_new_tokens_never_exceeded(stop_case):
    model, tok, ids, ref = stop_case
    truncated = 0
    for n in range(1, 16):
        res = _gen(model, SimpleNamespace(eos_token_id=None), ids, ref, max_new_tokens=n).generate(ids)
        assert res.tokens == ref[:n] and res.stop_reason == "max_new_tokens"
        truncated += int(bool(res.accepted_depths) and res.accepted_depths[-1] + 1 > res.accept_lengths[-1])
    assert truncated > 0  # some limits fell inside a multi-token accepted run


def test_eos_inside_accepted_run(stop_case):
    model, tok, ids, ref = stop_case
    truncated = 0
    for k in range(1, 30):
        eos = ref[k]
        expect = ref[: ref.index(eos) + 1]
        res = _gen(model, SimpleNamespace(eos_token_id=eos), ids, ref, max_new_tokens=40).generate(ids)
        assert res.tokens == expect and res.stop_reason == "eos"
        truncated += int(res.accepted_depths[-1] + 1 > res.accept_lengths[-1]) if res.accepted_depths else 0
    assert truncated > 0


def test_stop_string_inside_accepted_run(stop_case):
    model, tok, ids, ref = stop_case
    text = tok.decode(ref)
    hits = 0
    for k in range(2, 25):
        stop = tok.decode(ref[k - 1 : k + 1])[-3:]
        if not stop.strip():
            continue
        # Expected: the shortest prefix whose text contains the stop string.
        end = next(j for j in range(1, len(ref) + 1) if stop in tok.decode(ref[:j]))
        res = _gen(model, tok, ids, ref, max_new_tokens=40, stop_strings=[stop]).generate(ids)
        assert res.tokens == ref[:end] and res.stop_reason == "stop_string", (stop, text)
        hits += 1
    assert hits > 5


def test_stream_yields_what_generate_returns(stop_case):
    model, tok, ids, ref = stop_case
    gen = _gen(model, tok, ids, ref, max_new_tokens=25)
    chunks = list(gen.stream(ids))
    assert [t for c in chunks for t in c] == ref[:25]
    assert [len(c) for c in chunks[1:]] == gen.last_result.accept_lengths


def test_auto_tree_is_lossless_and_chooses_a_candidate(stop_case):
    model, tok, ids, ref = stop_case
    gen = _gen(
        model, tok, ids, ref, max_new_tokens=20, tree="auto", auto_candidates=[2, 4, 8], tree_top_k=3, tree_depth=3
    )
    res = gen.generate(ids)
    assert res.tokens == ref[:20]
    assert set(gen.verify_times) == {2, 4, 8}
    times = [gen.verify_times[s] for s in (2, 4, 8)]
    assert times == sorted(times)  # made non-decreasing: noise never makes a bigger pass look cheaper
    assert set(res.tree_sizes) <= {2, 4, 8}


def test_monotone_envelope_keeps_the_cheapest_time_at_or_above_each_size():
    noisy = {1: 0.046, 2: 0.041, 3: 0.049, 4: 0.039, 8: 0.055, 16: 0.050, 24: 0.078}
    assert monotone_envelope(noisy) == {1: 0.039, 2: 0.039, 3: 0.039, 4: 0.039, 8: 0.050, 16: 0.050, 24: 0.078}


def test_choose_tree_size_model():
    scores = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.05, 0.04, 0.01]))
    assert expected_tokens(scores, [0, 3, 6])[1] == pytest.approx(1 + 2.4)
    flat = {1: 1.0, 3: 1.0, 6: 1.0}  # free verification: the biggest tree wins
    assert choose_tree_size(flat, scores, default=4) == 6
    steep = {1: 1.0, 3: 1.2, 6: 3.0}  # expensive big trees: stop where the confident nodes end
    assert choose_tree_size(steep, scores, default=4) == 3
    assert choose_tree_size({}, scores, default=4) == 4


def test_rejects_batched_or_empty_prompts(stop_case):
    model, tok, ids, ref = stop_case
    gen = _gen(model, tok, ids, ref)
    with pytest.raises(EagleError):
        gen.generate(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(EagleError):
        gen.generate([])


@pytest.mark.smollm2
def test_smollm2_greedy_identity(smollm2):
    model, tok, _ = smollm2
    ids = prompt_ids(tok, "What is the capital of France?")
    ref = hf_greedy(model, ids, 24)
    res = SpeculativeGenerator(
        model, random_head(model, "eagle3", draft_vocab_size=2000), tok, decode_cfg(max_new_tokens=24)
    ).generate(ids)
    assert res.tokens == ref


def test_draft_pool_stops_where_the_next_levels_expected_gain_falls_below_min_gain():
    """The early stop of `draft_pool`, recomputed from the full pool: before drafting level d + 1 the
    expected gain is rho_d * M_d (M_d: mass of the level-d frontier, rho_d: level d's mass over the
    frontier it was drafted from, at most 1); the first level under `min_gain` ends the pool, which is
    then a prefix of the full one."""
    from eagle.decode.cache import cache_length
    from eagle.decode.draft import draft_pool
    from eagle.decode.target import new_cache

    model = make_model("llama")[0]
    head = random_head(model, "eagle3", draft_vocab_size=16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, head.config.vocab_size, (6,), generator=g)
    feats = torch.randn(6, 3, head.config.target_hidden_size, generator=g)
    k, depth = 3, 5
    cache = new_cache()
    with torch.inference_mode():
        root = head.commit(cache, prompt, feats, torch.arange(0, 6))
        full = draft_pool(head, cache, root, 6, k, depth)
        gains, parent_mass = [], 1.0  # the root's mass
        for d in range(1, depth):
            level = full.scores[full.depths == d].double().exp()
            frontier_mass = float(level.topk(min(k, level.numel())).values.sum())
            gains.append(min(1.0, float(level.sum()) / parent_mass) * frontier_mass)
            parent_mass = frontier_mass
        checked = 0
        for stop in range(1, depth):  # a min_gain just above gains[stop - 1] and under every earlier gain
            min_gain = gains[stop - 1] * 1.001
            if any(g < min_gain for g in gains[: stop - 1]):
                continue
            pool = draft_pool(head, cache, root, 6, k, depth, min_gain=min_gain)
            n = pool.tokens.numel()
            assert int(pool.depths.max()) == stop and cache_length(cache) == 6
            assert torch.equal(pool.tokens, full.tokens[:n]) and torch.equal(pool.parents, full.parents[:n])
            checked += 1
        assert checked >= 2
        assert int(draft_pool(head, cache, root, 6, k, depth, min_gain=min(gains) / 2).depths.max()) == depth


def test_depth_calibration_may_exceed_one_where_the_tree_size_calibration_may_not():
    from eagle.decode.autotree import MAX_DEPTH_CALIBRATION, AutoTreeState

    state = AutoTreeState()
    for _ in range(30):  # the head predicted 0.5 accepted drafts a step; 2 were accepted
        state.predicted, state.levels = 0.5, 2
        state.observe(accepted=2, draft_s=0.004, step_s=0.05)
    assert state.calibration == 1.0 and 1.0 < state.depth_calibration <= MAX_DEPTH_CALIBRATION
    per_level_tokens = state.level_s * state.tokens / state.step_s
    assert state.min_level_gain() == pytest.approx(per_level_tokens / state.depth_calibration)
    for _ in range(60):  # over-confident: predicted 3, accepted 0
        state.predicted = 3.0
        state.observe(accepted=0, draft_s=0.004, step_s=0.05)
    assert state.depth_calibration == state.calibration < 0.5
