"""Hydra multirun (`-m`): one output folder per job, a summary of the sweep, an objective for sweepers.

    eagle-train -m recipe=... train.data_dir=... 'train.lr=1e-4,3e-4' output_dir=outputs/sweep

Job folders: `conf/config.yaml` sets `hydra.sweep.dir=${output_dir}` and
`hydra.sweep.subdir=${eagle_job_dir:}`, so job k writes everything of its stage (resolved config,
checkpoints, reports) into `<output_dir>/<k>_<swept values>`, e.g. `outputs/sweep/0_lr-0.0001`
(`job_dir_name`; only the job number when the swept keys are unknown, e.g. a sweeper's own
search space). `run_app` points the job's `output_dir` there; a single run keeps `output_dir`.
The names hold no `=` or `,`, so they can be passed back to Hydra (`draft.path=outputs/sweep/0_lr-0.0001`).

Records and summary: each job writes `sweep_job.json` into its folder (overrides, status, wall time,
headline figures). After every job, and at the end of the sweep (`SweepCallback`), the sweep root
gets `sweep_summary.md` and `sweep_summary.json` (one row per job of this sweep) and, for training,
`sweep_tau_sim.png` (held-out tau_sim of every job against the step, on one axis).

Failures: a job stopped by an error the user can fix prints its one message and is recorded as
failed; the other jobs still run, and the sweep exits with status 2 after writing the summary. A
training job stopped by SIGINT/SIGTERM saves its checkpoint and ends the sweep (status 0); the same
command resumes every job.

Objective: the task function returns the job's figure of merit, for sweepers that optimise it
(e.g. hydra-optuna-sweeper, direction maximize): eagle-train the best held-out tau_sim, eagle-eval
the measured tau; None when the job failed or has no such figure (a failed trial for Optuna).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from eagle.evaluate.plots import new_figure, save_figure
from eagle.fileio import atomic_write_json, atomic_write_text

try:  # Hydra's callback base class (hydra-core >= 1.1)
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[assignment,misc]

JOB_RECORD = "sweep_job.json"
SUMMARY = "sweep_summary"
PLOT = "sweep_tau_sim.png"
ENV_KEYS = "EAGLE_SWEEP_KEYS"  # JSON list of the swept keys, set by SweepCallback for the jobs
ENV_ID = "EAGLE_SWEEP_ID"  # identifies this sweep's job records among older ones in the same root
_NAME_MAX = 96


# --------------------------------------------------------------------------------------- job folders
def _split_override(text: str) -> tuple[str, str]:
    key, _, value = str(text).partition("=")
    return key.lstrip("+~").split("@", 1)[0], value


def swept_keys(overrides: Sequence[str], params: dict[str, Any] | None = None) -> list[str]:
    """Keys a sweep varies: sweep overrides (`a,b`, `range(...)`, `interval(...)`, `choice(...)`,
    `glob(...)`) on the command line, plus the keys of `hydra.sweeper.params`."""
    keys: list[str] = []
    parser = OverridesParser.create()
    for text in overrides:
        try:
            parsed = parser.parse_overrides([str(text)])[0]
        except Exception:  # Hydra reports bad overrides itself
            continue
        if parsed.is_sweep_override() and parsed.key_or_group not in keys:
            keys.append(parsed.key_or_group)
    for key in params or {}:
        if str(key) not in keys:
            keys.append(str(key))
    return keys


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Last component of each key (`train.lr` -> `lr`) unless two keys share it."""
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (leaf if leaves.count(leaf) == 1 else k) for k, leaf in zip(keys, leaves, strict=True)}


def job_dir_name(num: int | str, overrides: Sequence[str], keys: Sequence[str]) -> str:
    """`<num>_<key>-<value>_...` for the swept keys among a job's overrides, e.g. `0_lr-0.0001`."""
    short = _short_keys(keys)
    parts = [str(num)]
    for text in overrides:
        key, value = _split_override(text)
        if key in short:
            parts.append(f"{short[key]}-{Path(value).name if '/' in value else value}")
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", "_".join(parts))
    return name[:_NAME_MAX].rstrip("-_.") or str(num)


def _env_keys() -> list[str]:
    try:
        keys = json.loads(os.environ.get(ENV_KEYS, "[]"))
    except json.JSONDecodeError:
        return []
    return [str(k) for k in keys] if isinstance(keys, list) else []


