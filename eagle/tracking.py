"""One tracker for every stage: a tqdm progress bar and console lines always, a local
`metrics.jsonl`, and Weights & Biases when `logger.name=wandb` (off by default).

Only the main process tracks; other ranks get a tracker whose methods do nothing, so callers need
no rank checks. wandb runs are resumable: the run id is kept in `<output_dir>/wandb_run_id`, so a
resumed training run keeps logging into the same wandb run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eagle.config import LoggerConfig
from eagle.errors import EagleError


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class Tracker:
    """Console + progress bar + `metrics.jsonl` (+ wandb). Use as a context manager or call `close()`."""

    def __init__(
        self,
        cfg: LoggerConfig,
        output_dir: str | Path,
        run_config: dict[str, Any] | None = None,
        total: int | None = None,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        jsonl_name: str = "metrics.jsonl",
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.jsonl = self.output_dir / jsonl_name
        self._wandb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Lines logged after `initial` belong to steps that a resumed run will redo: drop them so the
        # file holds each step once.
        if self.jsonl.is_file():
            self._truncate_after(initial)
        self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
        if cfg.name == "wandb":
            self._wandb = self._init_wandb(run_config or {})

    # --- setup ---------------------------------------------------------------------------------
    def _truncate_after(self, step: int) -> None:
        kept = []
        for line in self.jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash
                continue
            if int(rec.get("step", 0)) <= step:
                kept.append(line)
        tmp = self.jsonl.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.jsonl)

    def _init_wandb(self, run_config: dict[str, Any]) -> Any:
        try:
            import wandb  # heavy: wandb (~0.6 s), only for logger=wandb (off by default)
        except ImportError as e:
            raise EagleError("logger=wandb needs the wandb package: pip install wandb") from e
        id_file = self.output_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        try:
            run = wandb.init(
                project=self.cfg.project,
                entity=self.cfg.entity,
                name=self.cfg.run_name,
                config=run_config,
                dir=str(self.output_dir),
                id=run_id,
                resume="allow",
            )
        except Exception as e:  # wandb raises its own types for auth/network problems
            raise EagleError(
                f"wandb.init failed ({e}); run `wandb login`, set WANDB_MODE=offline, or use logger=console"
            ) from e
        if run_id is None:
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(run.id)
            os.replace(tmp, id_file)
        return run

    # --- logging -------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any], step: int, prefix: str = "train", echo: bool = True) -> None:
        """Record `metrics` at `step` as `<prefix>/<name>` (console line, jsonl, wandb)."""
        if not self.enabled:
            return
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in metrics.items()
        }
        rec = {"step": int(step), "split": prefix, **clean}
        with open(self.jsonl, "a") as f:
            # NaN/inf are written as strings so the file stays valid JSON.
            f.write(
                json.dumps(
                    {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
                )
                + "\n"
            )
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in clean.items()}, step=int(step))
        if echo:
            self.write(f"[{prefix} {step}] " + " ".join(f"{k}={_fmt(v)}" for k, v in clean.items()))

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            tqdm.write(message)

    def advance(self, n: int = 1, **postfix: Any) -> None:
        """Move the progress bar; `postfix` values are shown beside it."""
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(n)

    def summary(self, values: dict[str, Any]) -> None:
        """Final values (wandb run summary)."""
        if self._wandb is not None:
            for k, v in values.items():
                self._wandb.summary[k] = v

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
