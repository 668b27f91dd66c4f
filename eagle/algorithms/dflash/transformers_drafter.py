"""A DFlash head as transformers' own DFlash drafter (`format=transformers`).

transformers (5.24) decodes DFlash drafts itself: `target.generate(..., assistant_model=drafter,
speculation_type="dflash")` (`generation/candidate_generator.py: DFlashTokenCandidateGenerator`). The one
drafter class it ships, `MuseGlimmerAssistantModel` (`models/muse_glimmer_assistant`, model_type
`muse_glimmer_assistant`, in the AutoModel mapping), computes what `DFlashHead` does:

| ours (`DFlashHead`)                          | transformers (`MuseGlimmerAssistantModel`)                |
|----------------------------------------------|-----------------------------------------------------------|
| fc, hidden_norm over the aux layers' concat  | encoder.fc, encoder.output_norm_enc over target_layer_ids |
| layers.N: Qwen3 attention (q/k norms, RoPE), | layers.N: the same; keys/values over [context | block],   |
|   keys/values over [context | block]         |   the block bidirectional (`create_bidirectional_mask`)   |
| norm, then the target's LM head              | norm; the generator applies the target's output embedding |
| aux id i = output_hidden_states[i]           | target_layer_ids j read hidden_states[j + 1]: j = i - 1   |

So the tensors only move under `encoder.` (`TENSOR_PREFIXES`), and the config is the drafter's own. Its layers
default to sliding-window attention (2048 tokens): ours attend to the whole context, so every layer is written
`full_attention`. The class has no attention biases and reads `len(target_layer_ids) * hidden_size` inputs: a
head with biases, or one narrower than its target, is refused (`REFUSALS`). No remote code: the class is
transformers' own, so the folder loads with plain `AutoModel.from_pretrained(FOLDER)`.
"""

from __future__ import annotations

from typing import Any

from eagle.heads.base import HeadConfig

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"
# Our tensor-name prefix -> the drafter's (everything else is named alike).
TENSOR_PREFIXES = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}


def stored_name(name: str) -> str:
    """Our tensor name -> the drafter's."""
    for ours, theirs in TENSOR_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def canonical_name(name: str) -> str:
    """The drafter's tensor name -> ours (other names pass through)."""
    for ours, theirs in TENSOR_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def refusals(cfg: HeadConfig) -> list[str]:
    """Head options `MuseGlimmerAssistantModel` cannot express, each naming the option and the class."""
    out = []
    if cfg.attention_bias:
        out.append(
            "attention_bias=true: transformers' MuseGlimmerAssistantModel builds q/k/v/o without biases "
            "(models/muse_glimmer_assistant, transformers 5.24)"
        )
    if cfg.target_hidden_size != cfg.hidden_size:
        out.append(
            f"target_hidden_size={cfg.target_hidden_size} != hidden_size={cfg.hidden_size}: transformers' "
            "MuseGlimmerAssistantModel reads len(target_layer_ids) * hidden_size context features"
        )
    return out


def drafter_config(cfg: HeadConfig) -> dict[str, Any]:
    """The `MuseGlimmerAssistantConfig` fields (config.json) of a DFlash head."""
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": dict(cfg.rope_parameters),
        # The class defaults to sliding windows of 2048 tokens; a DFlash head reads its whole context.
        "layer_types": ["full_attention"] * cfg.num_layers,
        "attention_dropout": 0.0,
        # The class's defaults name another vocabulary's special tokens; the drafter needs none.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],  # layer outputs: hidden_states[j + 1]
    }
