"""The documentation cannot rot silently: every `eagle-*` command shown in README.md and docs/ composes
into a valid config, every relative link points at a file or folder that exists and every `#anchor` at
a heading of the page it names, and the README stays a front page.

A command is read from fenced code blocks (``` ... ```), joined over `\\` line ends, up to a shell
operator (`;`, `&&`, `|`, `#`), and from inline code spans (`eagle-eval recipe=... draft.path=...`, e.g.
the command column of a benchmark table) that start with a stage and carry at least one override (a
span with a `...` placeholder is a sketch, not a command). Its
overrides are composed exactly as the entry point would compose them (`eagle.cli.app.compose`), so a
renamed key, a value out of range or a misspelt recipe in a guide fails here. A multirun command (`-m`)
composes once per swept value of its first swept key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from eagle.cli.app import compose
from eagle.cli.export import rewrite_check_flag

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
README_MAX_LINES = 220  # a front page: what, for whom, set-up, the six stages, one results table, links
STAGES = {"eagle-capture", "eagle-regenerate", "eagle-train", "eagle-eval", "eagle-export", "eagle-publish"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")  # a code span, possibly wrapped over lines
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


# A stage command starts a line or follows a shell operator, after any VAR=value assignments; or it
# is a module run by a launcher (`torchrun ... -m eagle.cli.capture`, `accelerate launch -m eagle.cli.train`).
COMMAND = re.compile(
    r"(?:(?:^|&&|;|\|)\s*(?:[A-Za-z_]+=\S+\s+)*(eagle-[a-z]+)|-m\s+eagle\.cli\.([a-z]+))"
    r"((?:[^;&|#\n]|\|\|)*)",
    re.M,
)
MODULES = {
    "capture": "eagle-capture",
    "regenerate": "eagle-regenerate",
    "train": "eagle-train",
    "evaluate": "eagle-eval",
    "export": "eagle-export",
    "publish": "eagle-publish",
}


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _inline_commands(text: str) -> list[str]:
    """Inline code spans that are stage commands with at least one override (not mere mentions)."""
    spans = []
    for span in INLINE.findall(_prose(text)):
        words = " ".join(span.split())
        if words.split(" ", 1)[0] in STAGES and "=" in words and "..." not in words:  # `...`: a sketch
            spans.append(words)
    return spans


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """(stage, words after the stage) for each `eagle-*` command in the file's code blocks and spans."""
    text = path.read_text()
    found = []
    for block in [*FENCE.findall(text), *_inline_commands(text)]:
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


SWEEP_FUNCTION = re.compile(r"^(?:interval|range|choice)\((.*)\)$")


def _override_sets(words: list[str]) -> list[list[str]]:
    """The override lists a command composes: one, or one per value of its first swept key under -m.
    Under -m, Hydra's own settings (`hydra/sweeper=optuna`, `hydra.sweeper.*`: a sweeper plugin's, not
    eagle's) are left out, and a sweep function (`interval(1e-4,1e-3)`) composes at its first bound."""
    words = rewrite_check_flag(words)
    multirun = "-m" in words or "--multirun" in words
    overrides = [w for w in words if w not in ("-m", "--multirun")]
    if not multirun:
        return [overrides]
    overrides = [w for w in overrides if not w.startswith(("hydra/", "hydra."))]
    for k, w in enumerate(overrides):
        key, _, value = w.partition("=")
        function = SWEEP_FUNCTION.match(value)
        if function:
            overrides[k] = f"{key}={_split_sweep(function.group(1))[0].strip()}"
    for k, w in enumerate(overrides):
        key, _, value = w.partition("=")
        values = _split_sweep(value)
        if len(values) > 1:
            return [[*overrides[:k], f"{key}={v}", *overrides[k + 1 :]] for v in values]
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


def test_inline_commands_are_read():
    text = (
        "Run `eagle-eval recipe=smollm2-135m-instruct\n  eval.max_prompts=8` or `eagle-train` or\n"
        "```bash\neagle-train `x=1`\n```\n"
    )
    assert _inline_commands(text) == ["eagle-eval recipe=smollm2-135m-instruct eval.max_prompts=8"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (GitHub numbers repeats -1, -2, ...) and explicit
    `<a id=...>` / `<a name=...>` tags."""
    text = path.read_text()
    seen: dict[str, int] = {}
    anchors = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(_prose(text)):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_slugs_follow_github():
    assert _slug("llama.cpp") == "llamacpp"
    assert _slug("Measured on this project's CPU") == "measured-on-this-projects-cpu"
    assert _slug("`format=llamacpp`") == "formatllamacpp"
    assert _slug("1. A recipe") == "1-a-recipe"
    assert _slug("Resume rules") == "resume-rules"


LINKS = [
    pytest.param(path, target, id=f"{path.relative_to(ROOT)}->{target}")
    for path in DOCS
    for target in LINK.findall(_prose(path.read_text()))
    if not re.match(r"^[a-z][a-z0-9+.-]*:", target)
]


@pytest.mark.parametrize("path, target", LINKS)
def test_relative_link_resolves(path, target):
    file, _, anchor = target.partition("#")
    dest = path.parent / file if file else path
    assert dest.exists(), f"{path.relative_to(ROOT)} links to missing {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), (
            f"{path.relative_to(ROOT)} links to {target}, but {dest.name} has no "
            f"heading with that anchor; its anchors: {sorted(_anchors(dest))}"
        )


def test_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move depth into docs/ (limit {README_MAX_LINES})"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    missing = [p.relative_to(ROOT) for p in DOCS[1:] if p.resolve() not in linked]
    assert missing == [], f"pages no README link leads to: {missing}"


PATH_MENTION = re.compile(r"(?<![\w/.$~-])((?:scripts|benchmarks|tests|eagle|conf|recipes|heads)/[\w./*-]*[\w*])")


def _path_mentions(text: str) -> set[str]:
    """Repository paths a page names in passing (`scripts/demo.sh`, benchmarks/decode.py), placeholders
    (upper-case words: `check_ENGINE.sh`) and globs left out."""
    return {p for p in PATH_MENTION.findall(text) if not re.search(r"[A-Z]{3,}|\*", p)}


@pytest.mark.parametrize("path", [*DOCS, *sorted((ROOT / "recipes").glob("*.yaml"))], ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(path):
    """A moved or renamed file leaves no page (or recipe comment) pointing at where it was."""
    missing = sorted(p for p in _path_mentions(path.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{path.relative_to(ROOT)} names paths that do not exist: {missing}"
