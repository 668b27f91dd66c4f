"""The package's imports form a one-way graph: each unit imports only units of lower layers.

Checked on the source (every `import`, function-local ones included), so a cycle hidden behind a
lazy import fails here too. A new module goes into the layer its imports allow; moving a unit up
or down is a design decision, made here.

Imports sit at the top of their module. One inside a function says why, in a comment on its line
or on the line(s) directly above it (or above the first of a run of imports), beginning with one
of `REASONS`:

  heavy:       a third-party module that costs real time and only some paths need (wandb,
               matplotlib, datasets), or that would load torch into a module on the CLI's start path
  optional:    a module that may be missing: not a dependency, POSIX only, version-dependent
  engine venv: code that runs in an engine's own venv (vLLM, speculators) and imports what only it has
  order:       the import must come after something the function does first
  cycle:       a real import cycle
  startup:     keeps a module that must import without torch (the entry points, `eagle.evaluate`)
               light; checked: each module with such an import imports without torch

An `eagle` module is imported inside a function only for `cycle:` or `startup:`. There is no
`layer:` reason: the layering above counts function-local imports too, so a lazy import cannot
excuse an upward one. A local import of a module the file already imports at its top is refused.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import eagle

PACKAGE = Path(eagle.__file__).parent

# Lowest first. A unit is a subpackage (eagle/heads/) or a top-level module (eagle/sweep.py).
LAYERS: list[set[str]] = [
    {"errors"},
    {"config", "fileio", "assets", "artifacts", "spec_metrics"},  # leaves: names, typed config, files, statistics
    # the frozen target (where from, loading whole or as FSDP2 shards, facts, dtypes, CPU kernels); metric sinks
    {"target", "tracking"},
    {"heads"},  # what every draft head is built from: the DraftHead interface, layers, vocab maps
    {"decode"},  # tree speculative decoding, continuous batching (drives heads through DraftHead)
    {"algorithms"},  # one package per algorithm (head, loss, drafting step, export names); the registry
    {"data"},  # conversations, templates, masks, splits, eval prompts
    {"regenerate"},  # self-distillation (generates with `decode`), local and server backends
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
    units = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())
    }
    placed = set().union(*LAYERS)
    assert units - placed == set(), "put new units into LAYERS"
    assert placed - units == set(), "LAYERS names units that no longer exist"


def test_imports_only_go_down():
    layer = {unit: k for k, units in enumerate(LAYERS) for unit in units}
    upward = {f"{src} -> {dst}": where for (src, dst), where in _imports().items() if layer[dst] >= layer[src]}
    assert upward == {}, "imports against the layering (importer -> imported: places)"


# ------------------------------------------------------------------------ function-local imports
REASONS = ("heavy", "optional", "engine venv", "order", "cycle", "startup")
EAGLE_REASONS = ("cycle", "startup")  # the only reasons an `eagle` module is imported inside a function
_REASON = re.compile(r"#\s*(" + "|".join(re.escape(r) for r in REASONS) + r"):")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_IMPORTS = (ast.Import, ast.ImportFrom)


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names ("." for a relative `from . import x`)."""
    if isinstance(node, ast.ImportFrom):
        return ["." * node.level + (node.module or "")]
    return [a.name for a in node.names]


def _reason_on(lines: list[str], first: int, last: int) -> str | None:
    """The reason in a comment on source lines first..last (1-based, inclusive)."""
    for line in lines[first - 1 : last]:
        m = _REASON.search(line)
        if m:
            return m.group(1)
    return None


def _reason_above(lines: list[str], lineno: int) -> str | None:
    """The reason in the block of comment lines directly above line `lineno` (1-based)."""
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        m = _REASON.match(lines[i].lstrip())
        if m:
            return m.group(1)
        i -= 1
    return None


