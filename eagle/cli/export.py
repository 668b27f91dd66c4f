"""`eagle-export`: write a trained head as a vLLM / SGLang / speculators / hf / llama.cpp folder, or check one.

eagle-export draft.path=outputs/run format=vllm output_dir=exports/vllm [export.dtype=bfloat16]
eagle-export --check exports/vllm        # validate a folder made here or elsewhere
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from eagle.cli.app import run_app


def rewrite_check_flag(argv: Sequence[str]) -> list[str]:
    """`--check DIR` / `--check=DIR` -> the Hydra override `export.check=DIR` (Hydra has no flags)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--check":
            if i + 1 >= len(args):
                print("eagle-export: error: --check needs a folder: eagle-export --check DIR", file=sys.stderr)
                sys.exit(2)
            out.append(f"export.check={args[i + 1]}")
            i += 2
            continue
        if arg.startswith("--check="):
            out.append("export.check=" + arg.split("=", 1)[1])
        else:
            out.append(arg)
        i += 1
    return out


def _stage(cfg) -> None:
    from eagle.export import run_export  # startup: loads torch; the config is checked first

    run_export(cfg)


def main() -> None:
    sys.argv[1:] = rewrite_check_flag(sys.argv[1:])
    run_app("export", _stage)


if __name__ == "__main__":
    main()
