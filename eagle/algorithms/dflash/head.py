"""DFlash draft head (block diffusion drafter, arXiv 2602.06036): one pass drafts a whole block.

    ctx     = hidden_norm(fc(cat(f_a1, ..., f_ak)))        [B, S, k*Ht] -> [B, S, H]  (fused target context)
    block   = embed([x_anchor, MASK, ..., MASK])           [B, Q, H]  (Q = block_size per anchor)
    layer l: q  = q_norm(q_proj(input_layernorm(block)))   the block's queries
             kv = [k/v_proj(ctx) | k/v_proj(input_layernorm(block))]   context keys, then the block's own
             block = block + o_proj(attn(q, kv)) ; block = block + mlp(post_attention_layernorm(block))
    logits  = target_lm_head(norm(block))                  [B, Q, V]  (the target's own LM head, full vocabulary)

The context is injected as keys and values into every layer, computed by that layer's own k/v
projections (and k_norm, and RoPE at the context tokens' positions), so at decode time each layer's
context keys are cached once per committed token (`DFlashContextCache`). The block attends to the
whole context and to itself without a causal mask: position j of the block predicts the token at
the anchor's position + j for every j >= 1 at once. Layers are Qwen3-shaped (per-head RMSNorm on q
and k) whatever the target family, as the reference drafter and the engines that serve it build them.

Alignment (`eagle.heads.base`): f_t is the target's state after reading x_0..x_t. An anchor at
position a is a token whose own feature is not known yet (at decode time: the token the target just
emitted), so its block reads the context f_0..f_{a-1} and drafts x_{a+1}..x_{a+Q-1}.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from eagle.algorithms.dflash.drafting import block_log_probs
from eagle.config import DraftConfig
from eagle.heads.base import BorrowedModules, BorrowsTargetOutput, DraftHead, HeadConfig
from eagle.heads.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope


class DFlashContextCache:
    """Per layer, the context keys and values [1, nkv, S, D] of the committed tokens (decode time).

    Only the context is cached: the block's own keys change every step and are never kept."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[-2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat((old_k, k), dim=-2)
        self.values[layer] = v if old_v is None else torch.cat((old_v, v), dim=-2)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        if k is None or v is None:
            raise RuntimeError("the DFlash context cache is empty: commit the prompt's features first")
        return k, v


class DFlashAttention(nn.Module):
    """Block queries over [context keys | block keys], GQA, Qwen3's per-head q/k RMSNorm, RoPE."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, H] (context or block) -> k, v [B, nkv, S, D], k normed and rotated."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] the block (after input_layernorm)
        cos: torch.Tensor,  # [B, Q, D] at the block's positions
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],  # [B, nkv, S, D] each
        attention_mask: torch.Tensor | None,  # bool [B, 1, Q, S + Q]; None: everything
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, nh, Q, D]
        k_blk, v_blk = self.keys_values(x, cos, sin)  # [B, nkv, Q, D]
        k = torch.cat((context_kv[0].expand(b, -1, -1, -1), k_blk), dim=-2)  # [B, nkv, S + Q, D]
        v = torch.cat((context_kv[1].expand(b, -1, -1, -1), v_blk), dim=-2)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)
            if mask.shape[-1] != k.shape[-2] or mask.shape[-2] != q_len:
                raise ValueError(
                    f"attention_mask {tuple(mask.shape)} does not fit {q_len} queries x {k.shape[-2]} keys"
                )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, nh, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    """One Qwen3-shaped draft layer whose attention also reads the fused target context."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        block: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = block + self.self_attn(self.input_layernorm(block), cos, sin, context_kv, attention_mask)  # [B, Q, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(BorrowsTargetOutput, DraftHead):
    """The DFlash head; token embeddings and LM head borrowed from the target, sizes from `HeadConfig`
    (`num_layers` draft layers, `block_size` tokens a pass, `mask_token_id` filling the block)."""

    algorithm: ClassVar[str] = "dflash"
    num_aux_layers: ClassVar[int] = 3
    drafts_block: ClassVar[bool] = True

    @classmethod
    def block_fields(cls, draft: DraftConfig) -> dict[str, int]:
        return {"block_size": int(draft.block_size), "num_layers": int(draft.num_layers)}

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError("DFlash drafts with the target's own LM head (draft_vocab_size must equal vocab_size)")
        if config.block_size < 2 or config.num_layers < 1:
            raise ValueError(
                f"DFlash needs block_size >= 2 and num_layers >= 1, got {config.block_size} and {config.num_layers}"
            )
        h, k = config.hidden_size, len(config.aux_layer_ids)
        self.fc = nn.Linear(k * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self._borrowed = BorrowedModules()  # the target's embeddings and LM head: never trained, never saved

    # --- target-owned pieces (attach_target: `BorrowsTargetOutput`) ---------------------------
    def feature_layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    # --- the steps -----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.borrowed("embed_tokens")(input_ids).to(self.fc.weight.dtype)  # [B, Q, H]

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        b, s, k, ht = features.shape  # [B, S, k, Ht]
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype).reshape(b, s, k * ht)))  # [B, S, H]

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values [B, nkv, S, D] of the fused context [B, S, H] at `positions` [B, S]."""
        cos, sin = self.rotary_emb(positions, context.dtype)
        layers = cast("list[DFlashLayer]", list(self.layers))  # __init__ fills it with DFlashLayer only
        return [layer.self_attn.keys_values(context, cos, sin) for layer in layers]

    # --- decoding (`DraftHead`): the cache holds the context only; a block is never cached ------
    def new_draft_cache(self) -> DFlashContextCache:
        return DFlashContextCache(len(self.layers))

    def commit(
        self, cache: DFlashContextCache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append committed target features [S, k, Ht] at `positions` [S] to the context (the tokens
        after them are not read: a block starts from its own anchor)."""
        context = self.project_features(features[None])  # [1, S, H]
        for i, (k, v) in enumerate(self.context_kv(context, positions[None])):
            cache.append(i, k, v)
        return None

    def draft_block(
        self, cache: DFlashContextCache, root_token: int, root_hidden: torch.Tensor | None, root_position: int
    ) -> torch.Tensor:
        return block_log_probs(self, cache, root_token, root_position)  # [Q - 1, V]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q] block tokens (anchor, then mask tokens)
        hidden: torch.Tensor | None,  # unused: a block has no hidden input (the EAGLE signature's slot)
        position_ids: torch.Tensor,  # [B, Q]
        attention_mask: torch.Tensor | None = None,  # bool [B, 1, Q, S + Q]; None: the whole context and block
        past_key_values: Any | None = None,  # DFlashContextCache, or a list of per-layer (k, v) [B, nkv, S, D]
    ) -> torch.Tensor:
        """The block's output states [B, Q, H] (before the final norm)."""
        if past_key_values is None:
            raise ValueError("a DFlash block needs the context's keys and values (past_key_values)")
        block = self.embed(input_ids)  # [B, Q, H]
        cos, sin = self.rotary_emb(position_ids, block.dtype)
        for i, layer in enumerate(self.layers):
            kv = past_key_values.layer(i) if isinstance(past_key_values, DFlashContextCache) else past_key_values[i]
            block = layer(block, cos, sin, kv, attention_mask)
        return block

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.borrowed("lm_head")
        return lm_head(self.norm(hidden).to(lm_head.weight.dtype))  # [B, Q, V]
