"""What the block drafters' test modules (tests/test_dflash.py, tests/test_peagle.py) check alike: the loss
batch, greedy decoding identical to HF `generate` on every tiny family, oracle heads whose long accepted
runs must stay identical, an exported head decoding as the original, and a trained head that lowers its
loss and decodes losslessly. Each module keeps what is its algorithm's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle.capture.features import extract_features
from eagle.decode.generator import SpeculativeGenerator
from eagle.train.trainer import train
from tests.support.decode import decode_cfg, hf_greedy, oracle_table, prompt_ids
from tests.support.train import Workspace
from tests.tiny_models import make_model


def loss_batch(model, head, t: int = 16, seed: int = 2) -> dict[str, Any]:
    """Two sequences of `t` random tokens with their target features: the second padded from 12, loss
    tokens from 5."""
    ids = torch.randint(0, model.config.vocab_size - 1, (2, t), generator=torch.Generator().manual_seed(seed))
    attn = torch.ones(2, t, dtype=torch.long)
    attn[1, 12:] = 0
    loss_mask = torch.zeros(2, t, dtype=torch.bool)
    loss_mask[:, 5:] = True
    loss_mask &= attn.bool()
    feats = {k: v.clone() for k, v in extract_features(model, ids, attn, head.feature_layer_ids()).items()}
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, **feats}


def assert_greedy_is_the_targets_own(family: str, make_head) -> None:
    """`make_head(model)`'s greedy output equals HF `generate`'s on `family`, chain, tree and auto."""
    model, tok = make_model(family)
    model.eval()
    head = make_head(model)
    ids = prompt_ids(tok, "Write a short poem about the sea.")
    ref = hf_greedy(model, ids, 24)
    for kw in ({"tree_top_k": 1}, {}, {"tree": "auto"}):
        res = SpeculativeGenerator(model, head, tok, decode_cfg(draft_dtype="float32", **kw)).generate(ids)
        assert res.tokens == ref, kw


class OracleDrafts:
    """Mixin (before the head class) for a head whose output at position p drafts reference[p + OFFSET], wrong
    where that index % 5 == 3 and at rank 1 where it % 7 == 2 (`oracle_table`): long accepted runs, accepted
    second branches and rejections all occur. The head's own forward still runs, so its cache serves."""

    OFFSET = 0
    config: Any

    def setup(self, reference: list[int]):
        self.table = oracle_table(reference, self.config.vocab_size)
        return self

    def forward(self, input_ids, hidden, position_ids, attention_mask=None, past_key_values=None):
        super().forward(input_ids, hidden, position_ids, attention_mask, past_key_values)  # the head: its cache serves
        out = torch.zeros(*input_ids.shape, self.config.hidden_size)
        out[..., 0] = position_ids.float() + self.OFFSET  # the position whose token this output drafts
        return out

    def logits(self, hidden):
        return self.table[hidden[..., 0].long().clamp(0, self.table.shape[0] - 1)]


def assert_long_runs_stay_identical(model, tok, oracle_cls, base) -> list[Any]:
    """An `oracle_cls` head with `base`'s weights decodes 40 tokens identical to HF `generate`, chain and a
    two-branch tree, with runs of 4 or more accepted; the two results, for the caller's own checks."""
    ids = prompt_ids(tok, "Explain the theory of relativity.")
    ref = hf_greedy(model, ids, 40)
    oracle = oracle_cls(base.config)
    oracle.load_state_dict(base.state_dict())
    oracle.attach_target(model)
    oracle.setup(ids + ref)
    results = []
    for kw in ({"tree_top_k": 1}, {"tree_top_k": 2, "tree_total_tokens": 16}):
        res = SpeculativeGenerator(
            model, oracle, tok, decode_cfg(draft_dtype="float32", max_new_tokens=40, **kw)
        ).generate(ids)
        assert res.tokens == ref, kw
        assert max(res.accept_lengths) >= 4 and 1 + sum(res.accept_lengths) == len(ref)  # + the prefill's token
        results.append(res)
    return results


def assert_decodes_the_same(model, tok, head, loaded) -> None:
    """`loaded` (an exported `head` read back) drafts exactly as `head`: same tokens, same accepted lengths."""
    ids = prompt_ids(tok, "Numbers 0 1 2 3")
    cfg = decode_cfg(draft_dtype="float32")
    a = SpeculativeGenerator(model, head, tok, cfg).generate(ids)
    b = SpeculativeGenerator(model, loaded, tok, cfg).generate(ids)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths


def assert_training_works(ws: Workspace, tmp_path: Path, online: bool, algorithm: str, block: int, **options) -> None:
    """8 trainer steps (lk_hybrid loss, 8 anchors a sequence, `options` on top) lower the held-out loss, and
    the head decodes losslessly; offline, eagle-eval too (greedy identical, the report names the algorithm
    and its block of `block`)."""
    cfg = ws.cfg(
        tmp_path / "out", online=online, steps=8, train__anchors_per_sequence=8, train__loss="lk_hybrid", **options
    )
    result = train(cfg)
    assert result.eval_metrics["loss"] < result.initial_eval_metrics["loss"]
    ws.check_trained_head(tmp_path / "out", algorithm, block, None if online else tmp_path / "report")