def local_imports(source: str) -> list[tuple[int, list[str], str | None, bool]]:
    """(line, modules, reason or None, also imported at the top) for each import inside a function."""
    tree = ast.parse(source)
    lines = source.splitlines()
    top: set[str] = set()
    found: list[tuple[int, list[str], str | None, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            run_reason: str | None = None
            previous_import = False
            for stmt in stmts:
                if isinstance(stmt, _IMPORTS):
                    modules = _imported(stmt)
                    if not in_function:
                        top.update(modules)
                        top.update(m.split(".")[0] for m in modules if isinstance(stmt, ast.Import))
                    else:
                        if not previous_import:  # the first of a run: a comment above covers the run
                            run_reason = _reason_above(lines, stmt.lineno)
                        own = _reason_on(lines, stmt.lineno, stmt.end_lineno or stmt.lineno)
                        found.append((stmt.lineno, modules, own or run_reason, False))
                    previous_import = True
                    continue
                previous_import = False
                visit(stmt, in_function or isinstance(stmt, _FUNCTIONS))

    visit(tree, False)
    return [(line, mods, reason, any(m in top for m in mods)) for line, mods, reason, _ in found]


def local_import_problems(source: str, where: str = "<source>") -> list[str]:
    """What `test_function_local_imports_say_why` refuses in one module's source."""
    problems = []
    for line, modules, reason, at_top in local_imports(source):
        place, names = f"{where}:{line}", ", ".join(modules)
        internal = any(m == "eagle" or m.startswith(("eagle.", ".")) for m in modules)
        if at_top:
            problems.append(f"{place}: {names} is already imported at the top of the module")
        elif reason is None:
            problems.append(f"{place}: import of {names} inside a function without a reason ({', '.join(REASONS)})")
        elif internal and reason not in EAGLE_REASONS:
            problems.append(
                f"{place}: {names} is an eagle module: at the top, or local only for "
                f"{' / '.join(EAGLE_REASONS)} (not {reason!r})"
            )
    return problems


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_function_local_imports_say_why():
    problems = [
        p
        for path in _package_files()
        for p in local_import_problems(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert problems == [], "\n".join(problems)


def test_local_import_check_refuses_what_it_should():
    def check(body: str, head: str = "") -> list[str]:
        return local_import_problems(head + "def f():\n" + "".join(f"    {line}\n" for line in body.splitlines()))

    assert len(check("import wandb")) == 1  # no reason
    assert len(check("import wandb  # it is big")) == 1  # not a reason of the vocabulary
    assert check("import wandb  # heavy: only for logger=wandb") == []
    assert check("# optional: POSIX only\nimport fcntl") == []
    assert len(check("# optional: POSIX only\nx = 1\nimport fcntl")) == 1  # the comment is not above it
    # a comment above the first of a run covers the run, blank lines included; another statement ends it
    assert (
        check(
            "# startup: loads torch\nfrom accelerate import PartialState\n\nfrom eagle.target.loading import load_target"
        )
        == []
    )
    assert (
        len(check("# startup: loads torch\nimport accelerate\nx = 1\nfrom eagle.target.loading import load_target"))
        == 1
    )
    # eagle modules: at the top, or local for a cycle or to keep a light module light
    assert len(check("from eagle.target.loading import load_target  # heavy: loads torch")) == 1
    assert len(check("import eagle.target  # optional: no")) == 1
    assert len(check("from . import store  # heavy: no")) == 1
    assert check("from eagle.target.loading import load_target  # cycle: eagle.target imports this module") == []
    # nested functions, methods, try bodies and their handlers are inside a function too
    assert len(check("def g():\n    import json")) == 1
    assert len(local_import_problems("class C:\n    def m(self):\n        import json\n")) == 1
    assert len(check("try:\n    import fcntl\nexcept ImportError:\n    import msvcrt")) == 2
    # a module the file imports at its top anyway is imported there
    assert len(check("import json  # heavy: no", head="import json\n")) == 1
    assert len(check("from torch import nn  # heavy: no", head="import torch\n")) == 1
    assert len(check("from torch import nn  # heavy: no", head="import torch.nn\n")) == 1
    assert check("from transformers.utils import x  # optional: new", head="from transformers import A\n") == []
    assert check("import json", head="try:\n    import json\nexcept ImportError:\n    pass\n") != []
    assert check("pass") == [] and local_import_problems("import json\n") == []


def test_startup_imports_keep_their_module_free_of_torch():
    """Each module that defers imports for `startup:` imports without torch (else deferring buys nothing)."""
    modules = []
    for path in _package_files():
        if any(reason == "startup" for *_, reason, _top in local_imports(path.read_text())):
            rel = path.relative_to(PACKAGE.parent).with_suffix("")
            modules.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    assert "eagle.cli.train" in modules and "eagle.evaluate" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    assert 'torch' not in sys.modules, m + ' (or a module it imports) loads torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _private_eagle_imports(folder: Path) -> list[str]:
    """'file:line names' for each `from eagle... import _name` under `folder`."""
    offenders = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eagle":
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {', '.join(private)}")
    return offenders


def test_no_private_name_is_imported_from_another_module():
    """A name starting with one underscore is its module's own: another module that needs it gets a public
    name (renaming on import, `DTYPES as _DTYPES`, is the importer's business and allowed)."""
    assert _private_eagle_imports(PACKAGE) == []


def test_tests_and_benchmarks_use_the_package_s_public_names():
    """The package's import rule holds for its callers too: tests and benchmarks import no `_private` name
    of `eagle` (what a test needs of a module is public, or tested through what is)."""
    assert (
        _private_eagle_imports(PACKAGE.parent / "tests") + _private_eagle_imports(PACKAGE.parent / "benchmarks") == []
    )


def test_no_function_is_longer_than_80_lines():
    """A function of the package fits about one screen; a longer one is split into named phases."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
                    f"({node.end_lineno - node.lineno + 1} lines)"
                )
    assert long == []
