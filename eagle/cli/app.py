"""Shared plumbing of the Hydra entry points: config location, composition, error reporting.

Every stage is `run_app(stage_fn)`: Hydra composes `conf/config.yaml` (plus any `recipe=NAME` and
command-line overrides) over the typed schema, the result is validated into a `RootConfig`, the
resolved config is written into `output_dir`, and `stage_fn(cfg)` runs. Errors the user can fix
(`EagleError`) are printed as one message and exit with status 2; a refused run leaves the
`<stage>_config.yaml` of the run already in `output_dir` as it was.

Under Hydra's multirun (`-m`) every job gets its own `output_dir` inside the sweep's, records its
outcome, and returns its figure of merit to the sweeper (`eagle.sweep`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, read_write

from eagle import sweep
from eagle.artifacts import stage_config
from eagle.config import RootConfig, register_configs, to_root_config
from eagle.errors import EagleError
from eagle.fileio import atomic_write_text


def conf_dir() -> Path:
    """The `conf/` folder: $EAGLE_CONF_DIR, else the one beside the `eagle` package (source checkout)."""
    env = os.environ.get("EAGLE_CONF_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / "config.yaml").is_file():
        raise EagleError(f"cannot find the config folder {path}; set EAGLE_CONF_DIR to the repository's conf/")
    return path


def validated(raw: Any) -> RootConfig:
    """The composed config as a `RootConfig`: the schema's checks, then the chosen draft algorithm's."""
    # startup: eagle.algorithms loads torch; only a run that got this far needs it
    from eagle.algorithms import check_config

    return check_config(to_root_config(raw))


def compose(overrides: Sequence[str] = ()) -> RootConfig:
    """Compose and validate the config as an entry point would (for tests and notebooks)."""
    register_configs()
    sweep.register_resolvers()
    GlobalHydra.instance().clear()
    with hydra.initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=list(overrides))
    return validated(cfg)


def save_resolved_config(cfg: RootConfig, stage: str) -> Path:
    """Write the resolved config of a run next to its artifacts: `<output_dir>/<stage>_config.yaml`."""
    out = Path(cfg.output_dir)
    path = out / stage_config(stage)
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    except OSError as e:
        raise EagleError(
            f"output_dir={cfg.output_dir!r} is not writable ({e.strerror or e}); "
            "choose another output_dir or fix its permissions"
        ) from e
    return path


# Storage failures mid-run: every artifact is written atomically, so what exists is valid and the
# same command resumes once the cause is fixed.
_STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a path component is not a folder",
}


def storage_error_message(stage: str, err: OSError) -> str | None:
    """One clear message for a storage failure, or None when `err` is not one."""
    reason = _STORAGE_ERRNOS.get(err.errno or -1)
    if reason is None:
        return None
    where = f" writing {err.filename}" if err.filename else ""
    return (
        f"eagle-{stage}: error: {reason}{where}. Everything written before stays valid (atomic writes); "
        "free space or fix the output location, then run the same command again to resume."
    )


@contextlib.contextmanager
def _config_kept_on_refusal(cfg: RootConfig, stage: str) -> Iterator[None]:
    """Write the run's resolved config; if the stage then refuses (EagleError), put back the one the
    folder held before (the config of the artifacts there, e.g. a run a resume was refused for)."""
    path = Path(cfg.output_dir) / stage_config(stage)
    try:
        previous = path.read_text() if path.is_file() else None
    except OSError:
        previous = None
    save_resolved_config(cfg, stage)
    try:
        yield
    except EagleError:
        if previous is not None:
            with contextlib.suppress(OSError):
                atomic_write_text(path, previous)
        raise


def _finish_job(
    job: sweep.Job,
    stage: str,
    status: str,
    started: float,
    figures: dict[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """Record a multirun job's outcome and refresh the sweep summary (rank 0; best effort on storage)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        sweep.write_job_record(job, stage, status, time.perf_counter() - started, figures, error)
        sweep.write_summary(job.sweep_dir, job.sweep_id, job.keys, plot=False)
    except OSError as e:
        print(f"eagle-{stage}: warning: could not write the sweep record of job {job.num} ({e})", file=sys.stderr)


def _run_stage(stage: str, stage_fn: Callable[[RootConfig], Any], raw: Any) -> Any:
    """One run (or one multirun job) of a stage; returns the job's objective for sweepers."""
    job = sweep.current_job()
    if job is not None:
        with read_write(raw):  # every job of a sweep writes into its own folder
            raw.output_dir = job.output_dir
    started = time.perf_counter()
    try:
        cfg = validated(raw)
        with _config_kept_on_refusal(cfg, stage):
            result = stage_fn(cfg)
    except (EagleError, OSError) as e:
        message = f"eagle-{stage}: error: {e}" if isinstance(e, EagleError) else storage_error_message(stage, e)
        if message is None:  # an OSError that is not a storage failure: a bug, shown with its traceback
            if job is not None:
                _finish_job(job, stage, "failed", started, error=f"{type(e).__name__}: {e}")
            raise
        print(message, file=sys.stderr)
        if job is None:
            sys.exit(2)
        # A sweep goes on with its other jobs; the summary names this one and the sweep exits with 2.
        _finish_job(job, stage, "failed", started, error=message.split(": error: ", 1)[-1])
        return sweep.objective(stage, None)
    except Exception as e:
        if job is not None:
            _finish_job(job, stage, "failed", started, error=f"{type(e).__name__}: {e}")
        raise
    if job is not None:
        stopped = getattr(result, "stopped", None) == "signal"
        _finish_job(
            job,
            stage,
            "stopped" if stopped else "ok",
            started,
            figures=sweep.job_figures(stage, result, cfg.output_dir),
        )
        if stopped:
            print(
                f"eagle-{stage}: sweep stopped by a signal during job {job.num}; its checkpoint is saved. Run the "
                "same command again to resume the sweep (finished jobs are recognised and skipped quickly)",
                file=sys.stderr,
            )
            sys.exit(0)
    return sweep.objective(stage, result)


def run_app(stage: str, stage_fn: Callable[[RootConfig], Any]) -> None:
    """Run `stage_fn` as a Hydra app composed from `conf/` (single run, or one job of a multirun)."""
    register_configs()
    sweep.register_resolvers()

    @hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
    def _main(raw: Any) -> Any:
        return _run_stage(stage, stage_fn, raw)

    _main()
