"""Evaluation prompt sets: MT-Bench, HumanEval, HumanEval behind long files (bundled) and local JSONL files.

Used by the eval stage to build prompts and by the data stage to keep evaluation prompts out of
the training data.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle.assets import asset_path
from eagle.data.images import resolve_image
from eagle.errors import DataError


@dataclass
class EvalPrompt:
    id: str
    turns: list[str]  # user turns, in order (MT-Bench has two; HumanEval one)
    category: str | None = None
    # Images of the first turn (a vision-language target), resolved paths or data URLs; each `<image>` in that
    # turn's text stands for the next one, the others go before its text (eagle.data.images).
    images: list[str] = field(default_factory=list)


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


# humaneval_long: the file lengths (characters) before the problem, cycled over the problems. With SmolLM2's
# tokenizer these are from just over 1K to over 8K tokens of context (about 3 characters of this code a token).
LONG_FILE_CHARS = (4_000, 8_000, 16_000, 26_000)


def humaneval_long(file_chars: tuple[int, ...] = LONG_FILE_CHARS) -> list[EvalPrompt]:
    """Each HumanEval problem at the end of a long Python file: the problems after it (wrapping around)
    with their reference solutions, until the file holds `file_chars[i % len]` characters. Held out as
    HumanEval is (training data is deduplicated against it); acceptance by context length
    (`eagle-eval`'s `by_context`) on code whose context really is long."""
    rows = [r for _, r in _read_jsonl(asset_path("humaneval"))]
    prompts = []
    for i, row in enumerate(rows):
        want = file_chars[i % len(file_chars)]
        parts: list[str] = []
        size, j = 0, i + 1
        while size < want:
            other = rows[j % len(rows)]
            j += 1
            if other is row:
                continue
            parts.append(other["prompt"] + other["canonical_solution"] + "\n\n")
            size += len(parts[-1])
        prompts.append(EvalPrompt(f"{row['task_id']}@{want // 1000}k", ["".join(parts) + row["prompt"]], "code-long"))
    return prompts


def load_eval_prompts(name: str) -> list[EvalPrompt]:
    """Prompts of `mt_bench`, `humaneval`, `humaneval_long`, or a local PATH.jsonl whose
    lines are `{"id", "turns": [...]}` or `{"id", "prompt"}` (optional "category", and "images": the first
    turn's images, paths relative to the file or data URLs, for a vision-language target), in file order."""
    if name == "mt_bench":
        return [
            EvalPrompt(str(r["question_id"]), list(r["turns"]), r.get("category"))
            for _, r in _read_jsonl(asset_path("mt_bench"))
        ]
    if name == "humaneval":
        return [EvalPrompt(str(r["task_id"]), [r["prompt"]], "code") for _, r in _read_jsonl(asset_path("humaneval"))]
    if name == "humaneval_long":
        return humaneval_long()
    path = Path(name).expanduser()
    if path.suffix not in (".jsonl", ".gz"):
        raise DataError(f"evaluation prompts {name!r}: use mt_bench, humaneval, humaneval_long or a PATH.jsonl file")
    prompts = []
    for lineno, r in _read_jsonl(path):
        turns = r.get("turns", [r["prompt"]] if "prompt" in r else None)
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(
                f"{path}: line {lineno} needs 'turns' (a non-empty list of non-empty strings) "
                "or 'prompt' (a non-empty string)"
            )
        category = r.get("category")
        images = r.get("images") or []
        if not isinstance(images, list):
            raise DataError(f"{path}: line {lineno}: 'images' must be a list of image paths or data URLs")
        refs = [resolve_image(ref, f"{path}: line {lineno}, images[{k}]", path.parent) for k, ref in enumerate(images)]
        prompts.append(
            EvalPrompt(str(r.get("id", lineno)), turns, category if isinstance(category, str) else None, refs)
        )
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise DataError(f"{path}: prompt ids are not unique; give each line a distinct 'id'")
    return prompts
