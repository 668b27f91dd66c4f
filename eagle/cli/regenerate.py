"""`eagle-regenerate`: replace the assistant turns of the selected data with the target's own answers.

Usage: eagle-regenerate [recipe=NAME] data=... regenerate.max_new_tokens=256 [regenerate.temperature=0.7]
       eagle-regenerate ... regenerate.backend=server 'regenerate.servers=[http://127.0.0.1:8000,...]'
         (the target served by vLLM, SGLang, llama-server or `transformers serve`; target.path still names
         it here, for its tokenizer and chat template)
Then train on the output with: data=local data.path=<output_dir>/regenerated.jsonl
"""

from __future__ import annotations

from eagle.cli.app import run_app
from eagle.config import RootConfig


def regenerate_stage(cfg: RootConfig) -> None:
    # startup: loads torch (seconds); the entry point composes and checks the config first
    from eagle.regenerate.runner import run_regenerate

    output = run_regenerate(cfg)
    print(f"eagle-regenerate: wrote {output}; train on it with data=local data.path={output}")


def main() -> None:
    run_app("regenerate", regenerate_stage)


if __name__ == "__main__":
    main()
