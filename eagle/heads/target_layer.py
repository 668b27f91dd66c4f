"""Start a draft head's decoder layer from one of the target's decoder layers
(`train.init_layer_from_target`).

A fresh head's decoder layer is random; on a few hundred CPU-minutes of data it spends much of its
budget learning what the target's own layers already compute on the same residual stream. Copying
a target layer gives it that function to start from (the draft layer has the target's widths).

What is copied, by parameter name (Llama naming, which the draft layer uses), so no family needs
code of its own:
  self_attn.{q,k,v,o}_proj  weights (and biases). A fused-input layer (EAGLE-3) reads
                            cat(embeds, hidden) [2H]: the target's q/k/v go into the hidden half of
                            the input columns; the embedding half keeps its fresh init.
  mlp.{gate,up,down}_proj   weights.
  norms                     as their *effective* gains, `norm(ones)` (so Gemma's 1 + w and Llama's w
                            both come out right): the target's input_layernorm -> the norm in front
                            of the hidden (EAGLE-3 `hidden_norm`; EAGLE-1 has none), the norm in
                            front of the MLP (`pre_feedforward_layernorm` where the family has one,
                            else `post_attention_layernorm`) -> the draft's post_attention_layernorm.
Target parameters the draft layer has no place for (per-head q/k norms, Gemma's post-norms) are
left out and named in a log line: the copy is a starting point, not the target's exact function.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from eagle.config import ConfigError
from eagle.heads.layers import DecoderLayer, RMSNorm
from eagle.target.structure import decoder_layer_stacks, text_config

log = logging.getLogger(__name__)

_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_FUSED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # read cat(embeds, hidden)


def target_decoder_layers(target_model: nn.Module) -> nn.ModuleList:
    """The target's stack of decoder layers: the ModuleList as long as `config.num_hidden_layers`."""
    stacks = decoder_layer_stacks(target_model)
    if len(stacks) != 1:
        n = text_config(target_model.config).num_hidden_layers
        raise ConfigError(
            f"train.init_layer_from_target: found {len(stacks)} module lists of "
            f"{n} layers in {type(target_model).__name__}, expected exactly one; "
            "drop the option for this target"
        )
    return stacks[0]


def pick_target_layer(target_model: nn.Module, index: int) -> tuple[int, nn.Module]:
    """(non-negative index, layer) for `index` in [-L, L) (negative counts from the last layer)."""
    layers = target_decoder_layers(target_model)
    n = len(layers)
    if not -n <= index < n:
        raise ConfigError(
            f"train.init_layer_from_target={index} is outside the target's {n} decoder "
            f"layers: use 0..{n - 1}, or -1 for the last"
        )
    return index % n, layers[index]


def effective_gain(norm: nn.Module, width: int, like: torch.Tensor) -> torch.Tensor:
    """[H] what the norm multiplies a unit-RMS input by (RMS(ones) = 1)."""
    p = next(norm.parameters(), like)
    with torch.no_grad():
        return norm(torch.ones(1, width, dtype=p.dtype, device=p.device))[0].to(like)


def target_final_norm(target_model: object) -> nn.Module | None:
    """The norm in front of the target's LM head (`norm`, Llama naming; `final_layernorm` /
    `final_norm` elsewhere) of its decoder stack, or None where the family has none of these."""
    get_decoder = getattr(target_model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    for owner in (decoder, getattr(target_model, "model", None), target_model):
        for name in ("norm", "final_layernorm", "final_norm"):
            module = getattr(owner, name, None)
            if isinstance(module, nn.Module) and next(module.parameters(), None) is not None:
                return module
    return None


def copy_target_layer(draft: DecoderLayer, target_layer: nn.Module) -> list[str]:
    """Copy `target_layer` into `draft` as the module docstring says; returns the target parameter
    names left out. Raises ConfigError naming what the draft layer needs and the target lacks."""
    source = dict(target_layer.named_parameters())
    own = dict(draft.named_parameters())
    missing = [f"{name}.weight" for name in _PROJECTIONS if f"{name}.weight" not in source]
    if missing:
        raise ConfigError(
            f"train.init_layer_from_target: the target layer ({type(target_layer).__name__}) "
            f"has no {', '.join(missing)}; it is not a Llama-style decoder layer, so drop the "
            "option for this target"
        )
    used: set[str] = set()
    with torch.no_grad():
        for name in _PROJECTIONS:
            for kind in ("weight", "bias"):
                key = f"{name}.{kind}"
                if key not in own or key not in source:
                    continue
                dst: torch.Tensor = own[key]  # a view of the Parameter for the fused half: copied in place
                src = source[key].to(dst)
                if draft.fused_input and name in _FUSED and kind == "weight":
                    dst = dst[:, dst.shape[1] - src.shape[1] :]  # [out, H] hidden half of [out, 2H]
                if dst.shape != src.shape:
                    raise ConfigError(
                        f"train.init_layer_from_target: {key} is {tuple(src.shape)} in the target "
                        f"and {tuple(dst.shape)} in the draft layer (draft.intermediate_size "
                        "must be null to copy the MLP)"
                    )
                dst.copy_(src)
                used.add(key)
        modules = dict(target_layer.named_children())
        width = draft.post_attention_layernorm.weight.shape[0]
        mlp_norm_name = next(
            (n for n in ("pre_feedforward_layernorm", "post_attention_layernorm") if n in modules), None
        )
        pairs: list[tuple[str | None, RMSNorm]] = [(mlp_norm_name, draft.post_attention_layernorm)]
        if draft.fused_input:
            pairs.append(("input_layernorm", draft.hidden_norm))
        for norm_name, dst_norm in pairs:
            if norm_name is None or norm_name not in modules:
                continue
            dst_norm.weight.copy_(effective_gain(modules[norm_name], width, dst_norm.weight))
            used.update(f"{norm_name}.{p}" for p, _ in modules[norm_name].named_parameters())
    left = sorted(set(source) - used)
    if left:
        log.info(
            "train.init_layer_from_target: left out target parameters the draft layer has no place for: %s",
            ", ".join(left),
        )
    return left
