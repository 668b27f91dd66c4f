"""What the export tests (tests/test_export.py, tests/test_export_matrix.py) share: the tensor names a
Llama-style draft layer is stored under, and a head's logits on random inputs (compared before and after
a round trip through a folder)."""

from __future__ import annotations

import torch

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
E3_LAYER = LAYER + ["input_layernorm.weight", "hidden_norm.weight"]  # EAGLE-3's fused-input layer
E3_TOP = frozenset({"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"})


def head_outputs(head, seed: int = 0, t: int = 6, steps: int = 1) -> torch.Tensor:
    """[2, t, V_draft] logits of `head` on random tokens and features; with steps=2 the first step's output
    is fed back as the hidden state of a second (where EAGLE-3.1's norm_output acts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.config.vocab_size, (2, t), generator=g)  # [B, T]
    feats = torch.randn(2, t, len(head.feature_layer_ids()), head.config.target_hidden_size, generator=g)
    pos = torch.arange(1, t + 1).expand(2, t)
    with torch.no_grad():
        h = head.project_features(feats)
        for step in range(steps - 1):
            h = head(ids, h, pos + step)  # [B, T, H]
        return head.logits(head(ids, h, pos + steps - 1))
