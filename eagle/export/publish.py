"""`eagle-publish`: exported head + model card with measured figures -> a Hugging Face model repo.

The Hub folder is `<output_dir>/hub/`: the export of `draft.path` in `format`, plus README.md
whose YAML metadata names the target as base_model, and whose body carries the figures of the
`eagle-eval` reports given in `publish.reports` and the training provenance read from the run's
train_config.yaml (and the capture manifest, when present). The token comes from the environment
(HF_TOKEN) or huggingface_hub's stored login; it is never printed, logged or written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import HfApi
from omegaconf import OmegaConf

from eagle.artifacts import CAPTURE_CONFIG, MANIFEST, REPORT, TRAIN_CONFIG, regeneration_meta
from eagle.config import ACCEPTANCE_RULES
from eagle.decode.approximate import acceptance_label
from eagle.errors import EagleError
from eagle.export.exporter import resolve_head_source, served_chain_length, trained_target_path, write_export
from eagle.export.formats import SPECULATORS_EMBED, algorithm_of, hub_id_for_target
from eagle.export.registry import get_format
from eagle.export.validate import ExportedHead, check_folder

log = logging.getLogger(__name__)

# Bundled / well-known data sources -> the Hub data set they come from.
DATASET_IDS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}


class PublishError(EagleError):
    """A report, training record or Hub operation needed for publishing is missing or failed."""


def load_report(path: str | Path) -> dict[str, Any]:
    """An `eagle-eval` report: a report.json file or the eval output dir holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / REPORT
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise PublishError(f"publish.reports: {p} not found (give eagle-eval output dirs or report.json files)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise PublishError(f"publish.reports: {p} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or "tau" not in data:
        raise PublishError(f"publish.reports: {p} is not an eagle-eval report (no 'tau' field)")
    _check_acceptance(data, p)
    return data


def _check_acceptance(report: dict[str, Any], path: Path) -> None:
    """Refuse a report whose acceptance fields contradict each other, so that an approximate run can never
    be published as an exact one. A report without them predates approximate rules: exact."""
    rule = report.get("acceptance", "exact")
    settings = report.get("acceptance_settings") or {"rule": rule}
    shift = report.get("distribution_shift") or {}
    problem = None
    if rule not in ACCEPTANCE_RULES:
        problem = f"acceptance={rule!r} is not one of {', '.join(ACCEPTANCE_RULES)}"
    elif report.get("lossless", rule == "exact") != (rule == "exact"):
        problem = f"acceptance={rule} but lossless={report.get('lossless')} (only exact acceptance is lossless)"
    elif settings.get("rule") != rule:
        problem = f"acceptance={rule} but acceptance_settings name {settings.get('rule')!r}"
    elif rule == "exact" and (shift.get("tv") or shift.get("kl") or shift.get("kl_infinite")):
        problem = f"acceptance=exact but a distribution shift of TV {shift.get('tv')} (exact acceptance has none)"
    if problem:
        raise PublishError(
            f"publish.reports: {path}: {problem}; the report was edited or is corrupt: run eagle-eval again"
        )


def _fmt(x: Any, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def dtype_text(settings: dict[str, Any]) -> str:
    """'bfloat16', or 'float32 (head bfloat16, int8)' when the head computed otherwise than the target."""
    dtype = str(settings.get("dtype") or "n/a")
    head = settings.get("draft_dtype") or dtype
    weights = settings.get("draft_weights") or "full"
    if head == dtype and weights == "full":
        return dtype
    return f"{dtype} (head {head}{', ' + weights.replace('_', ' ') if weights.startswith('int8') else ''})"


def _value_text(x: Any) -> str:
    """A setting's value as card text: floats as in the figures, lists and tuples as [a, b, ...]."""
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_value_text(v) for v in x) + "]"
    return _fmt(x)


def machine_of(report: dict[str, Any]) -> str:
    """The machine a report's timings were measured on, as a card heading: the accelerator or CPU model, the
    CPU flags where the report records them (hardware.cpu_flags), cores, torch threads, a non-CPU device."""
    hw = (report.get("settings") or {}).get("hardware")
    if isinstance(hw, str) or not hw:  # a hand-written string, or a report that recorded none
        return hw or "machine not recorded"
    accelerator, cpu = hw.get("accelerator"), hw.get("cpu")
    flags = hw.get("cpu_flags")
    parts = [
        accelerator,
        f"host {cpu}" if accelerator and cpu else cpu,
        " ".join(flags) if isinstance(flags, (list, tuple)) and flags else None,
        f"{hw['cpu_count']} cores" if hw.get("cpu_count") else None,
        f"{hw['torch_threads']} torch threads" if hw.get("torch_threads") else None,
        f"device {hw['device']}" if hw.get("device") not in (None, "cpu") else None,
    ]
    return ", ".join(str(p) for p in parts if p) or "machine not recorded"


def decoder_settings(report: dict[str, Any]) -> dict[str, str]:
    """What a report's figures depend on besides the machine and the prompts, name -> text, in card order.
    A card prints the settings every row of a machine shares once above its table, the others in the rows."""
    s = report.get("settings") or {}
    hw: dict[str, Any] = s["hardware"] if isinstance(s.get("hardware"), dict) else {}
    out = {
        "acceptance": acceptance_label(report.get("acceptance_settings") or report.get("acceptance"))
        or "exact (lossless)",
        "dtype": dtype_text(s) if s.get("dtype") else "n/a",  # the target's (every method alike), and the head's
        "cpu_gemm": _fmt(s.get("cpu_gemm")),
        **{k: _fmt(s.get(k)) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "turns")},
    }
    tree = s.get("tree")
    # One setting per tree key, so that rows differing only in e.g. draft_choice share the rest of the tree.
    out.update({str(k): _value_text(v) for k, v in tree.items()} if isinstance(tree, dict) else {"tree": _fmt(tree)})
    out["prompt_lookup_num_tokens"] = _fmt(s.get("prompt_lookup_num_tokens"))  # the HF prompt-lookup baseline's
    out["torch"], out["transformers"] = _fmt(hw.get("torch_version")), _fmt(hw.get("transformers_version"))
    return out