def _job_dir_resolver() -> str:
    """`${eagle_job_dir:}`: this job's folder name (resolved by Hydra in the job, see `job_dir_name`)."""
    hc: Any = HydraConfig.get()  # a structured config node, as OmegaConf.select takes it
    num = OmegaConf.select(hc, "job.num", default=0, throw_on_missing=False)
    overrides = list(OmegaConf.select(hc, "overrides.task", default=[]) or [])
    return job_dir_name(0 if num is None else num, overrides, _env_keys())


def register_resolvers() -> None:
    """Register `${eagle_job_dir:}` (idempotent)."""
    if not OmegaConf.has_resolver("eagle_job_dir"):
        OmegaConf.register_new_resolver("eagle_job_dir", _job_dir_resolver)


@dataclass
class Job:
    """A job of a running multirun, as `run_app` sees it."""

    num: int
    overrides: list[str]
    sweep_dir: Path
    output_dir: str
    sweep_id: str | None
    keys: list[str] = field(default_factory=list)


def current_job() -> Job | None:
    """The multirun job this process is running, or None in a single run (or outside Hydra)."""
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = str(hc.sweep.dir)
    return Job(
        num=int(hc.job.num),
        overrides=[str(o) for o in hc.overrides.task],
        sweep_dir=Path(sweep_dir),
        output_dir=os.path.join(sweep_dir, str(hc.sweep.subdir)),
        sweep_id=os.environ.get(ENV_ID),
        keys=_env_keys(),
    )


