"""Every export format as one registered object: what its folder holds besides the head's tensors, its
config.json, the files it adds, how it is checked, the model card's library and usage lines, and what
`--check` prints about it. `FORMATS` is the one list of format names: stages look a format up here and
ask it, rather than comparing names (the way `eagle.regenerate.engines.ENGINES` does for regeneration
engines). How each algorithm's tensors are named and configured per format is the algorithm's part
(`Algorithm.export_tensor_name`, `config_fields`, `export_refusals`; eagle/algorithms/).

| format      | served by                      | adds to the head's tensors / files          | card library |
|-------------|--------------------------------|---------------------------------------------|--------------|
| vllm        | vLLM (`--speculative-config`)  | -                                           | vllm         |
| sglang      | SGLang (`--speculative-*`)     | -                                           | sglang       |
| speculators | speculators, vLLM              | the target's embedding; verifier in config  | speculators  |
| hf          | eagle                          | head_config.json                            | eagle        |
| llamacpp    | llama.cpp (after converting)   | LLAMACPP.md (convert + serve commands)      | vllm         |
| transformers| transformers' `generate`       | - (the library class's own config)          | transformers |
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from eagle.algorithms import Algorithm
from eagle.errors import ExportError
from eagle.export.formats import (
    EXPORT_META_KEY,
    HEAD_CONFIG_FILE,
    LLAMACPP_FILE,
    SPECULATORS_EMBED,
    algorithm_of,
    expected_tensors,
    export_meta,
    llama_layer_config,
)
from eagle.export.hf_generate import custom_generate_files
from eagle.export.llamacpp import llamacpp_guide, local_target, portable_target
from eagle.heads.base import HeadConfig

if TYPE_CHECKING:
    from pathlib import Path

    from eagle.export.exported import ExportedHead


# vLLM's EAGLE-3 draft names for vision-language targets (text model types too: `HeadConfig.target_model_type` is
# the text config's). vLLM's registry maps each to its Llama EAGLE-3 draft; the name is what makes it take the
# draft for a multimodal target (text-only draft inputs, the target's M-RoPE positions, `rope_scaling` M-RoPE).
# Gemma 3 (`gemma3_text`, 1-D RoPE) has no such name in vLLM's registry: its heads keep the plain Llama EAGLE-3
# name, which vLLM loads; serving one beside a Gemma 3 target is another matter (docs/train-your-own-target.md).
VL_DRAFT_ARCHITECTURES = {
    "qwen3_vl": "Eagle3Qwen3vlForCausalLM",
    "qwen3_vl_text": "Eagle3Qwen3vlForCausalLM",
    "qwen3_vl_moe": "Eagle3Qwen3vlForCausalLM",
    "qwen3_vl_moe_text": "Eagle3Qwen3vlForCausalLM",
    "qwen2_5_vl": "Eagle3Qwen2_5vlForCausalLM",
    "qwen2_5_vl_text": "Eagle3Qwen2_5vlForCausalLM",
}


def vllm_draft_architecture(cfg: HeadConfig, format_name: str, default: str) -> str:
    """The `architectures` entry: `default` (the algorithm's), or for an EAGLE-3 head of a vision-language
    target exported for vLLM, vLLM's VL draft name."""
    if format_name == "vllm" and cfg.algorithm == "eagle3":
        return VL_DRAFT_ARCHITECTURES.get(cfg.target_model_type, default)
    return default


class ExportFormat:
    """A format eagle writes. Subclasses set the names and override what their folders do differently."""

    name: ClassVar[str]
    engine: ClassVar[str]  # what serves such a folder (messages, the card)
    library: ClassVar[str]  # the model card's library_name
    stores_target_embedding: ClassVar[bool] = False  # the folder holds the target's input embedding
    names_verifier: ClassVar[bool] = False  # config.json names the target to load (verifier)

    def config(
        self, cfg: HeadConfig, algo: Algorithm, dtype: str, verifier: dict[str, Any] | None, speculative_tokens: int
    ) -> dict[str, Any]:
        """config.json: the one-layer Llama config the engines build the draft layer from, the algorithm's
        architecture and fields for this format, and our own block (the canonical HeadConfig)."""
        out = llama_layer_config(cfg, dtype)
        out["architectures"] = [vllm_draft_architecture(cfg, self.name, algo.architectures[self.name])]
        out.update(algo.config_fields(cfg, self.name))
        out[EXPORT_META_KEY] = export_meta(cfg, self.name)
        return out

    def extra_tensors(self, cfg: HeadConfig) -> dict[str, tuple[tuple[int, ...], str]]:
        """Stored name -> (shape, kind) the folder holds besides the head's own tensors."""
        return {}

    def files(
        self,
        cfg: HeadConfig,
        folder: str,
        target_path: str | None,
        local_paths: bool,
        dtype: str,
        speculative_tokens: int,
    ) -> dict[str, str]:
        """Files the folder adds (name -> text); `folder` is where it is written."""
        return {}

    def check_folder(self, head: ExportedHead, where: Path) -> None:
        """Format-specific checks of a folder of this format that eagle wrote (ExportError)."""

    def usage(self, algo: Algorithm, target: str, repo: str, speculative_tokens: int, head: ExportedHead) -> list[str]:
        """The model card's usage lines (markdown)."""
        return []

    def summary(self, head: ExportedHead) -> list[str]:
        """Lines `eagle-export --check` prints about such a folder."""
        return []


def _vllm_serve(algo: Algorithm, target: str, repo: str, speculative_tokens: int) -> list[str]:
    served = {
        "method": algo.vllm_method,
        "model": repo,
        "num_speculative_tokens": speculative_tokens,
        **algo.vllm_options,
    }
    return ["```bash", f"vllm serve {target} --speculative-config '{json.dumps(served)}'", "```"]


class VLLMFormat(ExportFormat):
    name = "vllm"
    engine = "vLLM"
    library = "vllm"

    def usage(self, algo, target, repo, speculative_tokens, head):
        return _vllm_serve(algo, target, repo, speculative_tokens)


class SGLangFormat(ExportFormat):
    name = "sglang"
    engine = "SGLang"
    library = "sglang"

    def usage(self, algo, target, repo, speculative_tokens, head):
        return [
            "```bash",
            f"python -m sglang.launch_server --model {target} --speculative-algorithm "
            f"{algo.sglang_algorithm} --speculative-draft-model-path {repo} --speculative-num-steps 4 "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
            "```",
        ]


class SpeculatorsFormat(ExportFormat):
    """vllm-project/speculators' layout (Eagle3Speculator): the draft layer under `transformer_layer_config`,
    the verifier named in `speculators_config`, and the target's input embedding stored (the library fills
    its embedding from the verifier only while it is NaN, which transformers 5 no longer leaves it)."""

    name = "speculators"
    engine = "speculators"
    library = "speculators"
    stores_target_embedding = True
    names_verifier = True

    def config(self, cfg, algo, dtype, verifier, speculative_tokens):
        verifier = verifier or {"name_or_path": None, "architectures": []}
        return {
            "speculators_model_type": algo.speculators_model_type,
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": llama_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "norm_before_residual": False,
            "norm_before_fc": False,
            # Eagle3SpeculatorConfig's own fields (speculators 0.9.0 models/eagle3/config.py); vLLM 0.32
            # carries both over when it serves a speculators folder (configs/speculators/algos.py).
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "embed_requires_grad": False,
            "torch_dtype": dtype,
            "speculators_config": {
                "algorithm": algo.speculators_model_type,
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier.get("name_or_path"),
                    "architectures": list(verifier.get("architectures") or []),
                },
            },
            EXPORT_META_KEY: export_meta(cfg, self.name),
        }

    def extra_tensors(self, cfg):
        return {SPECULATORS_EMBED: ((cfg.vocab_size, cfg.hidden_size), "float")}

    def check_folder(self, head, where):
        spec = head.raw_config.get("speculators_config")
        kind = algorithm_of(head.config).speculators_model_type
        try:
            assert int(spec["proposal_methods"][0]["speculative_tokens"]) >= 1
            assert spec["verifier"]["name_or_path"]
            assert spec["algorithm"] == kind
        except (KeyError, IndexError, TypeError, AssertionError, ValueError) as e:
            raise ExportError(
                f"{where}: speculators_config needs algorithm={kind}, proposal_methods[0]."
                "speculative_tokens >= 1 and verifier.name_or_path"
            ) from e

    def usage(self, algo, target, repo, speculative_tokens, head):
        verifier = ((head.raw_config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        lines = [
            *_vllm_serve(algo, target, repo, speculative_tokens),
            "",
            "With the `speculators` library (checked with speculators 0.9.0):",
            "",
            "```python",
            "from speculators import SpeculatorModel",
            "",
            f'model = SpeculatorModel.from_pretrained("{repo}")',
            "```",
            "",
            f"`from_pretrained` reads the verifier's config and LM head from `speculators_config.verifier."
            f"name_or_path`, which this folder sets to `{verifier}`. Offline, that must be a local folder of "
            "the target: export with `eagle-export ... format=speculators export.verifier=/path/to/target` "
            "(`eagle-export` defaults to the local target folder the head was trained on, `eagle-publish` to "
            "the target's Hub id), or edit that field.",
        ]
        embed = head.borrowed.get(SPECULATORS_EMBED)
        if embed is not None:
            size = embed.numel() * embed.element_size()
            lines += [
                "",
                f"`{SPECULATORS_EMBED}` is the target's own input embedding ({embed.shape[0]} x "
                f"{embed.shape[1]} x {embed.element_size()} bytes = {size / 2**20:.1f} MiB), stored because "
                "the speculators library fills its embedding from the verifier only while it is uninitialised "
                "(NaN), which transformers 5 no longer leaves it; without it the head would run on zeros. "
                "`eagle` itself uses the target's embedding (the same values).",
            ]
        return lines

    def summary(self, head):
        verifier = ((head.raw_config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        return [f"  speculators verifier: {verifier}"]


class HFFormat(ExportFormat):
    """eagle's own folder: our tensor names (= `save_head`), head_config.json beside a Llama-style config, and
    `custom_generate/`, through which transformers' own `generate` decodes with the head in eagle's decoder
    (eagle/export/hf_generate.py; the stub names this folder, or none in a folder for the Hub)."""

    name = "hf"
    engine = "eagle"
    library = "eagle"

    def files(self, cfg, folder, target_path, local_paths, dtype, speculative_tokens):
        return {HEAD_CONFIG_FILE: cfg.to_json() + "\n", **custom_generate_files(folder if local_paths else None)}

    def usage(self, algo, target, repo, speculative_tokens, head):
        return [
            "In transformers' own `generate`, through eagle's lossless decoder (`pip install eagle`; the folder's "
            "`custom_generate/`):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            "",
            f'target = AutoModelForCausalLM.from_pretrained("{target}")',
            f'out = target.generate(input_ids, custom_generate="{repo}", trust_remote_code=True, max_new_tokens=128,',
            '                       eagle_head="<this folder, downloaded>")',
            "```",
        ]


class LlamaCppFormat(VLLMFormat):
    """The vLLM folder plus LLAMACPP.md: the commands that convert it to a GGUF draft with llama.cpp's
    converter and serve it, with this machine's paths (or placeholders and the target's Hub id for the Hub)."""

    name = "llamacpp"
    engine = "llama.cpp"
    library = "vllm"  # the files are the vLLM folder; the GGUF is made from them

    def files(self, cfg, folder, target_path, local_paths, dtype, speculative_tokens):
        target = local_target(target_path) if local_paths else portable_target(target_path)
        where = folder if local_paths else "HEAD_DIR"
        return {LLAMACPP_FILE: llamacpp_guide(cfg, where, target, dtype, speculative_tokens)}

    def check_folder(self, head, where):
        if not (where / LLAMACPP_FILE).is_file():
            # Without it the folder is a vLLM folder under another name: the commands are what the format adds.
            raise ExportError(
                f"{where}: a format=llamacpp folder holds {LLAMACPP_FILE} (the convert and serve "
                "commands); re-export it, or check it as the vLLM folder it otherwise is"
            )

    def usage(self, algo, target, repo, speculative_tokens, head):
        return [
            "This folder is the head in vLLM's layout; [LLAMACPP.md](LLAMACPP.md) has the llama.cpp commands "
            "that convert it to a GGUF draft (`convert_hf_to_gguf.py --target-model-dir`) and serve it "
            f"(`llama-server --spec-type {algo.llamacpp_spec_type} --spec-draft-n-max {speculative_tokens}`)."
        ]

    def summary(self, head):
        return [f"  llama.cpp: the convert and llama-server commands are in {head.folder / LLAMACPP_FILE}"]


class TransformersFormat(ExportFormat):
    """A folder transformers' own `generate` runs: for a DFlash head, transformers' DFlash drafter class
    (config and names are the algorithm's: `Algorithm.config_fields` / `export_tensor_name`), loaded by plain
    `AutoModel.from_pretrained` and run with `speculation_type="dflash"` (eagle/export/hf_assistant.py)."""

    name = "transformers"
    engine = "transformers"
    library = "transformers"

    def config(self, cfg, algo, dtype, verifier, speculative_tokens):
        return {
            **algo.config_fields(cfg, self.name),  # the library class's whole config, no Llama layer config
            "architectures": [algo.architectures[self.name]],
            "torch_dtype": dtype,
            EXPORT_META_KEY: export_meta(cfg, self.name),
        }

    def usage(self, algo, target, repo, speculative_tokens, head):
        return [
            "```python",
            "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
            "",
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
            f'target = AutoModelForCausalLM.from_pretrained("{target}")',
            f'drafter = AutoModel.from_pretrained("{repo}")',
            'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,',
            '                                       return_tensors="pt", return_dict=True)',
            'out = target.generate(**inputs, assistant_model=drafter, speculation_type="dflash", max_new_tokens=128)',
            "```",
        ]

    def summary(self, head):
        return [
            f"  transformers: AutoModel.from_pretrained({head.folder}) is its DFlash drafter; "
            'target.generate(..., assistant_model=drafter, speculation_type="dflash")'
        ]


FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (VLLMFormat(), SGLangFormat(), SpeculatorsFormat(), HFFormat(), LlamaCppFormat(), TransformersFormat())
}


def get_format(name: str) -> ExportFormat:
    """The registered format `name`; ExportError naming the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ExportError(f"format={name!r} is not one of {', '.join(FORMATS)}") from None


def check_servable(cfg: HeadConfig, fmt: str) -> None:
    """Refuse (ExportError) a format eagle does not write, or a head that format's engine cannot serve
    (naming each head option and the engine); nothing is read or written before this."""
    get_format(fmt)
    algorithm_of(cfg).check_exportable(cfg, fmt)


def build_config(
    cfg: HeadConfig, fmt: str, dtype: str, verifier: dict[str, Any] | None = None, speculative_tokens: int = 4
) -> dict[str, Any]:
    """config.json for `fmt`, for a head the format's engine serves (else ExportError, `check_servable`).
    `verifier` = {"name_or_path", "architectures"} (formats that name one)."""
    check_servable(cfg, fmt)
    return format_config(cfg, fmt, dtype, verifier, speculative_tokens)


def format_config(
    cfg: HeadConfig, fmt: str, dtype: str, verifier: dict[str, Any] | None = None, speculative_tokens: int = 4
) -> dict[str, Any]:
    """config.json for `fmt` whether or not its engine serves every option of the head: what a folder of
    that format written by eagle holds (validation reads folders that eagle itself can still load)."""
    algo = algorithm_of(cfg)
    if fmt not in algo.export_formats:  # no layout at all (e.g. EAGLE-1 as speculators)
        algo.check_exportable(cfg, fmt)
    return get_format(fmt).config(cfg, algo, dtype, verifier, speculative_tokens)


def format_keys(cfg: HeadConfig, fmt: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Stored name -> (shape, kind) a `fmt` folder for a head of `cfg` must hold, exactly."""
    algo = algorithm_of(cfg)
    spec = algo.format_tensors(expected_tensors(cfg), fmt)
    stored = {algo.export_tensor_name(k, fmt): v for k, v in spec.items()}
    return {**stored, **get_format(fmt).extra_tensors(cfg)}
