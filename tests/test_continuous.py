"""Continuous batching (eagle.decode.continuous) against HF: attention maths, greedy answers, seeds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle.config import RegenerateConfig
from eagle.data.template import end_of_turn_ids
from eagle.decode.continuous import (
    ContinuousGenerator,
    Job,
    Sampling,
    SlotBatch,
    SlotKV,
    slot_attention,
    slot_attention_enabled,
)
from eagle.errors import TargetError
from eagle.regenerate.job import ConversationJob
from eagle.regenerate.local import regenerate_batch
from tests.support.data import CONVS
from tests.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PromptJob(Job):
    """One prompt, one answer."""

    def __init__(self, id: str, prompt: list[int]) -> None:
        self.id, self.prompt, self.answer, self.asked = id, prompt, None, False

    def next_prompt(self) -> list[int] | None:
        if self.asked:
            return None
        self.asked = True
        return self.prompt

    def finish_answer(self, tokens: list[int]) -> None:
        self.answer = tokens


class _Module(torch.nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def test_slot_attention_equals_sdpa_per_row_over_a_stale_buffer():
    """Rows at different lengths in one call; the unwritten / stale part of the buffer holds large
    garbage that must not leak through the mask (GQA: 6 query heads over 2 KV heads)."""
    torch.manual_seed(0)
    slots, h, h_kv, d, q_len = 3, 6, 2, 8, 2
    kv = SlotKV(slots, max_len=16)
    module = _Module(0)
    lengths = [5, 0, 9]  # already written per slot
    # Fill the buffers with garbage first, then the real prefixes.
    kv.keys[0] = torch.full((slots, h_kv, 16, d), 1e4)
    kv.values[0] = torch.full((slots, h_kv, 16, d), -1e4)
    history_k = [torch.randn(h_kv, n, d) for n in lengths]
    history_v = [torch.randn(h_kv, n, d) for n in lengths]
    for s, n in enumerate(lengths):
        kv.keys[0][s, :, :n] = history_k[s]
        kv.values[0][s, :, :n] = history_v[s]
    rows = [2, 0]  # a subset, out of order
    q = torch.randn(len(rows), h, q_len, d)
    k_new, v_new = torch.randn(len(rows), h_kv, q_len, d), torch.randn(len(rows), h_kv, q_len, d)
    positions = torch.tensor([[lengths[r] + i for i in range(q_len)] for r in rows])
    batch = SlotBatch(
        kv=kv,
        rows=torch.tensor(rows),
        positions=positions,
        kv_len=max(lengths[r] for r in rows) + q_len,
        all_rows=False,
    )
    out, _ = slot_attention(module, q, k_new, v_new, None, scaling=0.3, eagle_slots=batch)  # [R, Q, H, D]
    for i, r in enumerate(rows):
        keys = torch.cat([history_k[r], k_new[i]], 1).repeat_interleave(h // h_kv, 0)  # [H, n + Q, D]
        values = torch.cat([history_v[r], v_new[i]], 1).repeat_interleave(h // h_kv, 0)
        n = lengths[r]
        mask = torch.ones(q_len, n + q_len, dtype=torch.bool).tril(n)
        want = F.scaled_dot_product_attention(q[i], keys, values, attn_mask=mask, scale=0.3)  # [H, Q, D]
        torch.testing.assert_close(out[i].transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    # The new keys landed at the rows' positions, nothing else moved.
    assert torch.equal(kv.keys[0][2, :, 9:11], k_new[0]) and torch.equal(kv.keys[0][1], torch.full((h_kv, 16, d), 1e4))


def _hf_greedy(model, prompt: list[int], new: int, stops: list[int]) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=stops[0],
    )
    row = out[0, len(prompt) :].tolist()
    return row[: next((k for k, t in enumerate(row) if t in stops), len(row))]


def _prompts(tok) -> list[list[int]]:
    texts = ["hello!", "The quick brown fox jumps over the lazy dog. " * 3, "def add(a, b):", "Write a poem", "x"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_greedy_answers_equal_hf_generate(family):
    """fp32, 5 prompts of different lengths through 2 slots (slots are refilled mid-run)."""
    model, tok = make_model(family)
    stops = end_of_turn_ids(tok)
    new = 90 if family == "gemma3" else 24
    jobs = [PromptJob(str(k), p) for k, p in enumerate(_prompts(tok))]
    engine = ContinuousGenerator(model, slots=2, max_len=256, stop_ids=stops, sampling=Sampling(max_new_tokens=new))
    with slot_attention_enabled(model):
        engine.run(iter(jobs))
    assert model.config._attn_implementation == "sdpa"  # restored
    for job in jobs:
        assert job.answer == _hf_greedy(model, job.prompt, new, stops), job.id
    assert engine.generated_tokens == sum(len(j.answer) for j in jobs)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_equal_a_full_forward_past_the_sliding_window(family):
    """A 100-token prompt then 3 single-token steps, in slot 1 of 2 while slot 0 holds another
    sequence: each step's logits equal HF's forward over the whole sequence (gemma3's sliding
    window is 64, so windowed layers are exercised)."""
    model, _ = make_model(family)
    torch.manual_seed(1)
    seq = torch.randint(5, 300, (104,)).tolist()
    engine = ContinuousGenerator(model, slots=2, max_len=128, stop_ids=[0], sampling=Sampling())
    with slot_attention_enabled(model):
        engine._forward([0], [seq[:37]], [0])
        got = [engine._forward([1], [seq[:100]], [0])]
        for k in range(100, 103):
            got.append(engine._forward([0, 1], [[seq[0]], [seq[k]]], [37, k])[1:])
    for k, logits in zip(range(100, 104), got, strict=True):
        want = model(torch.tensor([seq[:k]])).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_multi_turn_conversations_match_the_generate_engine_and_reuse_the_cache(monkeypatch):
    model, tok = make_model("qwen2")
    cfg = RegenerateConfig(batch_size=2, max_new_tokens=6)
    stops = end_of_turn_ids(tok)
    want = regenerate_batch(model, tok, CONVS, cfg, stops)
    asked: list[int] = []  # prompt lengths the engine was given
    real = ConversationJob.next_prompt

    def spy(self):
        prompt = real(self)
        if prompt is not None:
            asked.append(len(prompt))
        return prompt

    monkeypatch.setattr(ConversationJob, "next_prompt", spy)
    done = []
    jobs = [ConversationJob(c, tok, cfg, done.append) for c in CONVS]
    engine = ContinuousGenerator(model, slots=2, max_len=512, stop_ids=stops, sampling=Sampling(max_new_tokens=6))
    with slot_attention_enabled(model):
        engine.run(iter(jobs))
    assert sorted(done, key=lambda r: r["id"]) == want
    assert len(asked) == 4  # "a" has two assistant turns
    # The second prompt of "a" re-used its cached history: fewer tokens were fed than all prompts
    # plus one per generated token.
    assert engine.fed_tokens < sum(asked) + engine.generated_tokens


@torch.no_grad()
def test_samples_do_not_depend_on_slots_or_neighbours():
    model, tok = make_model("llama")
    stops = end_of_turn_ids(tok)
    answers = []
    for slots, order in ((1, [0, 1, 2, 3, 4]), (3, [4, 2, 0, 1, 3])):
        prompts = _prompts(tok)
        jobs = [PromptJob(str(k), prompts[k]) for k in order]
        sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=12, seed=5)
        with slot_attention_enabled(model):
            ContinuousGenerator(model, slots, 128, stops, sampling).run(iter(jobs))
        answers.append({j.id: j.answer for j in jobs})
    assert answers[0] == answers[1]
    assert len({tuple(a) for a in answers[0].values()}) > 1


def test_attention_outside_the_engine_is_refused():
    model, tok = make_model("llama")
    with slot_attention_enabled(model), pytest.raises(TargetError, match="continuous batching"):
        model(torch.tensor([[1, 2, 3]]))
