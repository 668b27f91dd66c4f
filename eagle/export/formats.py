"""What each export format looks like on disk: tensor names, config.json, embedding policy.

Facts checked against the loaders (vLLM `llama_eagle3.py` / `llama_eagle.py` / speculators config
handling, SGLang `llama_eagle3.py` / `llama_eagle.py`, vllm-project/speculators `Eagle3SpeculatorConfig`,
llama.cpp b11434 `convert_hf_to_gguf.py` / `src/models/eagle3.cpp`); docs/serving.md has the table of
which head option each engine serves, with the code read:

| format      | EAGLE-3 tensors                          | EAGLE-1 tensors                      | config.json                                   |
|-------------|------------------------------------------|--------------------------------------|-----------------------------------------------|
| vllm        | fc, midlayer.*, norm, lm_head, d2t, t2d  | fc.weight (no bias), layers.0.*      | Llama config, LlamaForCausalLMEagle3 /        |
|             | (vLLM renames midlayer. -> layers.0.)    |                                      | EagleLlamaForCausalLM, aux ids top-level      |
| sglang      | same as vllm (SGLang needs midlayer.*)   | fc.weight + fc.bias, layers.0.*      | Llama config, LlamaForCausalLMEagle3 /        |
|             |                                          |                                      | LlamaForCausalLMEagle, aux ids in eagle_config|
| speculators | fc, layers.0.*, norm, lm_head, d2t, t2d  | (not supported)                      | speculators_model_type=eagle3, Eagle3Speculator|
| hf          | our own names (= `save_head`)            | our own names                        | head_config.json + Llama-style config.json    |
| llamacpp    | = vllm (+ LLAMACPP.md: convert + serve)  | (not supported)                      | = vllm                                        |

Embeddings: vllm / sglang / hf folders hold no `embed_tokens.weight`: vLLM skips the draft
embedding when the checkpoint has none and shares the target's, SGLang always installs the
target's embedding (`set_embed`), and our own loader borrows the target's. speculators folders
store the target's input embedding (vocab x hidden in the export dtype): the speculators library
(0.9) fills `embed_tokens` from the verifier only while it is still NaN, and under transformers 5
`from_pretrained` has already materialised it (zeros), so without a stored copy its forward runs on
a zero embedding (tests/engines/check_speculators.sh measures it). vLLM keeps such a stored copy for the draft
instead of sharing the target's (same acceptance in tests/engines/check_vllm.sh). Older speculators exports
without it still pass `--check`, with a note.
EAGLE-1's LM head is the target's in every runtime, so it is not written either.

speculators `verifier.name_or_path` is what that library (and `vllm serve <speculators folder>`)
loads the verifier from; `export.verifier` picks it (default: the local target folder).

Layer-id conventions differ: our `aux_layer_ids` (and vLLM's / speculators'
`eagle_aux_hidden_state_layer_ids`) name the *input* of decoder layer i; SGLang adds 1 to the ids
in `eagle_config` (id k there means the output of layer k), so the SGLang folder stores ids - 1.
EAGLE-3.1 options (`HeadConfig.fc_norm`: an RMSNorm per aux layer before fc, stored as
`fc_norm.{i}.weight`; `norm_output`: the normed output fed back) are the config keys `fc_norm` /
`norm_output` in every format that serves them: vLLM 0.32, SGLang 0.5.23 and speculators 0.9.0 read
both under these names. llama.cpp b11434 expresses neither, so `format=llamacpp` refuses such heads
(`Algorithm.export_refusals` holds every refusal and its reason).
Both runtimes take `norm_before_residual` to mean the residual is taken after `hidden_norm`; our
head takes it before, so every config says `false` explicitly (vLLM's speculators path defaults it
to true when absent).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from eagle.algorithms import ALGORITHMS, Algorithm, get_algorithm
from eagle.artifacts import EXPORT_CONFIG, HEAD_CONFIG, HEAD_WEIGHTS
from eagle.config import ConfigError
from eagle.errors import ExportError
from eagle.heads.base import HeadConfig
from eagle.target.structure import default_aux_layer_ids

WEIGHTS_FILE = HEAD_WEIGHTS
HEAD_CONFIG_FILE = HEAD_CONFIG
CONFIG_FILE = EXPORT_CONFIG
EXPORT_META_KEY = "eagle_export"  # our own block in config.json: canonical HeadConfig + format
SPECULATORS_EMBED = "embed_tokens.weight"  # the target's input embedding, stored in speculators folders
LLAMACPP_FILE = "LLAMACPP.md"  # what format=llamacpp adds to the vLLM folder: the convert + serve commands
LLAMACPP_GGUF = "head.gguf"  # the converter's output its commands name, next to the weights it was made from


# Built-in target names -> the Hub id of the same model (for base_model / verifier fields).
BUILTIN_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_id_for_target(target_path: str) -> str:
    """The Hub id to name as the target (verifier / base_model) for `target.path`."""
    return BUILTIN_HUB_IDS.get(target_path, target_path)


# --- tensor layout ---------------------------------------------------------------------------------
def algorithm_of(cfg: HeadConfig) -> Algorithm:
    """The registered algorithm of `cfg`; ExportError for a name eagle does not know."""
    try:
        return get_algorithm(cfg.algorithm)
    except ConfigError:
        raise ExportError(
            f"unknown head algorithm {cfg.algorithm!r} (expected one of {', '.join(ALGORITHMS)})"
        ) from None


def expected_tensors(cfg: HeadConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Our parameter name -> (shape, kind) for a head of `cfg`; kind is float | int | bool.

    Read off the head module itself, built on the meta device (no memory, no init): this is the
    complete set of tensors a head of this config owns, and the exporter refuses a head whose state
    dict has anything else (an export must never drop weights silently).
    """
    algo = algorithm_of(cfg)
    if algo.num_aux_layers and len(cfg.aux_layer_ids) != algo.num_aux_layers:
        # A third-party folder without aux ids: the tensor shapes depend only on how many there are.
        cfg = dataclasses.replace(cfg, aux_layer_ids=list(range(algo.num_aux_layers)))
    with torch.device("meta"):
        head = get_algorithm(cfg.algorithm).head_class(cfg)
    return {name: (tuple(t.shape), tensor_kind(t)) for name, t in head.trainable_state_dict().items()}


