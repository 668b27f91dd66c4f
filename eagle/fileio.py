"""Durable, atomic file writes and content hashes shared by every stage.

Readers see either the old file or the whole new one, never a part: data goes to a temporary file in
the same folder, is fsync'ed, then renamed over the target, and the folder is fsync'ed so the rename
itself survives a crash. This is what lets any stage be SIGKILLed and resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it is durable (best effort where a file system cannot)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder` and the folders themselves, so a rename publishes durable data."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def temp_path(path: Path) -> Path:
    """A fresh dot-prefixed temporary file beside `path`: never mistaken for it, unique per process."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def atomic_write_with(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path` in one rename
    (for writers that want a file name, e.g. safetensors' `save_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the finished folder `tmp` become `final` (same parent): its files are fsync'ed, an old
    `final` is moved aside and removed only after the rename, so a crash leaves the old folder or
    the new one (plus, at worst, a dot-named leftover the next publish clears)."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    fsync_tree(tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """`with atomic_dir(out) as tmp:` fill `tmp`; on success it replaces `out` (`publish_dir`), on
    an exception it is removed and `out` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        publish_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an inter-process lock on `path` (created if missing) for the `with` body.

    For work that several processes may start at once and that only one should do (the ranks of a
    launcher, or two test workers, converting the same GGUF file): the others wait, then find the
    result. POSIX `flock`, released by the kernel if the holder dies; a no-op where it is missing.
    """
    try:
        import fcntl  # optional: POSIX only
    except ImportError:  # not POSIX: no lock (the work is still atomic, only maybe done twice)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one."""
    atomic_write_with(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """`safetensors.torch.save` with a canonical header: the same tensors and metadata give the same bytes.

    safetensors keeps `__metadata__` in a hash map seeded per process, so with two or more metadata
    keys the header's key order (and so the file's sha256) changes from one export to the next. The
    header is re-serialised here with sorted keys and padded with spaces to its original length (the
    format allows trailing spaces; tensor offsets are relative to the data section, so nothing moves).
    """
    from safetensors.torch import save  # heavy: loads torch; this module is on the CLI's start path

    data = save(tensors, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(canonical) > n:  # cannot happen for safetensors' compact JSON; keep its own bytes if it did
        return data
    return data[:8] + canonical + b" " * (n - len(canonical)) + data[8 + n :]
