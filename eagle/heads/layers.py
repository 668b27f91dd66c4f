"""The building blocks of every draft head: one Llama-shaped decoder layer, RMSNorm and RoPE.

Everything is sized by `HeadConfig`, so a head for any target family is the same code with other
numbers. Parameter names follow Llama (`self_attn.q_proj`, `mlp.gate_proj`, ...) because the
exporter maps them 1:1 onto vLLM / SGLang draft models.

Attention masks follow `eagle.heads.base`: boolean, True = may attend, [B, 1, T_query, T_key];
None = causal over (cache + new tokens). Training-time test passes an `UnrolledChainMask` instead: the
same attention, computed without the mostly-empty key blocks its dense mask would describe.

Drafting runs this layer on 1-16 tokens a few times per decoding step, where the cost is the number of
torch ops and their Python calls, not arithmetic. Hence RoPE from a cached cos/sin table, torch's fused
RMSNorm, GQA inside SDPA (no repeated keys), and `fuse_for_inference`, which gives a decoding copy one
q/k/v and one gate/up product. Training runs the same code, unfused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eagle.heads.base import HeadConfig


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the concatenation of `linears`' outputs (same input).

    Each output row keeps its own weights, so the products are those of the parts; at batch 1 one
    call instead of three also reads the input and starts the kernel once.
    """
    first = linears[0]
    bias = first.bias is not None
    if any((lin.bias is not None) != bias or lin.in_features != first.in_features for lin in linears):
        raise ValueError("fuse_linears needs linears of one input width, all with or all without bias")
    fused = nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=bias,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))  # [sum N, K]
        if bias:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return fused.requires_grad_(first.weight.requires_grad)


def _all_linear(*modules: nn.Module) -> bool:
    """Plain `nn.Linear`s only: a head already quantised (`eagle.heads.quantize`) stays as it is."""
    return all(type(m) is nn.Linear for m in modules)