def _tokens_per_s_text(report: dict[str, Any]) -> str:
    spec, base = report.get("tokens_per_s"), report.get("baseline_tokens_per_s")
    return "n/a" if spec is None and base is None else f"{_fmt(spec, digits=1)} ({_fmt(base, digits=1)})"


# The figures of a row: (header, right-aligned, cell). A column that is n/a in every row of a table is
# left out of it; tau, speedup and the greedy output are always shown.
FIGURES: list[tuple[str, bool, Any]] = [
    ("tau", True, lambda r: _fmt(r.get("tau"))),
    (
        "acceptance by depth",
        False,
        lambda r: " / ".join(f"{x:.2f}" for x in r.get("accept_rate_by_depth") or []) or "n/a",
    ),
    ("tok/s (HF generate)", True, _tokens_per_s_text),
    ("speedup vs HF generate", True, lambda r: _fmt(r.get("speedup"), suffix="x")),
    ("vs prompt lookup", True, lambda r: _fmt(r.get("speedup_vs_prompt_lookup"), suffix="x")),
    ("vs autoregressive", True, lambda r: _fmt(r.get("speedup_vs_autoregressive"), suffix="x")),
    (
        "tokens from grafted lookup nodes",
        True,
        lambda r: "n/a" if r.get("lookup_accepted_share") is None else f"{r['lookup_accepted_share']:.0%}",
    ),
    ("greedy output", False, lambda r: _lossless_text(r)),
]
ALWAYS_SHOWN = {"tau", "speedup vs HF generate", "greedy output"}


