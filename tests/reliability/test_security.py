"""Untrusted files cannot run code: no pickle, weights via safetensors or torch.load(weights_only=True)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "eagle").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    if isinstance(func, ast.Name):
        return func.id
    return ""


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_unsafe_deserialisation(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n in ("pickle", "dill", "cloudpickle", "marshal") for n in names), (
                f"{path}:{node.lineno} imports a pickle module"
            )
    for call in _calls(tree):
        name = _name(call.func)
        kwargs = {k.arg: k.value for k in call.keywords}
        if name.endswith("torch.load") or name == "load" and "weights_only" in kwargs:
            value = kwargs.get("weights_only")
            assert isinstance(value, ast.Constant) and value.value is True, (
                f"{path}:{call.lineno} torch.load without weights_only=True"
            )
        if "trust_remote_code" in kwargs:
            value = kwargs["trust_remote_code"]
            assert not (isinstance(value, ast.Constant) and value.value is True), (
                f"{path}:{call.lineno} hard-codes trust_remote_code=True"
            )
        assert not name.endswith(("numpy.load", "np.load")) or (
            isinstance(kwargs.get("allow_pickle"), ast.Constant) and kwargs["allow_pickle"].value is False
        ), f"{path}:{call.lineno} np.load must pass allow_pickle=False"


def test_library_has_no_import_side_effects_or_machine_paths():
    for path in (ROOT / "eagle").rglob("*.py"):
        text = path.read_text()
        assert ".cuda()" not in text, f"{path}: use accelerate / a passed-in device"
        assert "argparse" not in text, f"{path}: the library takes typed configs, not argv"
        assert "/home/" not in text and "/root/" not in text, f"{path}: machine path"
