"""Tiny random targets of several families, built in code, with real tokenizers and chat templates.

Each family gets a byte-level BPE tokenizer (trained in a fraction of a second on a fixed corpus) and
a chat template of its own shape, so that template handling, capture, training and decoding are
tested on differently shaped templates and model configs without any download:

| family  | model class           | notable config                          | template shape            |
|---------|-----------------------|-----------------------------------------|---------------------------|
| llama   | LlamaForCausalLM      | tied embeddings                         | Llama-3 header blocks     |
| qwen2   | Qwen2ForCausalLM      | attention bias, untied embeddings       | ChatML (SmolLM2 / Qwen)   |
| qwen3   | Qwen3ForCausalLM      | q/k norm                                | ChatML with a think block |
| mistral | MistralForCausalLM    | untied                                  | [INST] ... [/INST]        |
| gemma3  | Gemma3ForCausalLM     | scaled embeddings, gelu, pre/post norms | <start_of_turn> turns     |

The newer families (`MORE_FAMILIES`, issue #44) are tested by tests/test_families.py across every stage:

| family      | model class              | notable config                                   | template shape      |
|-------------|--------------------------|--------------------------------------------------|---------------------|
| qwen3_next  | Qwen3NextForCausalLM     | Gated DeltaNet + full attention, MoE, shared exp | ChatML, think block |
| qwen3_5     | Qwen3_5ForCausalLM       | Gated DeltaNet + full attention, dense (text)    | ChatML, think block |
| gpt_oss     | GptOssForCausalLM        | sinks, sliding + full layers, MoE; eager only    | Harmony channels    |
| qwen3_moe   | Qwen3MoeForCausalLM      | MoE                                              | ChatML, think block |
| mixtral     | MixtralForCausalLM       | MoE                                              | [INST] ... [/INST]  |
| deepseek_v3 | DeepseekV3ForCausalLM    | MLA, shared experts, a dense first layer         | DeepSeek turns      |
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from eagle.target.loading import attention_implementation

HIDDEN = 64
LAYERS = 4
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
MORE_FAMILIES = ("qwen3_next", "qwen3_5", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3")
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5")  # recurrent (linear-attention) layers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_THINK = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Harmony's shape as gpt-oss's own template renders it: every assistant message on the final channel, the last
# one's `thinking` (if any) on the analysis channel before it, earlier turns' thinking dropped; the last answer
# ends with <|return|>, earlier ones with <|end|>.
HARMONY = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% if loop.last and not add_generation_prompt and m.get('thinking') %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
    "{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|Assistant|>{{ m['content'] }}<|end_of_sentence|>"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}"
)
_QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Special tokens a family's processor reads as named tokenizer attributes (`tokenizer.boi_token`, ...).
NAMED_SPECIALS: dict[str, dict[str, str]] = {}

# template, special tokens, bos, eos
TEMPLATES: dict[str, tuple[str, list[str], str | None, str]] = {
    "llama": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen2": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "qwen3": (CHATML_THINK, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>"),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "gemma3": (GEMMA, ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
    "qwen3_next": (CHATML_THINK, _QWEN3_SPECIALS, None, "<|im_end|>"),
    "qwen3_5": (CHATML_THINK, _QWEN3_SPECIALS, None, "<|im_end|>"),
    "qwen3_moe": (CHATML_THINK, _QWEN3_SPECIALS, None, "<|im_end|>"),
    "gpt_oss": (
        HARMONY,
        ["<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"],
        None,
        "<|return|>",
    ),
    "mixtral": (MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "deepseek_v3": (
        DEEPSEEK,
        ["<|end_of_sentence|>", "<|begin_of_sentence|>", "<|User|>", "<|Assistant|>"],
        "<|begin_of_sentence|>",
        "<|end_of_sentence|>",
    ),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea. The sea is wide and blue and deep.",
    "User: hello! Assistant: Hi, how can I help you today?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
    "Explain the theory of relativity in simple terms for a child.",
    "import torch\nx = torch.randn(3, 4)\nprint(x.sum())\n",
]


@cache
def _tokenizer_json(family: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = TEMPLATES[family][1]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return tok.to_str()


def make_tokenizer(family: str):
    """A fast tokenizer with the family's chat template and special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos = TEMPLATES[family]
    named = NAMED_SPECIALS.get(family, {})  # e.g. tokenizer.boi_token, which a processor reads
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(family)),
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        additional_special_tokens=[s for s in specials if s not in (bos, eos, specials[0], *named.values())],
        **({"extra_special_tokens": named} if named else {}),
    )
    tok.chat_template = template
    return tok