def figures_tables(reports: list[dict[str, Any]], sources: list[str] | None = None) -> list[str]:
    """Card lines: one `### <machine>` subsection per machine (in the order the reports were given), a line of
    the settings every row there shares, then a table whose rows carry the prompts, the settings that differ
    between them and the figures. `sources`: each report's file name, for a last column."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        groups.setdefault(machine_of(r), []).append(i)
    lines: list[str] = []
    for machine, idx in groups.items():
        settings = [decoder_settings(reports[i]) for i in idx]
        names = list(dict.fromkeys(k for s in settings for k in s))
        shared = [k for k in names if len({s.get(k, "n/a") for s in settings}) == 1]
        differing = [k for k in names if k not in shared]
        line = ", ".join(f"{k}={settings[0][k]}" for k in shared if settings[0][k] != "n/a")
        figures = [(h, right, [cell(reports[i]) for i in idx]) for h, right, cell in FIGURES]
        figures = [f for f in figures if f[0] in ALWAYS_SHOWN or any(c != "n/a" for c in f[2])]
        header = ["benchmark", "prompts", *differing, *(h for h, _, _ in figures)]
        align = ["---", "---:", *("---" for _ in differing), *("---:" if right else "---" for _, right, _ in figures)]
        if sources:
            header.append("report")
            align.append("---")
        lines += [
            "",
            f"### {machine}",
            "",
            f"Settings of every row below: {line or 'none recorded'}.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(align) + "|",
        ]
        for n, i in enumerate(idx):
            r, s = reports[i], settings[n]
            label = acceptance_label(r.get("acceptance_settings") or r.get("acceptance"))
            # An approximate rule's figures are never shown without its label: the row's first cell carries it.
            cells = [
                str((r.get("settings") or {}).get("prompts", "n/a")) + (f" **[{label}]**" if label else ""),
                _fmt(r.get("num_prompts")),
                *(s.get(k, "n/a") for k in differing),
                *(column[n] for _, _, column in figures),
            ]
            if sources:
                cells.append(f"`{sources[i]}`")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _lossless_text(report: dict[str, Any]) -> str:
    """What the report says about losslessness: greedy equality with HF generate, and for the turns
    that differ whether every divergence is numeric (a near-tie of the target's own logits). An
    approximate rule: NOT lossless, its measured shift, and the greedy match as a plain figure."""
    match = report.get("greedy_match")
    if report.get("acceptance", "exact") != "exact":
        shift = report.get("distribution_shift") or {}
        kl = "inf" if shift.get("kl") is None else _fmt(shift.get("kl"), digits=4)
        text = (
            f"NOT lossless ({report['acceptance']} acceptance): emitted law vs the target's TV "
            f"{_fmt(shift.get('tv'), digits=4)}, KL {kl}"
        )
        return text + (f"; greedy equal to HF generate on {match:.0%} of turns" if match is not None else "")
    if match is None:
        return "sampled (no greedy comparison)"
    d = report.get("divergence") or {}
    turns = d.get("turns") or report.get("num_turns")
    diverged = d.get("divergent_turns")
    if turns is None or diverged is None:
        return f"greedy equal to HF generate on {match:.0%} of turns"
    text = f"{turns - diverged} of {turns} identical"
    if diverged:
        kind = "all numeric" if d.get("all_numeric") else "NOT all numeric"
        text += f"; {diverged} diverge, {kind} (max fp32 margin {_fmt(d.get('max_margin'))})"
    return text


def _read_yaml(path: Path) -> dict[str, Any] | None:
    """A resolved stage config as a dict (None if absent or unreadable: it must not block publishing)."""
    if not path.is_file():
        return None
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # type: ignore[return-value]
    except Exception as e:
        log.warning("cannot read %s: %s", path, e)
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("cannot read %s: %s", path, e)
        return None


# train.* settings a card names (the ones that change what the head learns).
_CARD_TRAIN_KEYS = (
    "mode",
    "max_steps",
    "batch_size",
    "lr",
    "ttt_steps",
    "ttt_decay",
    "warmup_steps",
    "schedule",
    "min_lr_ratio",
    "mixed_precision",
    "seed",
    "init_from",
)


def training_provenance(train_dir: Path | None) -> dict[str, Any]:
    """What produced the head: selected fields of train_config.yaml, and for an offline run the data
    as the capture recorded it (capture manifest + capture_config.yaml; the regeneration settings
    when the captured file was written by `eagle-regenerate`)."""
    if train_dir is None:
        return {}
    tc = _read_yaml(train_dir / TRAIN_CONFIG)
    if tc is None:
        return {}
    data, draft, train = tc.get("data", {}), tc.get("draft", {}), tc.get("train", {})
    out: dict[str, Any] = {
        "target": (tc.get("target") or {}).get("path"),
        "data_source": data.get("source"),
        "data_path": data.get("path"),
        "max_conversations": data.get("max_conversations"),
        "max_length": data.get("max_length"),
        "algorithm": draft.get("algorithm"),
        "aux_layer_ids": draft.get("aux_layer_ids"),
        "draft_vocab_size": draft.get("draft_vocab_size"),
        "train": {
            k: train.get(k) for k in _CARD_TRAIN_KEYS if k in train and not (k == "init_from" and train[k] is None)
        },
    }
    data_dir = Path(str(train["data_dir"])) if train.get("data_dir") else None
    capture_args = _capture_provenance(out, data_dir, train) if data_dir is not None else None
    _regeneration_provenance(out)
    _commands(out, draft, capture_args)
    return out


def _capture_provenance(out: dict[str, Any], data_dir: Path, train: dict[str, Any]) -> list[str] | None:
    """The capture's record (its manifest's scalars and totals) into `out`; offline from a capture that
    recorded its data, that data replaces this run's data.* (unused offline). Returns the capture command's
    extra arguments then, None when the run is not such an offline run."""
    m = _read_json(data_dir / MANIFEST)
    if m is None:
        return None
    out["capture"] = {
        k: v
        for k, v in m.items()
        if isinstance(v, (int, float, str, bool)) and not str(k).lower().endswith(("path", "dir", "file"))
    }
    totals, splits = m.get("totals") or {}, m.get("splits") or {}
    for key in ("conversations", "tokens"):
        if isinstance(totals.get(key), int):
            out["capture"][key] = totals[key]
        if isinstance((splits.get("train") or {}).get(key), int):
            out["capture"][f"train_{key}"] = splits["train"][key]
    captured = (m.get("data") or {}).get("config")
    if train.get("mode", "offline") != "offline" or not isinstance(captured, dict):
        return None
    out.update(
        data_source=captured.get("source"),
        data_path=captured.get("path"),
        max_conversations=captured.get("max_conversations"),
        max_length=captured.get("max_length"),
    )
    args = []
    dtype = ((_read_yaml(data_dir / CAPTURE_CONFIG) or {}).get("target") or {}).get("dtype")
    if dtype:
        out["capture"]["target_dtype"] = dtype
        args.append(f"target.dtype={dtype}")
    return args


def _regeneration_provenance(out: dict[str, Any]) -> None:
    """A local data file written by `eagle-regenerate`: its settings and the prompts' source; the path is cut
    to its name (a local path says nothing on another machine)."""
    if out["data_source"] != "local" or not out["data_path"]:
        return
    meta = _read_json(regeneration_meta(out["data_path"]))
    if meta is not None:
        keys = ("dtype", "temperature", "max_new_tokens", "max_turns", "max_prompt_tokens")
        out["regenerated"] = {k: meta[k] for k in keys if k in meta}
        src = meta.get("data") or {}
        out["regenerated"]["from"] = src.get("source")
        out["regenerated"]["dedup_against"] = src.get("dedup_against")
    out["data_path"] = Path(str(out["data_path"])).name


def _commands(out: dict[str, Any], draft: dict[str, Any], capture_args: list[str] | None) -> None:
    """The command(s) that reproduce the head: eagle-capture then eagle-train (offline from a capture that
    recorded its data), else one eagle-train."""
    data_args = [f"target.path={out['target']}"] if out["target"] else []
    if out["data_source"]:
        data_args.append(f"data={out['data_source']}")
    if out["data_path"]:
        data_args.append(f"data.path={out['data_path']}")
    for key in ("max_conversations", "max_length"):
        if out.get(key) is not None:
            data_args.append(f"data.{key}={out[key]}")
    head_args = []
    if out["algorithm"]:
        head_args.append(f"draft.algorithm={out['algorithm']}")
    if out["aux_layer_ids"]:
        head_args.append(f"draft.aux_layer_ids=[{','.join(str(i) for i in out['aux_layer_ids'])}]")
    if "draft_vocab_size" in draft:
        size = draft["draft_vocab_size"]
        head_args.append(f"draft.draft_vocab_size={size if size is not None else 'null'}")
    train_args = [f"train.{k}={v}" for k, v in out["train"].items() if v is not None]
    if capture_args is not None:
        out["capture_command"] = " ".join(
            ["eagle-capture", *data_args, *head_args, *capture_args, "output_dir=CAPTURE_DIR"]
        )
        out["command"] = " ".join(
            ["eagle-train", *data_args[:1], *head_args, *train_args, "train.data_dir=CAPTURE_DIR"]
        )
    else:
        out["command"] = " ".join(["eagle-train", *data_args, *head_args, *train_args])


def model_card(
    head: ExportedHead,
    fmt: str,
    target: str,
    license: str,
    reports: list[dict[str, Any]],
    provenance: dict[str, Any],
    repo_id: str | None,
    notes: str | None = None,
    speculative_tokens: int = 4,
    sources: list[str] | None = None,
) -> str:
    """README.md: YAML metadata + usage + measured figures (grouped by machine; `sources` names each report's
    file in its row) + how it was made."""
    lines = [
        "---",
        yaml.safe_dump(_card_metadata(head, fmt, target, license, provenance), sort_keys=False).strip(),
        "---",
        "",
        *_card_head(head, fmt, target),
        "",
        "## Usage",
        "",
    ]
    lines += get_format(fmt).usage(algorithm_of(head.config), target, repo_id or "<repo-id>", speculative_tokens, head)
    lines += [
        "",
        "With `eagle` itself (any format):",
        "",
        "```bash",
        f"eagle-eval target.path={target} draft.path=PATH_TO_THIS_REPO",
        "```",
        "",
        "## Measured figures",
        "",
    ]
    lines += _card_figures(reports, sources)
    lines += _card_training(provenance, notes)
    return "\n".join(lines) + "\n"


def _card_metadata(
    head: ExportedHead, fmt: str, target: str, license: str, provenance: dict[str, Any]
) -> dict[str, Any]:
    """The card's YAML block: base model, library, license, tags and the data set the prompts came from."""
    data_source = provenance.get("data_source")
    datasets = []
    if data_source == "hub" and provenance.get("data_path"):
        datasets.append(str(provenance["data_path"]))
    elif data_source in DATASET_IDS:
        datasets.append(DATASET_IDS[data_source])
    elif (provenance.get("regenerated") or {}).get("from") in DATASET_IDS:  # the prompts' source
        datasets.append(DATASET_IDS[provenance["regenerated"]["from"]])
    meta: dict[str, Any] = {
        "base_model": target,
        "library_name": get_format(fmt).library,
        "license": license,
        "pipeline_tag": "text-generation",
        "tags": ["eagle", head.config.algorithm, "speculative-decoding", "draft-model", fmt],
    }
    if datasets:
        meta["datasets"] = datasets
    return meta


