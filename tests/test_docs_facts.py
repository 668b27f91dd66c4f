"""Sentences in README.md and docs/ that state a default or a recipe's setting say what the code does.

Read from the prose (fenced code excluded) in the shapes the docs use:
  * "`key=value` by default", "`key=value` (default ...)"           -> the composed default of `key`
  * "`key` (default `value`)", "`key` (value, ...)" in a settings cell -> the same
  * a configuration table row "| `key`, `key2` | ... `value` (default ...) |" -> the default of one of its keys
  * "the SmolLM2 recipe sets `key: value`"                           -> the recipe's composed value
  * "SmolLM2 recipe (both EAGLE-3.1 options off ..."                  -> draft.fc_norm and draft.norm_output
A changed default or recipe then fails here until the sentence is changed too.
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from functools import cache
from typing import Any

import pytest

from eagle.cli.app import compose
from tests.test_docs import DOCS, ROOT, _prose

KEY = r"[a-z_]+\.[a-z_.]+"
BY_DEFAULT = re.compile(rf"`({KEY})=([^`]+)` (?:by default|\(default)")
DEFAULT_VALUE = re.compile(rf"`({KEY})` \(default `([^`]+)`\)")
SETTING_CELL = re.compile(rf"`({KEY})` \(([0-9.]+)[, ]")
TABLE_ROW = re.compile(r"^\| ((?:`[a-z_.]+`(?:, | \(or [^)]*\), )?)+)[^|]*\| (.*`([^`]+)` \(default[^|]*)\|", re.M)
RECIPE_SETS = re.compile(rf"recipe sets `({KEY}): ([^`]+)`")
RECIPE = "smollm2-135m-instruct"


@cache
def _config(recipe: bool = False) -> Any:
    return compose([f"recipe={RECIPE}"] if recipe else [])


def _value(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if not is_dataclass(node) or part not in {f.name for f in fields(node)}:
            raise KeyError(key)
        node = getattr(node, part)
    return node


def _same(value: Any, text: str) -> bool:
    """A config value against its documented spelling (numbers by value, lists as `[a, b]`, null/none)."""
    text = text.strip()
    if isinstance(value, bool):
        return text.lower() == str(value).lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    if isinstance(value, list):
        return text == "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):  # as YAML's flow style writes it: `{eagle3: 1}`
        return text == "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if value is None:
        return text.lower() in ("null", "none")
    return str(value) == text


def _facts() -> list[tuple[str, str, str, bool]]:
    """(page, key, documented value, of the recipe) for every statement found."""
    found = []
    for page in DOCS:
        text = _prose(page.read_text())
        name = str(page.relative_to(ROOT))
        for pattern in (BY_DEFAULT, DEFAULT_VALUE, SETTING_CELL):
            found += [(name, key, value, False) for key, value in pattern.findall(text)]
        for keys, _, value in TABLE_ROW.findall(text):
            found.append((name, "|".join(re.findall(r"`([a-z_.]+)`", keys)), value, False))
        found += [(name, key, value, True) for key, value in RECIPE_SETS.findall(text)]
    return found


FACTS = _facts()


def test_the_docs_state_defaults_this_test_reads():
    assert len(FACTS) >= 8, FACTS  # the patterns still match the docs' sentences


@pytest.mark.parametrize("page, key, documented, recipe", FACTS, ids=[f"{p}:{k}" for p, k, _, _ in FACTS])
def test_documented_default_is_the_codes(page, key, documented, recipe):
    cfg = _config(recipe)
    keys = key.split("|")  # a table row names several keys; the default belongs to one of them
    values = {k: _value(cfg, k) for k in keys if k != "format"}
    assert any(_same(v, documented) for v in values.values()), (page, values, documented)


def test_the_recipes_eagle31_options_are_as_the_serving_page_says():
    text = _prose((ROOT / "docs" / "serving.md").read_text())
    assert re.search(r"SmolLM2 recipe \(both EAGLE-3\.1 options off", text)
    draft = _config(True).draft
    assert draft.fc_norm is False and draft.norm_output is False