def fuse_for_inference(module: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up projections of every layer in `module`, in place; returns it.

    For decoding copies of a head (`SpeculativeGenerator`): the fused model computes the same
    function, but its state dict no longer has the per-projection names the exporter writes.
    """
    for m in module.modules():
        if isinstance(m, (Attention, MLP)):
            m.fuse_projections()
    return module


def inference_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A fused copy of `module` in `dtype` for decoding; the original keeps its dtype and export names."""
    return fuse_for_inference(copy.deepcopy(module).to(dtype))


class RMSNorm(nn.Module):
    """Llama RMSNorm: x / rms(x) * weight, computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused op computes x * rsqrt(mean(x^2) + eps) in one call (drafting runs a few
        # hundred tiny ops per step, so the op count is most of its cost).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _rope_config(cfg: HeadConfig) -> Any:
    """A transformers config carrying just what the RoPE init functions read."""
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
        num_hidden_layers=1,
        vocab_size=8,
    )


def rope_inv_freq(cfg: HeadConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2 or fewer], attention scaling) for the head's RoPE.

    Scaled variants (llama3, yarn, linear, ...) come from transformers' own init functions so the
    head rotates exactly like the target it drafts for.
    """
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = float(cfg.rope_parameters.get("rope_theta", 10000.0))
        dim = cfg.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported by this transformers version")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_rope_config(cfg), None)
    return inv_freq.float(), float(scaling)


def uses_mrope(cfg: HeadConfig) -> bool:
    """Whether the head rotates with M-RoPE rows (its RoPE parameters carry a target's `mrope_section`)."""
    return bool(cfg.rope_parameters.get("mrope_section"))


def mrope_rows(cfg: HeadConfig) -> torch.Tensor | None:
    """[D'] long: which M-RoPE row (0 time, 1 height, 2 width) rotates each of the D' rotary dimensions,
    or None for a head without M-RoPE (no `mrope_section` in its RoPE parameters).

    A vision-language target (Qwen2-VL / 2.5-VL / 3-VL) gives every token three positions and rotates
    each frequency by one of them. `mrope_section` [s_t, s_h, s_w] counts the frequencies per row:
    contiguous (Qwen2/2.5-VL: the first s_t frequencies time, the next s_h height, the rest width) or,
    with `mrope_interleaved` (Qwen3-VL), height on frequencies 1, 4, 7, ... (< 3 s_h), width on 2, 5,
    8, ... (< 3 s_w), time on the rest: transformers' `recomposition_frequencies` and vLLM's
    `MRotaryEmbedding`, which rotate the draft with the same rule (tested against both layouts).
    """
    if not uses_mrope(cfg):
        return None
    section = cfg.rope_parameters["mrope_section"]
    half = len(rope_inv_freq(cfg)[0])  # frequencies
    s_t, s_h, s_w = (int(x) for x in section)
    j = torch.arange(half)
    if cfg.rope_parameters.get("mrope_interleaved"):
        rows = torch.zeros(half, dtype=torch.long)
        rows[(j % 3 == 1) & (j < 3 * s_h)] = 1
        rows[(j % 3 == 2) & (j < 3 * s_w)] = 2
    else:
        if s_t + s_h + s_w != half:
            raise ValueError(f"mrope_section={list(section)} does not add up to the {half} rotary frequencies")
        rows = (j >= s_t).long() + (j >= s_t + s_h).long()
    return torch.cat([rows, rows])  # the cos / sin layout repeats the frequencies (half-split)


class RotaryEmbedding(nn.Module):
    """position ids [B, T] -> (cos, sin) [B, T, head_dim]; half-split (Llama) layout.

    A vision-language target numbers its tokens with three rows (M-RoPE: [3, B, T], time, height,
    width; equal on text). A head with M-RoPE (`mrope_rows`) rotates each dimension by its row; a head
    without reads the time row, which is what vLLM gives a 1-D draft of an M-RoPE target
    (`_set_positions`: `positions[0]`). [B, T] ids on an M-RoPE head mean three equal rows, where
    M-RoPE is plain RoPE.

    cos / sin come from a table over positions 0 .. n - 1 (per dtype and device, grown to the next
    power of two when a larger position shows up), so a call is one lookup instead of a dozen
    elementwise ops; the table holds exactly what the direct computation gives (float32 angles,
    then cast). The inverse frequencies come from the config, never from a cast buffer: a head
    moved to bf16 rotates with the float32 frequencies it was trained with.
    """

    MIN_TABLE = 256

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: never in a checkpoint, never cast by `.to(dtype)`.
        self.inv_freq, self.attention_scaling = rope_inv_freq(cfg)  # [D / 2] float32
        self.rows = mrope_rows(cfg)  # [D] M-RoPE row of each dimension, None = 1-D RoPE
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # [n, 2, D] cos, sin

    def table(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[n' >= n, 2, D]: cos and sin of positions 0 .. n' - 1 in `dtype`."""
        key = (dtype, device)
        cached = self._tables.get(key)
        if cached is None or cached.shape[0] < n:
            size = max(self.MIN_TABLE, 1 << (n - 1).bit_length())
            freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)
            emb = torch.cat((freqs, freqs), dim=-1)  # [n', D]
            cached = torch.stack((emb.cos(), emb.sin()), dim=1) * self.attention_scaling  # [n', 2, D]
            cached = self._tables[key] = cached.to(dtype)
        return cached

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] or M-RoPE rows [3, B, T] -> (cos, sin) [B, T, D]."""
        if position_ids.dim() == 3 and self.rows is None:
            position_ids = position_ids[0]  # [B, T] the time row
        table = self.table(int(position_ids.max()) + 1, dtype, position_ids.device)
        cos_sin = table[position_ids]  # [B, T, 2, D] or [3, B, T, 2, D]
        if position_ids.dim() == 3:
            assert self.rows is not None
            rows = self.rows.to(position_ids.device).expand(1, *cos_sin.shape[1:])  # [1, B, T, 2, D]
            cos_sin = cos_sin.gather(0, rows)[0]  # [B, T, 2, D]: dimension d from row rows[d]
        return cos_sin[..., 0, :], cos_sin[..., 1, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D'] with D' <= D (partial rotary rotates the first D')."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D']
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def causal_mask(q_len: int, past_len: int, device: torch.device) -> torch.Tensor:
    """Bool [1, 1, q_len, past_len + q_len]: query q sees keys up to its own position past_len + q."""
    k_idx = torch.arange(past_len + q_len, device=device)
    q_idx = torch.arange(q_len, device=device) + past_len
    return (k_idx[None, :] <= q_idx[:, None])[None, None]


@dataclass(frozen=True)
class UnrolledChainMask:
    """Attention of training-time-test step `depth` (`eagle.algorithms.ttt`), kept structured.

    The cache holds (depth + 1) x T keys, [step 0 | step 1 | ... | step depth]. Query t may attend
    the step-0 keys that `prefix` allows and, of each later step's T keys, only key t (its own
    draft chain). As a dense mask that is [B, 1, T, (depth + 1) T] with all but T + depth entries
    of a row False, and attention over it costs (depth + 1)x a step-0 pass; `chain_attention`
    computes the prefix block as one [T, T] product and the chain keys as `depth` dot products.
    """

    prefix: torch.Tensor  # bool [B, 1, T, T]: step-0 keys each query may attend
    depth: int  # chain keys per query after the prefix block

    def dense(self) -> torch.Tensor:
        """The same mask as a dense bool [B, 1, T, (depth + 1) T] (the definition)."""
        t = self.prefix.shape[-1]
        eye = torch.eye(t, dtype=torch.bool, device=self.prefix.device).expand_as(self.prefix)
        return torch.cat([self.prefix] + [eye] * self.depth, dim=-1)


def chain_attention(
    q: torch.Tensor,  # [B, nh, T, D]
    k: torch.Tensor,  # [B, nkv, (depth + 1) T, D]
    v: torch.Tensor,  # [B, nkv, (depth + 1) T, D]
    mask: UnrolledChainMask,
) -> torch.Tensor:
    """Softmax attention under `mask`, equal to SDPA with `mask.dense()`; returns [B, nh, T, D].

    GQA query heads are grouped onto their kv head instead of copying keys. Scores are softmaxed in
    float32 (as SDPA accumulates), so bf16 autocast gives the same result as the dense path.
    """
    b, nh, t, d = q.shape
    nkv, depth = k.shape[1], mask.depth
    if k.shape[-2] != (depth + 1) * t:
        raise ValueError(f"UnrolledChainMask of depth {depth} needs {(depth + 1) * t} keys, got {k.shape[-2]}")
    scale = d**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax dtype: float32, or float64 when given
    qg = q.reshape(b, nkv, nh // nkv, t, d)  # [B, nkv, rep, T, D]
    k0, v0 = k[:, :, None, :t], v[:, :, None, :t]  # [B, nkv, 1, T, D] step-0 keys
    prefix = mask.prefix.to(torch.bool)
    prefix = (prefix | ~prefix.any(-1, keepdim=True))[:, :, None]  # [B, 1, 1, T, T]; never an empty row
    scores = (qg @ k0.transpose(-1, -2)).to(acc) * scale  # [B, nkv, rep, T, T]
    scores = scores.masked_fill(~prefix, float("-inf"))
    if depth:
        kc = k[:, :, t:].reshape(b, nkv, depth, t, d)  # [B, nkv, depth, T, D] chain keys
        chain = torch.einsum("bgrtd,bgjtd->bgrtj", qg, kc).to(acc) * scale  # [B, nkv, rep, T, depth]
        scores = torch.cat((scores, chain), dim=-1)  # [B, nkv, rep, T, T + depth]
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    out = p[..., :t] @ v0  # [B, nkv, rep, T, D]
    if depth:
        vc = v[:, :, t:].reshape(b, nkv, depth, t, d)
        out = out + torch.einsum("bgrtj,bgjtd->bgrtd", p[..., t:], vc)
    return out.reshape(b, nh, t, d)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and an optional `transformers.Cache`.

    `in_features` is the width of the attention input (2H for EAGLE-3, whose q/k/v read the
    concatenation of the token embedding and the hidden state).
    """

    def __init__(self, cfg: HeadConfig, in_features: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections (inference copies only)
        self._qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, Din] -> q [B, T, nh * D], k and v [B, T, nkv * D] (one product once fused)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.qkv_proj(x).split(self._qkv_sizes, dim=-1)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one linear over their stacked rows (`fuse_for_inference`)."""
        if self.qkv_proj is None and _all_linear(self.q_proj, self.k_proj, self.v_proj):
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [B, T, Din]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        attention_mask: torch.Tensor | UnrolledChainMask | None = None,  # bool [B, 1, T, T_past + T]
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, D]
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, D]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past_len = 0
        if past_key_values is not None:
            past_len = past_key_values.get_seq_length(0)
            k, v = past_key_values.update(k, v, 0)  # [B, nkv, T_past + T, D]
        if isinstance(attention_mask, UnrolledChainMask):
            out = chain_attention(q, k, v, attention_mask)  # [B, nh, T, D]
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        is_causal = False
        if attention_mask is None:
            # No cache: SDPA's built-in causal path; with a cache the queries sit after past_len keys.
            mask, is_causal = (None, t > 1) if past_len == 0 else (causal_mask(t, past_len, x.device), False)
        else:
            mask = attention_mask.to(torch.bool)
            if mask.shape[-1] != k.shape[-2] or mask.shape[-2] != t:
                raise ValueError(f"attention_mask {tuple(mask.shape)} does not fit {t} queries x {k.shape[-2]} keys")
            # A query that may attend nothing (padding) would give NaN; let it see everything
            # instead: its output is masked out of every loss, and NaN would leak into gradients.
            mask = mask | ~mask.any(-1, keepdim=True)
        # GQA: each kv head serves num_heads / num_kv_heads query heads, without copying the keys.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, nh, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ACT2FN[cfg.hidden_act]
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections (inference copies only)

    def fuse_projections(self) -> None:
        """Replace gate/up_proj by one linear over their stacked rows (`fuse_for_inference`)."""
        if self.gate_up_proj is None and _all_linear(self.gate_proj, self.up_proj):
            self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    """One Llama-shaped decoder layer, in the two shapes draft heads use.

    fused_input=True (EAGLE-3): attention reads cat(input_layernorm(embeds), hidden_norm(hidden))
    [B, T, 2H]; the residual is `hidden`.
    fused_input=False (EAGLE-1): attention reads `hidden` itself, with no input norm (the fc
    output feeds the layer directly, as in vLLM's EagleLlamaForCausalLM).
    """

    def __init__(self, cfg: HeadConfig, fused_input: bool) -> None:
        super().__init__()
        self.fused_input = fused_input
        if fused_input:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        in_features = 2 * cfg.hidden_size if fused_input else cfg.hidden_size
        self.self_attn = Attention(cfg, in_features)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        embeds: torch.Tensor | None = None,  # [B, T, H], fused_input only
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        residual = hidden
        if self.fused_input:
            if embeds is None:
                raise ValueError("a fused-input layer needs the token embeddings")
            x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        else:
            x = hidden
        h = residual + self.self_attn(x, cos, sin, attention_mask, past_key_values)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]