def _card_head(head: ExportedHead, fmt: str, target: str) -> list[str]:
    """Title, one sentence and the head's shape."""
    c = head.config
    algo = algorithm_of(c).title
    dtypes = ", ".join(
        sorted({str(t.dtype).replace("torch.", "") for t in head.tensors.values() if t.is_floating_point()})
    )
    lines = [
        f"# {algo} draft head for {target}",
        "",
        f"A speculative-decoding draft head ({algo}) for [{target}](https://huggingface.co/{target}), "
        f"trained and exported with `eagle` (format `{fmt}`, dtype {dtypes}).",
        "",
        f"- hidden size {c.hidden_size}, {c.num_attention_heads} attention heads ({c.num_key_value_heads} KV), "
        f"intermediate {c.intermediate_size}, one decoder layer",
        f"- target vocabulary {c.vocab_size}, draft vocabulary {c.draft_vocab_size}",
    ]
    if c.aux_layer_ids:
        lines.append(f"- target feature layers (input of decoder layer i): {c.aux_layer_ids}")
    return lines


def _card_figures(reports: list[dict[str, Any]], sources: list[str] | None) -> list[str]:
    """What the figures mean, and one table per machine."""
    if not reports:
        return ["No evaluation reports were attached (publish.reports); run `eagle-eval` and republish."]
    lines = [
        "tau = tokens emitted per target forward (accepted + bonus). Speedup = tokens/s ratio against "
        "HF transformers generate (PyTorch eager) on the same machine (and plain autoregressive decoding "
        "with the same code); not against a serving engine.",
        "",
    ]
    if any(r.get("acceptance", "exact") != "exact" for r in reports):
        lines += [
            "**Rows marked APPROXIMATE were decoded with an approximate acceptance rule (`decode.acceptance`): "
            "their output does not follow the target's distribution, so their tau and speedup are not "
            "lossless figures. Each such row gives the measured shift of the emitted law (TV, KL).**",
            "",
        ]
    lines += [
        "Acceptance by depth: the share of steps that reach depth d whose token at depth d is accepted. "
        "Greedy runs compare every output with HF `generate` in the same dtype; a divergence is numeric "
        "when the target's top-1 / top-2 logit margin there (recomputed in float32) is below the report's "
        "limit. One table per machine (the report's hardware); the line above a table gives the settings "
        "every row of it shares, the rows the settings that differ between them."
    ]
    return lines + figures_tables(reports, sources)


