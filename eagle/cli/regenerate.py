"""`eagle-regenerate`: replace the assistant turns of the selected data with the target's own answers.

Usage: eagle-regenerate [recipe=NAME] data=... regenerate.max_new_tokens=256 [regenerate.temperature=0.7]
Then train on the output with: data=local data.path=<output_dir>/regenerated.jsonl
"""

from __future__ import annotations

import sys

from eagle.cli.app import run_app
from eagle.config import RootConfig


def regenerate_stage(cfg: RootConfig) -> None:
    from accelerate import PartialState

    from eagle.data.dataset import load_conversations
    from eagle.data.regenerate import default_output, regenerate
    from eagle.targets import load_target

    device = cfg.device or PartialState().device
    model, tokenizer, info = load_target(cfg.target, device=device, stage="regenerate")
    conversations, stats = load_conversations(cfg.data)
    print(stats.summary(), file=sys.stderr)
    output = default_output(cfg.output_dir, cfg.regenerate)
    regenerate(model, tokenizer, conversations, cfg.regenerate, output, target_fingerprint=info.fingerprint, dtype=info.dtype,
               data=cfg.data)
    print(f"eagle-regenerate: wrote {output}; train on it with data=local data.path={output}")


def main() -> None:
    run_app("regenerate", regenerate_stage)


if __name__ == "__main__":
    main()
