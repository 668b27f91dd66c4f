"""Evaluation prompt sets: MT-Bench, HumanEval (bundled) and local JSONL files.

Used by the eval stage to build prompts and by the data stage to keep evaluation prompts out of
the training data.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from eagle.assets import asset_path
from eagle.errors import DataError


@dataclass
class EvalPrompt:
    id: str
    turns: list[str]  # user turns, in order (MT-Bench has two; HumanEval one)
    category: str | None = None


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
                if not isinstance(row, dict):
                    raise DataError(f"{path}: line {lineno} must be a JSON object, got {type(row).__name__}")
                rows.append((lineno, row))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise DataError(f"evaluation prompt file {path} does not exist") from e
        raise DataError(f"{path}: cannot read ({e})") from e
    return rows


def load_eval_prompts(name: str) -> list[EvalPrompt]:
    """Prompts of `mt_bench`, `humaneval`, or a local PATH.jsonl whose lines are
    `{"id", "turns": [...]}` or `{"id", "prompt"}` (optional "category"), in file order."""
    if name == "mt_bench":
        return [EvalPrompt(str(r["question_id"]), list(r["turns"]), r.get("category"))
                for _, r in _read_jsonl(asset_path("mt_bench"))]
    if name == "humaneval":
        return [EvalPrompt(str(r["task_id"]), [r["prompt"]], "code") for _, r in _read_jsonl(asset_path("humaneval"))]
    path = Path(name).expanduser()
    if path.suffix not in (".jsonl", ".gz"):
        raise DataError(f"evaluation prompts {name!r}: use mt_bench, humaneval or a PATH.jsonl file")
    prompts = []
    for lineno, r in _read_jsonl(path):
        turns = r.get("turns", [r["prompt"]] if "prompt" in r else None)
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(f"{path}: line {lineno} needs 'turns' (a non-empty list of non-empty strings) "
                            "or 'prompt' (a non-empty string)")
        category = r.get("category")
        prompts.append(EvalPrompt(str(r.get("id", lineno)), turns, category if isinstance(category, str) else None))
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise DataError(f"{path}: prompt ids are not unique; give each line a distinct 'id'")
    return prompts
