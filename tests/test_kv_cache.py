"""After a partially accepted verify pass, the kept cache gives the same logits as a fresh forward."""

from __future__ import annotations

from dataclasses import replace

import torch

from eagle.decode.accept import accept_tree
from eagle.decode.cache import keep_cache_entries
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.decode.tree import retrieval_paths, tree_mask


def test_cache_after_partial_acceptance_matches_fresh_forward(tiny_target):
    model, _ = tiny_target
    torch.manual_seed(0)
    prefix = torch.randint(5, 300, (70,))  # past Gemma3's 64-token sliding window
    cache = new_cache()
    out = target_forward(model, prefix, torch.arange(70), cache)
    greedy = int(out.logits[-1].argmax())
    # Root = the target's own next token; the tree's *second* branch holds the target's greedy
    # continuation for two levels, so acceptance is partial and the cache gather non-contiguous.
    seq = torch.cat([prefix, torch.tensor([greedy])])
    cont = []
    for _ in range(2):
        nxt = int(model(input_ids=seq[None]).logits[0, -1].argmax())
        cont.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    wrong = (cont[0] + 1) % 300
    #      0 (root)
    #    /    \
    #   1:wrong  2:cont0
    #   |        |  \
    #   3        4:cont1  5
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    tokens = torch.tensor([greedy, wrong, cont[0], 7, cont[1], (cont[1] + 3) % 300])
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    vout = target_forward(model, tokens, 70 + depths, cache, tree_mask(parents))
    acc = accept_tree(tokens, retrieval_paths(parents), vout.logits.argmax(-1))
    assert acc.nodes.tolist() == [0, 2, 4]
    keep_cache_entries(cache, 70, acc.nodes)
    assert cache.get_seq_length() == 73
    bonus = acc.tokens[-1]
    step = target_forward(model, torch.tensor([bonus]), torch.tensor([73]), cache)
    fresh = model(input_ids=torch.cat([prefix, tokens[acc.nodes], torch.tensor([bonus])])[None]).logits[0, -1]
    torch.testing.assert_close(step.logits[-1], fresh, atol=1e-4, rtol=1e-4)


def test_sliding_window_is_applied_to_tree_masks():
    """Gemma3 layers slide over 64 tokens: a tree verify past the window equals the plain forward,
    and dropping the window from the mask would change the result (so the test can fail)."""
    from tests.tiny_models import make_model

    model, _ = make_model("gemma3")
    seq = torch.randint(5, 300, (100,), generator=torch.Generator().manual_seed(2))
    cache = new_cache()
    target_forward(model, seq[:90], torch.arange(90), cache)
    chain = torch.ones(10, 10, dtype=torch.bool).tril()
    out = target_forward(model, seq[90:], torch.arange(90, 100), cache, chain)
    full = model(input_ids=seq[None]).logits[0, 90:]
    torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=1e-4)
    cache2 = new_cache()
    windowless = replace(verify_plan(model.config), windows={"sliding_attention": None})
    target_forward(model, seq[:90], torch.arange(90), cache2, plan=windowless)
    no_window = target_forward(model, seq[90:], torch.arange(90, 100), cache2, chain, plan=windowless)
    assert (no_window.logits - full).abs().max() > 1e-3


def test_prefill_with_last_logits_only_gives_the_last_row_and_the_same_cache(tiny_target):
    model, _ = tiny_target
    ids = torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(1))
    full_cache, last_cache = new_cache(), new_cache()
    full = target_forward(model, ids, torch.arange(40), full_cache, feature_layer_ids=[1, -1])
    last = target_forward(model, ids, torch.arange(40), last_cache, feature_layer_ids=[1, -1], last_logits_only=True)
    assert last.logits.shape == (1, full.logits.shape[-1])
    torch.testing.assert_close(last.logits[0], full.logits[-1])
    torch.testing.assert_close(last.features, full.features)  # features stay per position
    nxt = torch.tensor([7])
    a = target_forward(model, nxt, torch.tensor([40]), full_cache).logits
    b = target_forward(model, nxt, torch.tensor([40]), last_cache).logits
    torch.testing.assert_close(a, b)