def _card_training(provenance: dict[str, Any], notes: str | None) -> list[str]:
    """How the head was made: data, self-distillation, capture, training, the commands; notes."""
    lines = ["", "## Training", ""]
    if provenance:
        lines.append(
            f"- data: {provenance.get('data_source')}"
            + (f" ({provenance['data_path']})" if provenance.get("data_path") else "")
            + (
                f", up to {provenance['max_conversations']} conversations"
                if provenance.get("max_conversations")
                else ""
            )
            + (f", max {provenance['max_length']} tokens" if provenance.get("max_length") else "")
        )
        if provenance.get("regenerated"):
            r = provenance["regenerated"]
            lines.append(
                "- self-distilled: the answers are the target's own (`eagle-regenerate` from "
                f"{r.get('from')} prompts; " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "from") + ")"
            )
        if provenance.get("capture"):
            lines.append("- capture: " + ", ".join(f"{k}={v}" for k, v in sorted(provenance["capture"].items())))
        if provenance.get("train"):
            lines.append("- training: " + ", ".join(f"{k}={v}" for k, v in provenance["train"].items()))
        if provenance.get("capture_command"):
            lines += [
                "",
                "Commands (reconstructed from the capture's and the run's resolved configs):",
                "",
                "```bash",
                provenance["capture_command"],
                provenance["command"],
                "```",
            ]
        else:
            lines += [
                "",
                "Command (reconstructed from the run's resolved train_config.yaml):",
                "",
                "```bash",
                provenance["command"],
                "```",
            ]
    else:
        lines.append("Training records (train_config.yaml) were not found next to the head.")
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    return lines


