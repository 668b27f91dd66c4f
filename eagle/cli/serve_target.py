"""`python -m eagle.cli.serve_target`: the vLLM server that `train.mode=stream` trains from, for a recipe.

    python -m eagle.cli.serve_target recipe=smollm2-135m-instruct train.max_length=2048 train.stream.port=8000
    python -m eagle.cli.serve_target ... train.stream.launch=run      # start it here (it runs until stopped)

Prints the exact server command (and the environment it needs): vLLM's OpenAI server with the
`extract_hidden_states` method over the recipe's layers, eagle's hidden-states connector writing to
train.stream.storage_dir, prefix caching off, the recipe's dtype and max_model_len = train.max_length + 1,
and a served name that tells the trainer all of these. Run it on each server machine with the same
recipe and overrides as `eagle-train train.mode=stream`; a server started any other way is refused by
the trainer, naming what differs. The python is capture.vllm_python's (vLLM in its own venv).
"""

from __future__ import annotations

import os
import sys

from eagle.cli.app import run_app
from eagle.config import RootConfig


def run(cfg: RootConfig) -> list[str]:
    """Print (or, with train.stream.launch=run, replace this process with) the recipe's server command."""
    # startup: these load torch and transformers; the entry point composes and checks the config first
    import torch
    from transformers import AutoConfig

    from eagle.capture.vllm_engine import engine_python, target_without_weights
    from eagle.target.precision import DTYPES, resolve_dtype
    from eagle.train.stream.launch import recipe_for, server_command, server_env, shell_line, storage_dir

    here = torch.accelerator.current_accelerator() or torch.device("cpu")
    dtype = resolve_dtype(cfg.target.dtype, here, "train") if cfg.target.dtype == "auto" else DTYPES[cfg.target.dtype]
    tokenizer, info = target_without_weights(cfg.target, dtype)
    del tokenizer
    model_config = AutoConfig.from_pretrained(
        info.resolved, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    recipe = recipe_for(cfg, info, model_config)
    python = engine_python(cfg.capture)
    connector = cfg.capture.vllm_connector
    if connector == "auto":
        connector = "cpu" if here.type == "cpu" else "vllm"
    argv = server_command(cfg, recipe, python, connector)
    env = server_env(python)
    print(
        f"# eagle: vLLM server for train.mode=stream (layers {recipe.layer_ids}, {recipe.dtype}, "
        f"max_model_len {recipe.max_model_len}); states in {storage_dir(cfg)}"
    )
    print(shell_line(argv, env), flush=True)
    if cfg.train.stream.launch == "run":
        storage_dir(cfg).mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        os.execve(argv[0], argv, {**os.environ, **env})
    return argv


def main() -> None:
    run_app("serve_target", run)


if __name__ == "__main__":
    main()
