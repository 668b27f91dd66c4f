"""Shared helpers of the decoder tests: random heads and a scripted "oracle" head.

Random heads almost never draft what a random target picks, so they only exercise the rejection path.
`OracleHead` drafts a known reference continuation, deliberately wrong at some positions and with the
right token at rank 1 at others, so that long accepted runs, accepted second branches (a
non-contiguous cache gather) and rejections all occur.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from eagle.algorithms import get_algorithm
from eagle.algorithms.head_io import build_head, head_config_from_target
from eagle.config import DecodeConfig, DraftConfig
from eagle.heads.base import DraftHead, HeadConfig


def random_head(
    target: Any, algorithm: str, draft_vocab_size: int | None = None, seed: int = 0, **options: Any
) -> DraftHead:
    """A freshly initialised head of `algorithm` attached to `target` (EAGLE-3 may use a reduced vocab;
    `options`: other DraftConfig fields, e.g. fc_norm=True)."""
    torch.manual_seed(seed)
    cfg = head_config_from_target(
        target.config, DraftConfig(algorithm=algorithm, draft_vocab_size=draft_vocab_size, **options)
    )
    counts = None
    if get_algorithm(algorithm).head_class.reduced_vocab and cfg.draft_vocab_size < cfg.vocab_size:
        counts = torch.randint(1, 100, (cfg.vocab_size,))
    return build_head(cfg, target, vocab_counts=counts).eval()


class OracleHead(DraftHead):
    """Drafts `reference[p + 1]` for an input token at position p, with scripted mistakes.

    The hidden state carries the position in channel 0, so `logits` can look the answer up. Position
    p is drafted correctly at rank 0 when p % 3 == 0 or 1 (p % 6 != 5), at rank 1 when p % 6 == 5, and
    never when p % 7 == 3. The head ignores its cache (allowed: it is still updated by nobody).
    """

    algorithm: ClassVar[str] = "oracle"

    def __init__(self, reference: list[int], vocab_size: int) -> None:
        cfg = HeadConfig(
            algorithm="eagle1",
            hidden_size=4,
            target_hidden_size=4,
            vocab_size=vocab_size,
            draft_vocab_size=vocab_size,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=4,
            intermediate_size=4,
        )
        super().__init__(cfg)
        n = len(reference) + 64
        g = torch.Generator().manual_seed(1)
        table = torch.randn(n, vocab_size, generator=g)  # [P, V] logits per input position
        for p in range(n):
            right = reference[p + 1] if p + 1 < len(reference) else None
            if right is None:
                continue
            wrong = (right + 1 + p) % vocab_size
            if p % 7 == 3:
                table[p, right] = -30.0
            elif p % 6 == 5:
                table[p, wrong], table[p, right] = 20.0, 19.0
            else:
                table[p, right] = 20.0
        self.register_buffer("table", table)
        self.dummy = nn.Parameter(torch.zeros(1))

    def attach_target(self, target: nn.Module) -> None:
        pass

    def feature_layer_ids(self) -> list[int]:
        return [-1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, 4)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*features.shape[:2], 4)  # [B, T, H]

    def forward(self, input_ids, hidden, position_ids, attention_mask=None, past_key_values=None):
        out = torch.zeros(*input_ids.shape, 4)
        out[..., 0] = position_ids.float()  # [B, T]
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = hidden[..., 0].long().clamp(0, self.table.shape[0] - 1)  # [B, T]
        return self.table[pos]  # [B, T, V]


def hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation by HF `generate` (stops at EOS like the decoder)."""
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=model.config.pad_token_id
    )
    return out[0, len(ids) :].tolist()


def prompt_ids(tok: Any, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def decode_cfg(**kw: Any) -> DecodeConfig:
    base = dict(tree="dynamic", tree_top_k=3, tree_depth=4, tree_total_tokens=10, max_new_tokens=24)
    base.update(kw)
    return DecodeConfig(**base)


def oracle_table(reference: list[int], vocab_size: int) -> torch.Tensor:
    """[len(reference) + 64, V] logits whose row p drafts reference[p]: wrong where p % 5 == 3, at rank 1
    where p % 7 == 2 (the right token second), right at rank 0 elsewhere; random below the top."""
    table = torch.randn(len(reference) + 64, vocab_size, generator=torch.Generator().manual_seed(1))
    for p, right in enumerate(reference):
        if p % 5 == 3:
            table[p, right] = -30.0
        elif p % 7 == 2:
            table[p, (right + 1) % vocab_size], table[p, right] = 20.0, 19.0
        else:
            table[p, right] = 20.0
    return table
