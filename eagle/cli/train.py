"""`eagle-train`: train a draft head on a capture (offline) or with the target in the loop (online).

    eagle-train target.path=... train.mode=offline train.data_dir=CAPTURE_DIR train.max_steps=N \\
        output_dir=PATH draft.algorithm=eagle1|eagle3
    eagle-train train.mode=online data=local data.path=FILE ...         # features computed per batch
    accelerate launch --num_processes 8 -m eagle.cli.train ...           # data parallel (DDP)

The output dir holds checkpoints/ (resumable: run the same command again), best/ (the head later
stages load) and metrics.jsonl. SIGINT/SIGTERM finish the current step, save and exit with status 0.
"""

from __future__ import annotations

from eagle.cli.app import run_app
from eagle.config import RootConfig
from eagle.errors import EagleError


def run(cfg: RootConfig):
    """Train per `cfg`, print the summary; returns the `TrainResult` (its best tau_sim is a sweep's objective)."""
    # startup: these load torch (seconds); the entry point composes and checks the config first
    from accelerate.state import PartialState

    from eagle.export.loader import load_draft
    from eagle.train.trainer import TrainHooks, format_result, train

    # train.init_from may name an exported folder (e.g. a published head); the trainer alone reads saved heads.
    result = train(cfg, TrainHooks(load_init=lambda path, target: load_draft(path, target)[0]))
    if PartialState().is_main_process:
        print(format_result(result))
    if result.stopped == "nonfinite":
        raise EagleError(
            f"stopped on a non-finite loss or gradient after step {result.step} (train.nonfinite=stop); the last "
            f"good state is saved in {result.last_checkpoint}. Lower train.lr / raise train.warmup_steps, check "
            "the conversations named above, or resume with train.nonfinite=skip"
        )
    return result


def main() -> None:
    run_app("train", run)


if __name__ == "__main__":
    main()
