"""Raw record streams from the bundled ShareGPT dump, local JSON/JSONL/Parquet files and Hub data sets.

Everything streams: `data.max_conversations=N` reads only as far as needed. Each reader yields
`(index, record)` pairs; `eagle.data.records.normalise_record` turns a record into a `Conversation`.
Syntax errors in local files raise `DataError` with the line number; only the bundled ShareGPT dump,
which is known to be cut off mid-record, is allowed a truncated tail (reported, never silent).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle.assets import asset_path
from eagle.config import DataConfig
from eagle.errors import DataError

_SEPARATOR = re.compile(r"[\s,]*")  # between array elements: whitespace and the comma


def _after_separator(buf: str, pos: int) -> int:
    """The position after the whitespace and commas at `pos` (the pattern matches the empty string too)."""
    match = _SEPARATOR.match(buf, pos)
    assert match is not None
    return match.end()


_CHUNK = 1 << 22  # 4 MiB of text per read: a few hundred ShareGPT records


@dataclass
class ReadReport:
    """What a reader noticed about its source besides the records (e.g. a truncated tail)."""

    source: str = ""
    truncated_tail_at: int | None = None  # character offset of an incomplete last record
    notes: list[str] = field(default_factory=list)


def iter_json_array(path: Path, report: ReadReport, allow_truncated_tail: bool = False) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array with `json.JSONDecoder.raw_decode`.

    Text is read in chunks; an element that does not decode is retried with more text until EOF. At
    EOF an element that still does not decode is a truncated tail when `allow_truncated_tail` and the
    file does not end with the closing `]` (recorded in `report`), and a `DataError` otherwise.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(_CHUNK)
        eof = len(buf) < _CHUNK
        lines_before = 0  # newlines in text already dropped from `buf` (for error line numbers)
        chars_before = 0
        pos = _after_separator(buf, 0)
        if pos >= len(buf) or buf[pos] != "[":
            raise DataError(
                f"{path}: expected a JSON array of conversations (or {{'data': [...]}}) "
                f"at line 1; found {buf[pos : pos + 20]!r}"
            )
        pos += 1
        index = 0
        while True:
            pos = _after_separator(buf, pos)
            if pos >= len(buf) and not eof:
                lines_before += buf.count("\n", 0, pos)
                chars_before += pos
                buf, pos = f.read(_CHUNK), 0
                eof = len(buf) < _CHUNK
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:  # maybe only cut by the chunk boundary: drop consumed text, read more
                    lines_before += buf.count("\n", 0, pos)
                    chars_before += pos
                    more = f.read(_CHUNK)
                    eof = len(more) < _CHUNK
                    buf, pos = buf[pos:] + more, 0
                    continue
                if allow_truncated_tail and not buf.rstrip().endswith("]"):
                    report.truncated_tail_at = chars_before + pos
                    report.notes.append(
                        f"{path.name}: incomplete last record at character "
                        f"{chars_before + pos} ignored (file is cut off)"
                    )
                    return
                line = lines_before + buf.count("\n", 0, e.pos) + 1
                raise DataError(
                    f"{path}: malformed JSON in record {index} at line {line}: {e.msg}; "
                    "fix the file (each element of the array must be a complete object)"
                ) from e
            yield index, record
            index += 1
            pos = end
            if pos >= len(buf) and eof and not allow_truncated_tail:
                raise DataError(
                    f"{path}: the JSON array has no closing ']' after record {index - 1}; the file is truncated"
                )


def iter_local_json(path: Path, report: ReadReport) -> Iterator[tuple[int, Any]]:
    """A `.json` file: an array of records, or an object whose `data` field is that array."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        yield from iter_json_array(path, report)
        return
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        raise DataError(
            f"{path}: expected a JSON array of conversations or an object {{'data': [...]}}; "
            f"got {type(obj).__name__}" + (f" with keys {sorted(obj)[:10]}" if isinstance(obj, dict) else "")
        )
    yield from enumerate(obj["data"])


def iter_jsonl(path: Path, report: ReadReport) -> Iterator[tuple[int, Any]]:
    """A `.jsonl` file: one record per line; blank lines are ignored, a malformed line is an error."""
    index = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg}); fix or remove that line") from e
            yield index, record
            index += 1


def iter_parquet(path: Path, report: ReadReport) -> Iterator[tuple[int, Any]]:
    """A `.parquet` file, read batch by batch."""
    import pyarrow.parquet as pq  # optional: pyarrow is no direct dependency (datasets brings it)

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError subclasses for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    index = 0
    for batch in pf.iter_batches(batch_size=256):
        for record in batch.to_pylist():
            yield index, record
            index += 1


def iter_hub(cfg: DataConfig, report: ReadReport) -> Iterator[tuple[int, Any]]:
    """A data set through `datasets.load_dataset(path, subset, split=...)`, streamed.

    `data.path` may be a Hub name or a local folder of data files (the same call handles both).
    """
    import datasets  # heavy: datasets (~1 s), only for data.source=hub

    try:
        ds = datasets.load_dataset(cfg.path, cfg.hub_subset, split=cfg.hub_split, streaming=True)
    except Exception as e:  # datasets raises many types: missing set, no network, bad split name
        raise DataError(
            f"data.path={cfg.path!r} (subset {cfg.hub_subset!r}, split {cfg.hub_split!r}) "
            f"cannot be loaded with datasets.load_dataset: {e}"
        ) from e
    it = iter(ds)
    index = 0
    while True:
        try:
            record = next(it)
        except StopIteration:
            return
        except Exception as e:  # a broken shard surfaces only while iterating
            raise DataError(f"data.path={cfg.path!r}: reading record {index} failed: {e}") from e
        yield index, record
        index += 1


def iter_records(cfg: DataConfig, report: ReadReport) -> Iterator[tuple[int, Any]]:
    """The raw records of `cfg`'s source, in file order."""
    if cfg.source == "sharegpt":
        path = asset_path("sharegpt")
        report.source = "sharegpt"
        yield from iter_json_array(path, report, allow_truncated_tail=True)
        return
    if cfg.source == "hub":
        report.source = str(cfg.path)
        yield from iter_hub(cfg, report)
        return
    if cfg.source != "local":
        raise DataError(f"data.source={cfg.source!r} is not one of sharegpt, local, hub")
    if not cfg.path:
        raise DataError("data=local needs data.path=FILE (a .json, .jsonl or .parquet conversation file)")
    path = Path(cfg.path).expanduser()
    report.source = str(path)
    if not path.is_file():
        raise DataError(
            f"data.path={cfg.path!r}: file not found (data=local reads a .json, .jsonl or .parquet file; "
            "use data=hub for a data set folder or Hub name)"
        )
    readers = {".json": iter_local_json, ".jsonl": iter_jsonl, ".parquet": iter_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"data.path={cfg.path!r}: unsupported extension {path.suffix!r}; use .json, .jsonl or .parquet")
    try:
        yield from reader(path, report)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); re-encode the file as UTF-8") from e
