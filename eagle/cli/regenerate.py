"""`eagle-regenerate`: replace the assistant turns of the selected data with the target's own answers.

Usage: eagle-regenerate [recipe=NAME] data=... regenerate.max_new_tokens=256 [regenerate.temperature=0.7]
       eagle-regenerate ... regenerate.backend=server 'regenerate.servers=[http://127.0.0.1:8000,...]'
         (the target served by vLLM, SGLang, llama-server or `transformers serve`; target.path still names
         it here, for its tokenizer and chat template)
Then train on the output with: data=local data.path=<output_dir>/regenerated.jsonl
"""

from __future__ import annotations

import sys

from eagle.cli.app import run_app
from eagle.config import RootConfig


def regenerate_stage(cfg: RootConfig) -> None:
    # startup: these load torch (seconds); the entry point composes and checks the config first
    from accelerate import PartialState

    from eagle.data.dataset import load_conversations
    from eagle.data.regenerate import default_output, regenerate
    from eagle.data.server import ServerBackend
    from eagle.target.loading import load_target, load_tokenizer
    from eagle.target.resolve import resolve_target_path

    if cfg.regenerate.backend == "server":
        # The servers run the model; here only its tokenizer and chat template render the prompts.
        resolved, fingerprint = resolve_target_path(cfg.target)
        tokenizer = load_tokenizer(cfg.target, resolved)
        target, dtype = ServerBackend(cfg.regenerate), None
    else:
        device = cfg.device or PartialState().device
        target, tokenizer, info = load_target(cfg.target, device=device, stage="regenerate")
        fingerprint, dtype = info.fingerprint, info.dtype
    conversations, stats = load_conversations(cfg.data)
    print(stats.summary(), file=sys.stderr)
    output = default_output(cfg.output_dir, cfg.regenerate)
    regenerate(
        target,
        tokenizer,
        conversations,
        cfg.regenerate,
        output,
        target_fingerprint=fingerprint,
        dtype=dtype,
        data=cfg.data,
    )
    print(f"eagle-regenerate: wrote {output}; train on it with data=local data.path={output}")


def main() -> None:
    run_app("regenerate", regenerate_stage)


if __name__ == "__main__":
    main()
