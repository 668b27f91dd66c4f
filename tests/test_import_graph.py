"""The package's imports form a one-way graph: each unit imports only units of lower layers.

Checked on the source (every `import`, function-local ones included), so a cycle hidden behind a
lazy import fails here too. A new module goes into the layer its imports allow; moving a unit up
or down is a design decision, made here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import eagle

PACKAGE = Path(eagle.__file__).parent

# Lowest first. A unit is a subpackage (eagle/heads/) or a top-level module (eagle/targets.py).
LAYERS: list[set[str]] = [
    {"errors"},
    {"config", "fileio", "assets", "precision", "artifacts", "cpu_gemm"},  # leaves: names, typed config, files
    {"targets", "tracking"},  # the frozen target (load, facts); metric sinks
    {"shard"},  # target.shard: the frozen target as FSDP2 shards over the processes
    {"heads"},  # draft-head modules
    {"algorithms"},  # per algorithm: feature spec, loss, export names (registry by name)
    {"decode"},  # tree speculative decoding, continuous batching
    {"data"},  # conversations, templates, self-distillation (generates with `decode`)
    {"capture"},  # target features on disk
    {"train"},
    {"export"},  # export formats, head loading by draft.path
    {"evaluate"},
    {"sweep"},
    {"cli"},  # entry points
]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports() -> dict[tuple[str, str], list[str]]:
    """{(importing unit, imported unit): [file:line, ...]} over the whole package."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        src = _unit(".".join(rel.parts))
        if not src or src == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eagle":
                targets = [f"{node.module}.{a.name}" if node.module == "eagle" else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "eagle"]
            else:
                continue
            for target in targets:
                dst = _unit(target)
                if dst and dst != src:
                    edges.setdefault((src, dst), []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return edges


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}
    placed = set().union(*LAYERS)
    assert units - placed == set(), "put new units into LAYERS"
    assert placed - units == set(), "LAYERS names units that no longer exist"


def test_imports_only_go_down():
    layer = {unit: k for k, units in enumerate(LAYERS) for unit in units}
    upward = {f"{src} -> {dst}": where for (src, dst), where in _imports().items() if layer[dst] >= layer[src]}
    assert upward == {}, "imports against the layering (importer -> imported: places)"
