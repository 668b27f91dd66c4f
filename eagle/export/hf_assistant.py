"""A `format=transformers` DFlash folder as the assistant of transformers' own `generate`, checked first.

`AutoModel.from_pretrained(FOLDER)` alone loads the folder (transformers' `MuseGlimmerAssistantModel`), but
transformers checks nothing about it before decoding: a folder that is no DFlash drafter fails deep inside
`generate` (or loads as some other model with random weights), and a drafter whose target layers the target
lacks indexes past its hidden states. `load_dflash_assistant` refuses both with an `ExportError` naming the
folder and what differs, then loads it; `generate(..., assistant_model=drafter, speculation_type="dflash")`
is then greedy identical to plain `generate` (tests/test_transformers_dflash.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle.algorithms.dflash.transformers_drafter import MODEL_TYPE
from eagle.errors import ExportError
from eagle.export.formats import CONFIG_FILE, EXPORT_META_KEY
from eagle.export.validate import read_json
from eagle.target.structure import text_config


def check_dflash_folder(folder: str | Path, target_config: Any) -> dict[str, Any]:
    """The folder's config.json, once it is transformers' DFlash drafter for a target of `target_config`
    (ExportError naming the folder and the field that differs otherwise)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder (expected a DFlash head exported with format=transformers)")
    config = read_json(folder / CONFIG_FILE)
    if config.get("model_type") != MODEL_TYPE:
        written = (config.get(EXPORT_META_KEY) or {}).get("format")
        hint = f"an eagle format={written} folder; " if written else ""
        raise ExportError(
            f"{folder} is not a DFlash drafter transformers' generate can run (speculation_type='dflash'): "
            f"config.json has model_type={config.get('model_type')!r}, architectures="
            f"{config.get('architectures')}, where {MODEL_TYPE!r} is expected ({hint}export a DFlash head "
            "with eagle-export ... format=transformers)"
        )
    text = text_config(target_config)
    layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
    missing = [j for j in config.get("target_layer_ids") or [] if not 0 <= int(j) < layers]
    if missing:
        raise ExportError(
            f"{folder}: target_layer_ids {missing} name decoder layers the target does not have (it has "
            f"{layers}: 0..{layers - 1}); the head was trained for another target"
        )
    if int(config.get("hidden_size", -1)) != hidden:
        raise ExportError(
            f"{folder}: hidden_size={config.get('hidden_size')} but the target's is {hidden}; "
            "the head was trained for another target"
        )
    if not 0 <= int(config.get("mask_token_id", -1)) < int(text.vocab_size):
        raise ExportError(
            f"{folder}: mask_token_id={config.get('mask_token_id')} is outside the target's vocabulary "
            f"[0, {text.vocab_size}); the head was trained for another target"
        )
    return config


def load_dflash_assistant(folder: str | Path, target: Any) -> Any:
    """transformers' DFlash drafter from `folder`, checked against `target` (a transformers causal LM), on
    the target's device and in its dtype: what `target.generate(assistant_model=...)` takes."""
    # heavy: transformers' model classes load only where a drafter is wanted
    from transformers import AutoModel

    check_dflash_folder(folder, target.config)
    drafter = AutoModel.from_pretrained(str(folder))
    return drafter.to(device=target.device, dtype=target.dtype).eval()