# --------------------------------------------------------------------------------------- figures
def _num(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _eval_rows(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("split") in ("eval", "eval_untrained"):
                rows.append(rec)
    return rows


def job_figures(stage: str, result: Any, output_dir: str | Path) -> dict[str, Any]:
    """Headline figures of a finished job: training acc@k / tau_sim of the best head (+ the tau_sim
    curve), evaluation tau / speedup."""
    out = Path(output_dir)
    if stage == "train" and result is not None:
        rows = _eval_rows(out)
        best_step = getattr(result, "best_step", None)
        best = next((r for r in rows if r.get("split") == "eval" and r.get("step") == best_step), None)
        metrics = best or dict(getattr(result, "eval_metrics", {}) or {})
        accs = {k: _num(v) for k, v in metrics.items() if re.fullmatch(r"acc_\d+", str(k))}
        return {
            "step": getattr(result, "step", None),
            "stopped": getattr(result, "stopped", None),
            "best_step": best_step,
            "tau_sim": _num(getattr(result, "best_metric", None)),
            "acc": [accs[f"acc_{i}"] for i in range(len(accs)) if f"acc_{i}" in accs],
            "untrained_tau_sim": _num((getattr(result, "initial_eval_metrics", {}) or {}).get("tau_sim")),
            "curve": [[int(r["step"]), _num(r.get("tau_sim"))] for r in rows if _num(r.get("tau_sim")) is not None],
        }
    if stage == "eval" and isinstance(result, dict):
        keys = (
            "tau",
            "speedup",
            "speedup_vs_prompt_lookup",
            "speedup_vs_autoregressive",
            "tokens_per_s",
            "greedy_match",
        )
        # decode.acceptance: an approximate job's row says so (its tau is not a lossless figure).
        return {**{k: _num(result.get(k)) for k in keys}, "acceptance": str(result.get("acceptance", "exact"))}
    return {}


def objective(stage: str, result: Any) -> float | None:
    """What a sweeper maximises: best held-out tau_sim (train), tau (eval); None when the job failed,
    has no such figure, or the stage has none.

    None rather than NaN: hydra-optuna-sweeper 1.3 records a None as a failed trial and goes on,
    while a NaN makes its own failure bookkeeping raise and end the sweep."""
    if stage == "train":
        return _num(getattr(result, "best_metric", None))
    if stage == "eval":
        return _num(result.get("tau")) if isinstance(result, dict) else None
    return None


def write_job_record(
    job: Job, stage: str, status: str, wall_s: float, figures: dict[str, Any] | None = None, error: str | None = None
) -> Path:
    record = {
        "sweep_id": job.sweep_id,
        "num": job.num,
        "stage": stage,
        "dir": job.output_dir,
        "overrides": job.overrides,
        "swept_keys": job.keys,
        "status": status,
        "error": error,
        "wall_s": round(wall_s, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "figures": figures or {},
    }
    path = Path(job.output_dir) / JOB_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    return path


# --------------------------------------------------------------------------------------- summary
def collect_records(sweep_dir: str | Path, sweep_id: str | None = None, max_depth: int = 3) -> list[dict[str, Any]]:
    """Job records under `sweep_dir` (this sweep's only when `sweep_id` is given), by job number."""
    root = Path(sweep_dir)
    found = []
    skip = {"checkpoints", "best", "train", "heldout", "wandb"}
    for folder, dirs, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".") and depth < max_depth]
        if JOB_RECORD in files:
            try:
                rec = json.loads((Path(folder) / JOB_RECORD).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(rec, dict) and (sweep_id is None or rec.get("sweep_id") == sweep_id):
                rec["dir"] = os.path.relpath(folder, root)
                found.append(rec)
    return sorted(found, key=lambda r: (int(r.get("num", 0)), r["dir"]))


def _override_map(rec: dict[str, Any]) -> dict[str, str]:
    return dict(_split_override(o) for o in rec.get("overrides", []))


def _fmt(x: Any, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _wall(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def build_summary(records: list[dict[str, Any]], keys: Sequence[str] = ()) -> dict[str, Any]:
    """The summary object (`sweep_summary.json`): varying and common overrides, rows, the best job."""
    maps = [_override_map(r) for r in records]
    all_keys = [k for m in maps for k in m]
    varying = list(dict.fromkeys([*keys, *(k for k in all_keys if len({m.get(k) for m in maps}) > 1)]))
    varying = [k for k in varying if any(k in m for m in maps)]
    common = {
        k: v for k, v in (maps[0].items() if maps else []) if k not in varying and all(m.get(k) == v for m in maps)
    }
    stage = records[0].get("stage") if records else None
    rows = []
    for rec, m in zip(records, maps, strict=True):
        rows.append(
            {
                "num": rec.get("num"),
                "dir": rec.get("dir"),
                "status": rec.get("status"),
                "error": rec.get("error"),
                "overrides": {k: m.get(k) for k in varying},
                "wall_s": rec.get("wall_s"),
                **rec.get("figures", {}),
            }
        )
    key = {"train": "tau_sim", "eval": "tau"}.get(str(stage))
    scored = [r for r in rows if key and r.get("status") == "ok" and r.get(key) is not None]
    best = max(scored, key=lambda r: r[key]) if scored else None
    return {
        "stage": stage,
        "jobs": len(rows),
        "ok": sum(r["status"] == "ok" for r in rows),
        "failed": sum(r["status"] == "failed" for r in rows),
        "swept_keys": varying,
        "common_overrides": common,
        "objective": key,
        "best": None if best is None else {"num": best["num"], "dir": best["dir"], key: best[key]},
        "rows": rows,
    }


def _row_overrides(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in row["overrides"].items() if v is not None) or "-"


def summary_markdown(summary: dict[str, Any], sweep_dir: str | Path) -> str:
    stage, rows = summary["stage"], summary["rows"]
    lines = [
        f"# Sweep summary: eagle-{stage}, {summary['jobs']} jobs ({summary['ok']} ok, {summary['failed']} failed)",
        "",
        f"Sweep root: `{sweep_dir}`",
    ]
    if summary["common_overrides"]:
        lines.append("Common overrides: " + " ".join(f"`{k}={v}`" for k, v in summary["common_overrides"].items()))
    lines.append("")
    head, body = _TABLES.get(stage, _plain_table)(rows)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    best = summary["best"]
    if best is not None:
        best_row: dict[str, Any] = next((r for r in rows if r["num"] == best["num"]), {})
        lines += [
            "",
            f"Best {summary['objective']}: job {best['num']} (`{best['dir']}`), {best[summary['objective']]:.3f}"
            f"{_approximate(best_row)}.",
        ]
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed jobs:"]
        for r in failed:
            error = str(r.get("error") or "see its log").replace("\n", "\n  ")
            lines.append(f"- job {r['num']} (`{r['dir']}`): {error}")
    if (Path(sweep_dir) / PLOT).is_file() and stage == "train":
        lines += ["", f"![held-out tau_sim per job]({PLOT})"]
    return "\n".join(lines) + "\n"


Table = tuple[list[str], list[list[str]]]


def _train_table(rows: list[dict[str, Any]]) -> Table:
    k = max((len(r.get("acc") or []) for r in rows), default=0)
    head = [
        "job",
        "overrides",
        "status",
        "steps",
        *[f"acc@{i}" for i in range(k)],
        "tau_sim",
        "best step",
        "untrained tau_sim",
        "wall",
    ]
    body = []
    for r in rows:
        accs = r.get("acc") or []
        body.append(
            [
                *_cells(r),
                str(r.get("step", "n/a")),
                *[_fmt(accs[i] if i < len(accs) else None) for i in range(k)],
                _fmt(r.get("tau_sim")),
                str(r.get("best_step", "n/a")),
                _fmt(r.get("untrained_tau_sim")),
                _wall(r.get("wall_s")),
            ]
        )
    return head, body


def _eval_table(rows: list[dict[str, Any]]) -> Table:
    head = [
        "job",
        "overrides",
        "status",
        "tau",
        "speedup",
        "vs prompt lookup",
        "vs autoregressive",
        "tok/s",
        "greedy match",
        "wall",
    ]
    body = [
        [
            *_cells(r),
            _fmt(r.get("tau"), 2) + _approximate(r),
            _fmt(r.get("speedup"), 2) + _approximate(r),
            _fmt(r.get("speedup_vs_prompt_lookup"), 2),
            _fmt(r.get("speedup_vs_autoregressive"), 2),
            _fmt(r.get("tokens_per_s"), 1),
            _fmt(r.get("greedy_match"), 2),
            _wall(r.get("wall_s")),
        ]
        for r in rows
    ]
    return head, body


def _plain_table(rows: list[dict[str, Any]]) -> Table:
    return ["job", "overrides", "status", "wall"], [[*_cells(r), _wall(r.get("wall_s"))] for r in rows]


_TABLES = {"train": _train_table, "eval": _eval_table}  # the stage's own columns; other stages: status and wall


def _approximate(row: dict[str, Any]) -> str:
    """' (APPROXIMATE: typical, not lossless)' for an eval job decoded with an approximate acceptance rule."""
    rule = row.get("acceptance") or "exact"
    return "" if rule == "exact" else f" (APPROXIMATE: {rule}, not lossless)"


def _cells(row: dict[str, Any]) -> list[str]:
    return [f"[{row['num']}]({row['dir']})", _row_overrides(row).replace("|", "\\|"), str(row["status"])]


def plot_curves(summary: dict[str, Any], path: Path) -> Path | None:
    """Held-out tau_sim against the training step, one line per job (train sweeps only)."""
    curves = [(r, r.get("curve") or []) for r in summary["rows"]]
    curves = [(r, c) for r, c in curves if c]
    if summary["stage"] != "train" or not curves:
        return None
    plt = new_figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, curve in curves:
        steps, taus = zip(*curve, strict=True)
        ax.plot(steps, taus, marker="o", markersize=3, label=f"{row['num']}: {_row_overrides(row)}"[:60])
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out tau_sim (simulated acceptance length)")
    ax.set_title(f"{len(curves)} jobs of the sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_summary(
    sweep_dir: str | Path, sweep_id: str | None = None, keys: Sequence[str] = (), plot: bool = True
) -> dict[str, Any] | None:
    """Write `sweep_summary.md` / `.json` (+ the tau_sim plot) for the job records under `sweep_dir`."""
    root = Path(sweep_dir)
    records = collect_records(root, sweep_id)
    if not records:
        return None
    summary = build_summary(records, keys)
    if plot:
        plot_curves(summary, root / PLOT)
    atomic_write_json(root / f"{SUMMARY}.json", {"sweep_dir": str(root), "sweep_id": sweep_id, **summary})
    atomic_write_text(root / f"{SUMMARY}.md", summary_markdown(summary, root))
    return summary


class SweepCallback(Callback):
    """Hydra callback (`hydra.callbacks.sweep_summary` in conf/config.yaml): tells the jobs which
    keys are swept, and writes the summary when the sweep ends (exit status 2 if a job failed)."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False) or []
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
        swept = OmegaConf.to_container(params, resolve=False) if params is not None else None
        os.environ[ENV_KEYS] = json.dumps(
            swept_keys(
                [str(t) for t in task], {str(k): v for k, v in swept.items()} if isinstance(swept, dict) else None
            )
        )
        os.environ[ENV_ID] = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir, os.environ.get(ENV_ID), _env_keys(), plot=True)
        os.environ.pop(ENV_KEYS, None)
        os.environ.pop(ENV_ID, None)
        if summary is None:
            return
        print(summary_markdown(summary, sweep_dir), end="")
        print(f"eagle-sweep: summary in {Path(sweep_dir) / (SUMMARY + '.md')} and {SUMMARY}.json")
        if summary["failed"]:
            print(
                f"eagle-sweep: error: {summary['failed']} of {summary['jobs']} jobs failed (named above)",
                file=sys.stderr,
            )
            sys.exit(2)


__all__ = [
    "Job",
    "SweepCallback",
    "build_summary",
    "collect_records",
    "current_job",
    "job_dir_name",
    "job_figures",
    "objective",
    "register_resolvers",
    "summary_markdown",
    "swept_keys",
    "write_job_record",
    "write_summary",
]
