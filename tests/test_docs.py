"""The documentation cannot rot silently: every `eagle-*` command shown in README.md and docs/ composes
into a valid config, and every relative link points at a file or folder that exists.

A command is read from fenced code blocks (``` ... ```), joined over `\\` line ends, up to a shell
operator (`;`, `&&`, `|`, `#`). Its overrides are composed exactly as the entry point would compose
them (`eagle.cli.app.compose`), so a renamed key, a value out of range or a misspelt recipe in a guide
fails here. A multirun command (`-m`) composes once per swept value of its first swept key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from eagle.cli.app import compose
from eagle.cli.export import rewrite_check_flag

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
STAGES = {"eagle-capture", "eagle-regenerate", "eagle-train", "eagle-eval", "eagle-export", "eagle-publish"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


# A stage command starts a line or follows a shell operator, after any VAR=value assignments; or it
# is a module run by a launcher (`torchrun ... -m eagle.cli.capture`, `accelerate launch -m eagle.cli.train`).
COMMAND = re.compile(r"(?:(?:^|&&|;|\|)\s*(?:[A-Za-z_]+=\S+\s+)*(eagle-[a-z]+)|-m\s+eagle\.cli\.([a-z]+))"
                     r"((?:[^;&|#\n]|\|\|)*)", re.M)
MODULES = {"capture": "eagle-capture", "regenerate": "eagle-regenerate", "train": "eagle-train",
           "evaluate": "eagle-eval", "export": "eagle-export", "publish": "eagle-publish"}


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """(stage, words after the stage) for each `eagle-*` command in the file's code blocks."""
    found = []
    for block in FENCE.findall(path.read_text()):
        joined = re.sub(r"\\\n\s*", " ", block)  # shell line continuations
        for script, module, rest in COMMAND.findall(joined):
            stage = script or MODULES.get(module, "")
            if stage in STAGES:
                found.append((stage, shlex.split(rest)))
    return found


def _split_sweep(value: str) -> list[str]:
    """Top-level comma-separated values of a multirun override (`a,b` but not `[a,b]`)."""
    parts, depth, current = [], 0, ""
    for ch in value:
        depth += ch in "[{(" and 1 or 0
        depth -= ch in "]})" and 1 or 0
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def _override_sets(words: list[str]) -> list[list[str]]:
    """The override lists a command composes: one, or one per value of its first swept key under -m."""
    words = rewrite_check_flag(words)
    multirun = "-m" in words or "--multirun" in words
    overrides = [w for w in words if w not in ("-m", "--multirun")]
    if not multirun:
        return [overrides]
    for k, w in enumerate(overrides):
        key, _, value = w.partition("=")
        values = _split_sweep(value)
        if len(values) > 1:
            return [[*overrides[:k], f"{key}={v}", *overrides[k + 1:]] for v in values]
    return [overrides]


COMMANDS = [
    pytest.param(stage, words, id=f"{path.relative_to(ROOT)}:{n}:{stage}")
    for path in DOCS
    for n, (stage, words) in enumerate(_commands(path))
]


def test_the_docs_show_commands():
    stages = {stage for stage, _ in (p.values for p in COMMANDS)}
    assert {"eagle-capture", "eagle-train", "eagle-eval", "eagle-export", "eagle-regenerate"} <= stages


@pytest.mark.parametrize("stage, words", COMMANDS)
def test_documented_command_composes(stage, words):
    for overrides in _override_sets(words):
        assert all("=" in o for o in overrides), f"{stage} {' '.join(words)}: not all words are overrides"
        compose(overrides)


LINKS = [
    pytest.param(path, target, id=f"{path.relative_to(ROOT)}->{target}")
    for path in DOCS
    for target in LINK.findall(path.read_text())
    if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")
]


@pytest.mark.parametrize("path, target", LINKS)
def test_relative_link_resolves(path, target):
    assert (path.parent / target.split("#")[0]).exists(), f"{path.relative_to(ROOT)} links to missing {target}"
