"""Every config group option and every recipe composes and validates; bad values fail at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from eagle.cli.app import compose, conf_dir
from eagle.config import ConfigError, RootConfig

CONF = conf_dir()
GROUP_OPTIONS = [
    (group.name, f.stem)
    for group in sorted(CONF.iterdir())
    if group.is_dir() and group.name != "recipe"
    for f in sorted(group.glob("*.yaml"))
]
RECIPES = sorted(p.stem for p in (CONF.parent / "recipes").glob("*.yaml"))
# Group options with mandatory values (???) need them on the command line.
REQUIRED = {
    ("target", "hub"): ["target.path=org/name"],
    ("data", "local"): ["data.path=conversations.jsonl"],
    ("data", "hub"): ["data.path=org/name"],
}


def test_there_is_something_to_compose():
    assert len(GROUP_OPTIONS) >= 12
    assert "smollm2-135m-instruct" in RECIPES and len(RECIPES) >= 3


def _leaves(tree: object, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a YAML file's plain values (no defaults list, ???, or interpolations)."""
    out: dict[str, object] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == "defaults" and not prefix:
                continue
            out.update(_leaves(v, f"{prefix}{k}."))
    elif not (isinstance(tree, str) and (tree == "???" or "${" in tree)):
        out[prefix[:-1]] = tree
    return out


def _composed_value(cfg: RootConfig, dotted: str) -> object:
    value: object = cfg
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)  # a typed dict's keys
    return value


def _assert_file_values_landed(cfg: RootConfig, yaml_file: Path, prefix: str) -> int:
    from omegaconf import OmegaConf

    leaves = _leaves(OmegaConf.to_container(OmegaConf.load(yaml_file), resolve=False))
    for key, want in leaves.items():
        got = _composed_value(cfg, prefix + key)
        assert got == want, f"{yaml_file.name}: {prefix + key} composed to {got!r}, the file says {want!r}"
    return len(leaves)


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes(group, option):
    """Composing with the option selected validates, and every value the option's file sets arrives."""
    cfg = compose([f"{group}={option}", *REQUIRED.get((group, option), [])])
    _assert_file_values_landed(cfg, CONF / group / f"{option}.yaml", f"{group}.")
    for override in REQUIRED.get((group, option), []):
        key, value = override.split("=", 1)
        assert _composed_value(cfg, key) == value


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    """A recipe validates and every value it sets wins over the groups' defaults."""
    path = CONF.parent / "recipes" / f"{recipe}.yaml"
    assert path.read_text().startswith("# @package _global_"), "recipes override the whole config"
    cfg = compose([f"recipe={recipe}"])
    assert _assert_file_values_landed(cfg, path, "") > 0


def test_recipe_values_override_groups():
    cfg = compose(["recipe=smollm2-135m-instruct"])
    assert cfg.draft.aux_layer_ids == [2, 15, 27]
    assert cfg.train.max_steps == 3000
    # and the command line still wins over the recipe
    assert compose(["recipe=smollm2-135m-instruct", "train.max_steps=7"]).train.max_steps == 7


@pytest.mark.parametrize(
    "override,exc",
    [
        ("train.lrr=1", ConfigCompositionException),  # misspelt key
        ("+train.lrr=1", (ConfigCompositionException, ConfigKeyError, ConfigError)),  # even when forced
        ("train.lr=fast", (ConfigCompositionException, ValidationError)),  # wrong type
        ("train.lr=-1e-3", ConfigError),
        ("decode.tree_depth=0", ConfigError),
        ("export.speculative_tokens=0", ConfigError),
        ("decode.draft_dtype=int8", ConfigError),
        ("decode.draft_weights=int4", ConfigError),
        ("draft.algorithm=eagle9", ConfigError),
        ("train.mode=sometimes", ConfigError),
        ("data=local", (ConfigCompositionException, ConfigError, Exception)),  # data.path missing
    ],
)
def test_bad_config_fails_at_startup(override, exc):
    with pytest.raises(exc) as info:
        compose([override])
    key = override.lstrip("+").split("=")[0].split(".")[-1]
    if key not in ("data",):
        assert key in str(info.value) or key in repr(info.value.__cause__)


def test_conf_recipe_link_points_at_recipes():
    assert (CONF / "recipe").resolve() == (CONF.parent / "recipes").resolve()
    assert Path(CONF / "recipe" / "smollm2-135m-instruct.yaml").is_file()
