"""`python -m benchmarks NAME [ARGS ...]`: runs benchmark NAME (a module of `benchmarks` or `benchmarks.studies`)
with ARGS, shows what it prints and records the run (`benchmarks.report`)."""

from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
import sys
import time
from pathlib import Path

from benchmarks import studies
from benchmarks.report import write_record

REPO = Path(__file__).resolve().parents[1]
NOT_BENCHMARKS = {"report"}


def available() -> dict[str, str]:
    """Benchmark name -> its module."""
    found = {m.name: f"benchmarks.{m.name}" for m in pkgutil.iter_modules([str(Path(__file__).parent)])}
    found.update({m.name: f"benchmarks.studies.{m.name}" for m in pkgutil.iter_modules(studies.__path__)})
    return {
        k: v for k, v in sorted(found.items()) if k not in NOT_BENCHMARKS and not k.startswith("_") and k != "studies"
    }


class _Tee(io.TextIOBase):
    """stdout shown as it comes and kept for the record."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"benchmarks: no benchmark {argv[0]!r}", file=sys.stderr)
        print("usage: python -m benchmarks NAME [ARGS ...]   (NAME --help for its arguments)\n")
        for name, module in names.items():
            doc = (importlib.import_module(module).__doc__ or "").strip().splitlines()
            print(f"  {name:<20} {doc[0] if doc else ''}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, args = argv[0], argv[1:]
    module = importlib.import_module(names[name])
    started, tee = time.time(), _Tee(sys.stdout)  # type: ignore[arg-type]
    sys.argv = [f"benchmarks {name}", *args]
    code = 1
    try:
        with contextlib.redirect_stdout(tee):
            result = module.main(args)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code not in (None, 0) and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    finally:
        if not (args and args[0] in ("-h", "--help")):
            path = (
                REPO
                / "outputs"
                / "benchmarks"
                / name
                / time.strftime("run-%Y%m%d-%H%M%S.json", time.localtime(started))
            )
            write_record(path, name, args, started, code, tee.kept.getvalue(), REPO)
            print(f"benchmarks: recorded {path.relative_to(REPO)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