def run_publish(cfg: Any) -> Path:
    """The `eagle-publish` stage; returns the Hub folder (uploaded unless publish.dry_run)."""
    p = cfg.publish
    get_format(cfg.format)  # a name eagle writes, before anything is read
    if not cfg.draft.path:
        raise PublishError("draft.path is required: the training output dir (or head / exported folder) to publish")
    if not p.dry_run and not p.repo_id:
        raise PublishError("publish.repo_id=USER/NAME is required to upload (or set publish.dry_run=true)")
    src, train_dir = resolve_head_source(cfg.draft.path)
    source = check_folder(src)
    target_path = trained_target_path(train_dir) or cfg.target.path
    target = hub_id_for_target(target_path)
    reports = [load_report(r) for r in p.reports]
    notes = None
    if p.notes:
        try:
            notes = Path(p.notes).read_text()
        except OSError as e:
            raise PublishError(
                f"publish.notes={p.notes}: cannot read it ({e}); give a Markdown file or drop the option"
            ) from e
    provenance = training_provenance(train_dir)
    hub = Path(cfg.output_dir) / "hub"
    # The card describes the validated export, so it is written after it (atomically, like the weights).
    # A published repo names the verifier by its Hub id unless export.verifier says otherwise.
    chain = served_chain_length(cfg, source.config)  # the config's and the card's num_speculative_tokens: one number
    head = write_export(
        source.config,
        source.tensors,
        hub,
        cfg.format,
        cfg.export.dtype,
        target_path=target_path,
        speculative_tokens=chain,
        verifier=cfg.export.verifier,
        verifier_default="hub",
        local_paths=False,
        embed_tokens=source.borrowed.get(SPECULATORS_EMBED),
    )
    # A row names its report by the file or folder name given, never by this machine's path.
    sources = [Path(str(r)).name for r in p.reports]
    card = model_card(
        head,
        cfg.format,
        target,
        p.license,
        reports,
        provenance,
        p.repo_id,
        notes,
        speculative_tokens=chain,
        sources=sources,
    )
    tmp = hub / "README.md.tmp"
    tmp.write_text(card)
    tmp.replace(hub / "README.md")
    if p.dry_run:
        print(f"eagle-publish: dry run, Hub folder written to {hub} (nothing uploaded)")
        return hub
    api = HfApi()  # token: HF_TOKEN or the stored login, resolved inside huggingface_hub
    try:
        api.create_repo(repo_id=p.repo_id, private=p.private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=p.repo_id, folder_path=str(hub), commit_message=p.commit_message, repo_type="model")
    except Exception as e:  # huggingface_hub raises many HTTP/auth types; its messages never hold the token
        raise PublishError(
            f"uploading {hub} to {p.repo_id} failed: {type(e).__name__}: {e}. Check that HF_TOKEN "
            "(or `huggingface-cli login`) grants write access to that repo"
        ) from e
    print(f"eagle-publish: uploaded {hub} to https://huggingface.co/{p.repo_id}")
    return hub