def text_fields(vocab_size: int, num_layers: int = LAYERS, hidden: int = HIDDEN) -> dict[str, int]:
    """The sizes every tiny text model shares (4 query heads, 2 KV heads); families add their own fields."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


def _special_ids_from(cfg: Any, tok: Any) -> None:
    """A VL config's pad / eos ids (and its text config's) from the tokenizer."""
    cfg.pad_token_id = cfg.text_config.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = cfg.text_config.eos_token_id = tok.eos_token_id


def make_config(family: str, vocab_size: int, num_layers: int = LAYERS, hidden: int = HIDDEN):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = text_fields(vocab_size, num_layers, hidden)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if family == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
    return _more_config(family, common, num_layers)


def _more_config(family: str, common: dict, num_layers: int):
    """The configs of MORE_FAMILIES (hybrid layers alternate linear and full attention)."""
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        MixtralConfig,
        Qwen3_5TextConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    hybrid = dict(
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
    )
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    if family == "qwen3_next":
        return Qwen3NextConfig(
            **common, **hybrid, **moe, num_experts=4, shared_expert_intermediate_size=32, tie_word_embeddings=False
        )
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**common, **hybrid, tie_word_embeddings=True)
    if family == "gpt_oss":
        return GptOssConfig(
            **common,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            tie_word_embeddings=False,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=16, num_experts=4, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "deepseek_v3":  # MLA: every head has its own latent keys and values
        return DeepseekV3Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]},
            **moe,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            tie_word_embeddings=False,
        )
    if family in PER_LAYER_FAMILIES:
        return _per_layer_config(family, common, num_layers)
    if family in STATE_FAMILIES:
        return _state_config(family, common, num_layers)
    if family in YEAR_FAMILIES:
        return _year_config(family, common, num_layers)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES + MORE_FAMILIES}")


def make_model(family: str, seed: int = 0, num_layers: int = LAYERS, hidden: int = HIDDEN):
    """(model, tokenizer) with fixed random weights. The ids the tokenizer knows fit the vocab."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(family)
    cfg = make_config(family, vocab_size=len(tok), num_layers=num_layers, hidden=hidden)
    cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    cfg.bos_token_id = tok.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=attention_implementation("auto", cfg)
    )
    # Random init at std 0.02 gives near-uniform next-token distributions; a larger output scale
    # makes greedy choices and acceptance decisions non-trivial in tests.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.eval()
    return model, tok