def to_format_name(name: str, fmt: str, algorithm: str) -> str:
    """Our tensor name -> the name a format stores it under."""
    return get_algorithm(algorithm).export_tensor_name(name, fmt)


def from_format_name(name: str, algorithm: str) -> str:
    """A stored tensor name (any supported format or third-party variant) -> our name."""
    if name.startswith("model."):  # some third-party checkpoints keep the runtime's wrapper prefix
        name = name[len("model.") :]
    return get_algorithm(algorithm).canonical_tensor_name(name)


# --- config.json -----------------------------------------------------------------------------------
def _rope_fields(cfg: HeadConfig) -> dict[str, Any]:
    """RoPE in both spellings: rope_theta/rope_scaling (older runtimes) and rope_parameters (v5)."""
    params = dict(cfg.rope_parameters)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {
        "rope_theta": float(params.get("rope_theta", 10000.0)),
        # M-RoPE (a vision-language target's `mrope_section`) is kept even with the default type: vLLM builds
        # its draft's M-RoPE rotary from these fields, and the target's M-RoPE positions need it.
        "rope_scaling": None
        if scaling.get("rope_type", "default") == "default" and "mrope_section" not in scaling
        else scaling,
        "rope_parameters": params,
    }


def llama_layer_config(cfg: HeadConfig, dtype: str) -> dict[str, Any]:
    """The one-layer Llama config every runtime builds the draft decoder layer from."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        # SGLang ties lm_head to embed_tokens when this is true, which would discard our lm_head.
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **_rope_fields(cfg),
    }


def export_meta(cfg: HeadConfig, fmt: str) -> dict[str, Any]:
    """Our own block: the canonical HeadConfig, so our loader never has to guess conventions."""
    return {"format": fmt, "head_config": dataclasses.asdict(cfg)}


# --- reading any folder's config -------------------------------------------------------------------
def detect_algorithm(config: dict[str, Any], where: str) -> str:
    """The algorithm name from a config.json (ours, vLLM/SGLang-style or speculators)."""
    meta = config.get(EXPORT_META_KEY)
    if isinstance(meta, dict) and isinstance(meta.get("head_config"), dict):
        return str(meta["head_config"].get("algorithm"))
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        for algo in ALGORITHMS.values():
            if algo.speculators_model_type and algo.speculators_model_type == kind:
                return algo.name
        known = [a.speculators_model_type for a in ALGORITHMS.values() if a.speculators_model_type]
        raise ExportError(f"{where}: speculators_model_type={kind!r} is not supported (only {', '.join(known)})")
    archs = config.get("architectures") or []
    for algo in ALGORITHMS.values():
        if algo.recognises(config):
            return algo.name
    known = [a for algo in ALGORITHMS.values() for a in algo.known_architectures]
    raise ExportError(
        f"{where}: architectures={archs} is not an EAGLE draft head (expected one of "
        f"{', '.join(known)}, or a speculators config)"
    )


def _rope_from(layer: dict[str, Any]) -> dict[str, Any]:
    params = layer.get("rope_parameters")
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = layer.get("rope_scaling") or {}
    out = {"rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
    out.update({k: v for k, v in scaling.items() if k != "type"})
    out["rope_theta"] = float(layer.get("rope_theta", 10000.0))
    return out


def head_config_from_config(
    config: dict[str, Any], where: str, num_target_layers: int | None = None
) -> tuple[HeadConfig, str]:
    """(HeadConfig, format) read from a config.json of any supported format.

    Our own folders carry the canonical HeadConfig; third-party folders are read from their
    Llama/speculators fields. Aux layer ids: top-level / speculators ids as they are (vLLM
    convention), SGLang `eagle_config` ids + 1; none given -> left empty for the caller to fill.
    """
    meta = config.get(EXPORT_META_KEY)
    if isinstance(meta, dict) and isinstance(meta.get("head_config"), dict):
        try:
            return HeadConfig.from_dict(dict(meta["head_config"])), str(meta.get("format", "hf"))
        except (TypeError, ValueError) as e:
            raise ExportError(f"{where}: {EXPORT_META_KEY}.head_config is invalid: {e}") from e
    algorithm = detect_algorithm(config, where)
    num_aux = get_algorithm(algorithm).num_aux_layers
    fmt = "speculators" if "speculators_model_type" in config else "third-party"
    layer = config.get("transformer_layer_config", config) if "speculators_model_type" in config else config
    if not isinstance(layer, dict):
        raise ExportError(f"{where}: transformer_layer_config must be a JSON object")
    for flag in ("norm_before_residual", "norm_before_fc"):
        if config.get(flag) or layer.get(flag):
            raise ExportError(
                f"{where}: {flag}=true is a head variant eagle does not implement; such a head cannot be loaded here"
            )
    try:
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ExportError(
                f"{where}: num_hidden_layers={layer['num_hidden_layers']}; eagle heads have exactly one decoder layer"
            )
        h = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        aux: list[int] = []
        if config.get("eagle_aux_hidden_state_layer_ids"):
            aux = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
        elif isinstance(config.get("eagle_config"), dict) and config["eagle_config"].get(
            "eagle_aux_hidden_state_layer_ids"
        ):
            aux = [int(i) + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        elif num_aux and num_target_layers is not None:
            aux = default_aux_layer_ids(num_target_layers)
        cfg = HeadConfig(
            algorithm=algorithm,
            hidden_size=h,
            target_hidden_size=int(config.get("target_hidden_size") or layer.get("target_hidden_size") or h),
            vocab_size=vocab,
            draft_vocab_size=int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or h // heads),
            intermediate_size=int(layer["intermediate_size"]),
            hidden_act=str(layer.get("hidden_act", "silu")),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(layer.get("attention_bias", False)),
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
            rope_parameters=_rope_from(layer),
            aux_layer_ids=aux if num_aux else [],
            fc_norm=bool(num_aux and (config.get("fc_norm") or layer.get("fc_norm"))),
            norm_output=bool(num_aux and (config.get("norm_output") or layer.get("norm_output"))),
        )
    except KeyError as e:
        raise ExportError(f"{where}: config field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ExportError(f"{where}: a config field has the wrong type: {e}") from e
    return cfg, fmt


def tensor_kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_floating_point():
        return "float"
    return "int"
