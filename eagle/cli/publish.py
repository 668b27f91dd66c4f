"""`eagle-publish`: export a trained head with a model card carrying measured figures, upload it.

    eagle-publish draft.path=outputs/run format=vllm publish.repo_id=USER/NAME \
        publish.reports=[outputs/eval-mt_bench,outputs/eval-humaneval] [publish.dry_run=true]

The token comes from HF_TOKEN or `huggingface-cli login`; it is never printed or written.
"""

from __future__ import annotations

from eagle.cli.app import run_app


def _stage(cfg) -> None:
    from eagle.export.publish import run_publish  # startup: loads torch; the config is checked first

    run_publish(cfg)


def main() -> None:
    run_app("publish", _stage)


if __name__ == "__main__":
    main()