def save_model(family: str, folder: Path, seed: int = 0, **kw) -> Path:
    """Save a tiny model + tokenizer as an HF checkpoint folder (loadable by `target.path=folder`)."""
    model, tok = make_model(family, seed=seed, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


# Issue #51, Gemma 4 and DeepSeek-V4 (tests/test_families.py runs them through every stage):
# | family      | model class            | notable config                                                  | template      |
# | gemma4      | Gemma4ForCausalLM      | per-layer config (full layers: 32-wide heads, 1 KV head, keys    | <start_of_turn> |
# |             |                        | as values; sliding: 16-wide, 2 KV heads), KV-sharing last layers, |               |
# |             |                        | per-layer input embeddings, proportional RoPE                    |               |
# | deepseek_v4 | DeepseekV4ForCausalLM  | 2 hyper-connection residual streams, sliding + compressed (CSA,   | DeepSeek turns |
# |             |                        | HCA) attention, hash-routed and routed MoE; eager only            |               |
PER_LAYER_FAMILIES = ("gemma4", "deepseek_v4")
TEMPLATES["gemma4"] = TEMPLATES["gemma3"]
TEMPLATES["deepseek_v4"] = TEMPLATES["deepseek_v3"]


def _per_layer_config(family: str, common: dict, num_layers: int):
    """The configs of PER_LAYER_FAMILIES: small, but with every part that sets the family apart."""
    from transformers import DeepseekV4Config, Gemma4TextConfig

    layer_types = ["sliding_attention", "full_attention"] * (num_layers // 2)
    if family == "gemma4":
        return Gemma4TextConfig(
            **{k: v for k, v in common.items() if k != "num_key_value_heads"},
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,  # full-attention layers' head_dim (a per-layer attribute)
            attention_k_eq_v=True,
            num_global_key_value_heads=1,  # full-attention layers' KV heads (per layer too)
            num_kv_shared_layers=2,  # the last two layers read the KV of the last unshared layer of their type
            sliding_window=8,
            layer_types=layer_types,
            vocab_size_per_layer_input=common["vocab_size"],
            hidden_size_per_layer_input=8,
            tie_word_embeddings=False,  # tied, the 8x output scale (make_model) makes one token win everywhere
        )
    if family == "deepseek_v4":
        return DeepseekV4Config(
            vocab_size=common["vocab_size"],
            hidden_size=common["hidden_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            hc_mult=2,
            sliding_window=8,
            # Compression every 4 / 8 tokens, so a test prompt already emits compressed entries.
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            layer_types=(
                ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * num_layers
            )[:num_layers],
            mlp_layer_types=["hash_moe"] + ["moe"] * (num_layers - 1),
            max_position_embeddings=common["max_position_embeddings"],
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}; known: {PER_LAYER_FAMILIES}")


# Issue #51, vision-language targets (tests/test_vl.py runs them through every stage with image prompts):
# | family    | model class                      | notable config                                      | template           |
# | qwen3_vl  | Qwen3VLForConditionalGeneration  | 2-block vision tower (16-px patches, 2x2 merge,    | ChatML, image      |
# |           |                                  | deepstack), interleaved M-RoPE text model          | parts as pads      |
# | gemma3_vl | Gemma3ForConditionalGeneration   | 2-layer SigLIP tower (32-px images, 8-px patches,  | <start_of_turn>,   |
# |           |                                  | pooled to 4 tokens), 1-D RoPE, sliding + full      | image parts as     |
# |           |                                  | layers, bidirectional attention inside an image    | <start_of_image>   |
# Their image processors are built here too, with the PIL backend (no torchvision; eagle.target.multimodal);
# Gemma 3's whole processor (Gemma3Processor: the text it puts around an image's tokens) is saved beside it.
VL_FAMILIES = ("qwen3_vl", "gemma3_vl")
# Qwen2.5-VL (contiguous M-RoPE sections, Qwen3-VL's interleaved): held by tests/test_vl_positions.py only, where the
# layout matters (positions, lossless decoding with images), to keep the suite's time.
MROPE_ONLY_VL_FAMILIES = ("qwen2_5_vl",)
CHATML_VL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 3's template shape: an image part renders as <start_of_image>, which its processor expands.
GEMMA_VL = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEMPLATES["gemma3_vl"] = (
    GEMMA_VL,
    [
        "<pad>",
        "<bos>",
        "<eos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ],
    "<bos>",
    "<end_of_turn>",
)
NAMED_SPECIALS["gemma3_vl"] = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
TEMPLATES["qwen2_5_vl"] = TEMPLATES["qwen3_vl"] = (
    CHATML_VL,
    [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    None,
    "<|im_end|>",
)


def make_image_processor():
    """Qwen2-VL's image processor (PIL backend) sized for the tiny tower: 16-px patches, 2x2 merge, images
    resized to 1-9 merged patches (32 x 32 to 96 x 96 pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96}
    )


def make_vl_model(family: str = "qwen3_vl", seed: int = 0, num_layers: int = LAYERS, hidden: int = HIDDEN):
    """(model, tokenizer, image processor or whole processor) of a VL_FAMILIES family, fixed random weights."""
    from transformers import AutoModelForImageTextToText

    if family == "gemma3_vl":
        cfg, tok, processor = _gemma3_vl_parts(num_layers, hidden)
    elif family == "qwen3_vl":
        cfg, tok, processor = _qwen3_vl_parts(num_layers, hidden)
    elif family == "qwen2_5_vl":
        cfg, tok, processor = _qwen2_5_vl_parts(num_layers, hidden)
    else:
        raise ValueError(f"unknown family {family!r}; known: {(*VL_FAMILIES, *MROPE_ONLY_VL_FAMILIES)}")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # as make_model: non-trivial greedy choices
    model.eval()
    return model, tok, processor


def _qwen3_vl_parts(num_layers: int, hidden: int):
    """Qwen3-VL: a deepstack vision tower, interleaved M-RoPE over the 8 rotary frequencies (2 time, 3 height,
    3 width)."""
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    vision = dict(deepstack_visual_indexes=[0], num_position_embeddings=64)
    return _qwen_vl_parts(Qwen3VLConfig, "qwen3_vl", num_layers, hidden, rope, vision)


def _qwen2_5_vl_parts(num_layers: int, hidden: int):
    """Qwen2.5-VL: a windowed vision tower, contiguous M-RoPE sections (2 time, then 3 height, 3 width)."""
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(window_size=64, fullatt_block_indexes=[1])
    return _qwen_vl_parts(Qwen2_5_VLConfig, "qwen2_5_vl", num_layers, hidden, rope, vision)


def _qwen_vl_parts(config_cls: Any, family: str, num_layers: int, hidden: int, rope: dict, vision: dict):
    """A Qwen-VL config (2-block tower of 16-px patches merged 2 x 2, head_dim 16), its tokenizer and Qwen2-VL's
    PIL image processor; `rope` and `vision` are what the generations differ in."""
    tok = make_tokenizer(family)
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start")}
    cfg = config_cls(
        text_config=dict(
            **text_fields(len(tok), num_layers, hidden), head_dim=16, rope_parameters=rope, tie_word_embeddings=False
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            **vision,
        ),
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    _special_ids_from(cfg, tok)
    return cfg, tok, make_image_processor()


GEMMA3_IMAGE_SIZE = 32  # pixels a side: every image is resized to it (8-px patches: 16, pooled to 4 tokens)
GEMMA3_IMAGE_TOKENS = 4  # mm_tokens_per_image: the soft tokens between <start_of_image> and <end_of_image>


def _gemma3_vl_parts(num_layers: int, hidden: int):
    """Gemma 3's config, tokenizer and whole processor (Gemma3Processor: image processor + tokenizer)."""
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = make_tokenizer("gemma3_vl")
    cfg = Gemma3Config(
        text_config=dict(
            **text_fields(len(tok), num_layers, hidden),
            head_dim=16,
            query_pre_attn_scalar=16,
            # A window shorter than the test prompts, so sliding layers and the image block's bidirectional
            # attention meet (AND(window, OR(causal, image block)) in transformers' masks).
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=GEMMA3_IMAGE_SIZE,
            patch_size=8,
        ),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=False,  # tied, the 8x output scale (make_vl_model) would scale the embeddings too
    )
    _special_ids_from(cfg, tok)
    cfg.bos_token_id = cfg.text_config.bos_token_id = tok.bos_token_id
    images = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    return cfg, tok, Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=GEMMA3_IMAGE_TOKENS)


def save_vl_model(folder: Path, seed: int = 0, family: str = "qwen3_vl", **kw) -> Path:
    """A tiny VL_FAMILIES model as a checkpoint folder: weights, tokenizer and processor config(s)."""
    model, tok, processor = make_vl_model(family, seed=seed, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    processor.save_pretrained(folder)
    images = getattr(processor, "image_processor", None)
    if images is not None:  # a whole processor: its image processor's own file too, as the Hub's checkpoints have
        images.save_pretrained(folder)
    return folder


def write_images(folder: Path) -> list[Path]:
    """Three small PNG photographs' stand-ins (gradients and blocks of colour, different sizes)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for k, (h, w) in enumerate(((40, 60), (64, 64), (90, 50))):
        pixels = (rng.random((h, w, 3)) * 255).astype("uint8")
        paths.append(folder / f"image{k}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


# Issue #51, the families whose layers keep states the decoder must roll back (eagle.decode.cache): Mamba2
# and MoE/MLP-only layers (Nemotron-H), attention and Mamba2 side by side in every layer (Falcon-H1), short
# convolutions with full (LFM2) or full and sliding attention (LFM3). Four layers each; every kind of layer
# the family has appears at least once.
STATE_FAMILIES = ("nemotron_h", "falcon_h1", "lfm2", "lfm3")
for _family in STATE_FAMILIES:
    TEMPLATES[_family] = (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>")


def _state_config(family: str, common: dict, num_layers: int):
    """The configs of STATE_FAMILIES (num_layers 4: the layer-type lists are written out)."""
    from transformers import FalconH1Config, Lfm2Config, Lfm3Config, NemotronHConfig

    if family == "nemotron_h":  # Mamba2, an MoE-only layer, attention, an MLP-only layer
        return NemotronHConfig(
            **{k: v for k, v in common.items() if k != "num_hidden_layers"},
            head_dim=16,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"][:num_layers],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            expand=1,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        )
    if family == "falcon_h1":  # every layer: attention and Mamba2 in parallel
        return FalconH1Config(
            **common,
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        )
    if family == "lfm2":
        return Lfm2Config(
            **common, tie_word_embeddings=False, layer_types=["conv", "full_attention"] * (num_layers // 2)
        )
    if family == "lfm3":
        return Lfm3Config(
            **common,
            pad_token_id=0,  # its defaults lie outside a tiny vocabulary (make_model sets the tokenizer's)
            bos_token_id=1,
            eos_token_id=2,
            head_dim=16,
            sliding_window=8,
            layer_types=(["conv", "sliding_attention", "conv", "full_attention"] * num_layers)[:num_layers],
        )
    raise ValueError(f"unknown family {family!r}")


# Issue #51's other families of 2026, already running before it (kept running): Granite 4 (Mamba2 +
# attention, MoE), OLMo hybrid (Gated DeltaNet + attention), GLM-4.5 MoE and MiniMax-M2 (MoE).
YEAR_FAMILIES = ("granitemoehybrid", "olmo_hybrid", "glm4_moe", "minimax_m2")
for _family in YEAR_FAMILIES:
    TEMPLATES[_family] = (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>")


def _year_config(family: str, common: dict, num_layers: int):
    """The configs of YEAR_FAMILIES (hybrids alternate their recurrent layer with attention)."""
    from transformers import Glm4MoeConfig, GraniteMoeHybridConfig, MiniMaxM2Config, OlmoHybridConfig

    if family == "granitemoehybrid":
        return GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention"] * (num_layers // 2),
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_expand=1,
            mamba_chunk_size=16,
        )
    if family == "olmo_hybrid":
        return OlmoHybridConfig(
            **common,
            pad_token_id=0,  # its defaults lie outside a tiny vocabulary (make_model sets the tokenizer's)
            eos_token_id=2,
            layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    if family == "glm4_moe":
        return Glm4MoeConfig(  # every layer MoE (first_k_dense_replace=0): the default's dense first layer
            **common,  # makes this random model end its answer at the second token
            head_dim=16,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            n_routed_experts=4,
            first_k_dense_replace=0,
        )
    if family == "minimax_m2":
        return MiniMaxM2Config(
            **common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2
        )
    raise ValueError(f"unknown family {family!r}")
