"""Shared plumbing of the Hydra entry points: config location, composition, error reporting.

Every stage is `run_app(stage_fn)`: Hydra composes `conf/config.yaml` (plus any `recipe=NAME` and
command-line overrides) over the typed schema, the result is validated into a `RootConfig`, the
resolved config is written into `output_dir`, and `stage_fn(cfg)` runs. Errors the user can fix
(`EagleError`) are printed as one message and exit with status 2.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

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


def compose(overrides: Sequence[str] = ()) -> RootConfig:
    """Compose and validate the config as an entry point would (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    return to_root_config(cfg)


def save_resolved_config(cfg: RootConfig, stage: str) -> Path:
    """Write the resolved config of a run next to its artifacts: `<output_dir>/<stage>_config.yaml`."""
    out = Path(cfg.output_dir)
    path = out / f"{stage}_config.yaml"
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    except OSError as e:
        raise EagleError(f"output_dir={cfg.output_dir!r} is not writable ({e.strerror or e}); "
                         "choose another output_dir or fix its permissions") from e
    return path


# Storage failures mid-run: every artifact is written atomically, so what exists is valid and the
# same command resumes once the cause is fixed.
_STORAGE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                   errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                   errno.EPERM: "operation not permitted", errno.ENOTDIR: "a path component is not a folder"}


def storage_error_message(stage: str, err: OSError) -> str | None:
    """One clear message for a storage failure, or None when `err` is not one."""
    reason = _STORAGE_ERRNOS.get(err.errno or -1)
    if reason is None:
        return None
    where = f" writing {err.filename}" if err.filename else ""
    return (f"eagle-{stage}: error: {reason}{where}. Everything written before stays valid (atomic writes); "
            "free space or fix the output location, then run the same command again to resume.")


def run_app(stage: str, stage_fn: Callable[[RootConfig], Any]) -> None:
    """Run `stage_fn` as a Hydra app composed from `conf/`."""
    import hydra

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
    def _main(raw: Any) -> None:
        try:
            cfg = to_root_config(raw)
            save_resolved_config(cfg, stage)
            stage_fn(cfg)
        except EagleError as e:
            print(f"eagle-{stage}: error: {e}", file=sys.stderr)
            sys.exit(2)
        except OSError as e:
            message = storage_error_message(stage, e)
            if message is None:
                raise
            print(message, file=sys.stderr)
            sys.exit(2)

    _main()
