"""Provenance: sources.jsonl (where samples came from) and skipped.jsonl (what was left out).

Both hold one JSON value per line and are read with bounds: the index says
how many lines each has, and no line may be longer than MAX_LINE_NBYTES, so a
damaged or hostile file (or a device in its place) is never read without end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, Protocol

import numpy as np
from numpy.typing import NDArray

from ..errors import FormatError
from .files import open_regular
from .index import SKIPPED_NAME, SOURCES_NAME, Index

MAX_LINE_NBYTES = 1 << 16


class SourceTable(Protocol):
    """What sources.jsonl is written from (a build's Plan): each source's path, and in rows
    mode the first sample of each source (plus the end)."""

    @property
    def sources(self) -> Sequence[str]: ...
    @property
    def mode(self) -> str: ...
    @property
    def file_starts(self) -> NDArray[np.int64]: ...
    def file_rows(self, k: int) -> tuple[int, int]: ...


def source_lines(plan: SourceTable) -> Iterator[str]:
    """sources.jsonl: per source file its path, or in rows mode [path, number of rows]."""
    for k, path in enumerate(plan.sources):
        if plan.mode == "rows":
            yield json.dumps([path, plan.file_rows(k)[1]]) + "\n"
        else:
            yield json.dumps(path) + "\n"


def source_lines_nbytes(plan: SourceTable) -> int:
    """Bytes of sources.jsonl, exactly, without building its lines (a million paths take a
    second to encode). JSON here is ASCII (json.dumps escapes every other character)."""
    total = sum(_json_string_nbytes(path) for path in plan.sources) + len(plan.sources)  # "\n"
    if plan.mode == "rows":
        counts = np.diff(plan.file_starts).tolist()
        total += sum(len(str(count)) for count in counts) + len("[, ]") * len(counts)  # [path, count]
    return total


def _json_string_nbytes(text: str) -> int:
    """len(json.dumps(text)): the quotes, plus a backslash before each quote and backslash;
    any other character outside printable ASCII is measured by json itself."""
    if text.isascii() and text.isprintable():
        return len(text) + 2 + text.count('"') + text.count("\\")
    return len(json.dumps(text))


def skipped_lines(skipped: Sequence[tuple[str, str]]) -> Iterator[str]:
    """skipped.jsonl: per file left out, its path and the reason."""
    for path, reason in skipped:
        yield json.dumps({"path": path, "reason": reason}, sort_keys=True) + "\n"


def read_sources(dataset_dir: str, index: Index) -> tuple[list[str], NDArray[np.int64]]:
    """The source files and the first sample of each (plus the end); FormatError if malformed."""
    is_line = _is_row_source if index.mode == "rows" else _is_file_source
    path = os.path.join(dataset_dir, SOURCES_NAME)
    lines = _read_lines(path, index.num_sources, is_line)
    if index.mode == "rows":
        files, counts = [file for file, _ in lines], [count for _, count in lines]
    else:
        files, counts = lines, [1] * len(lines)
    if sum(counts) != index.num_samples:
        raise FormatError(f"{path}: names {sum(counts)} samples, the index {index.num_samples}")
    starts = np.zeros(len(files) + 1, dtype=np.int64)
    np.cumsum(np.array(counts, dtype=np.int64), out=starts[1:])
    return files, starts


def read_skipped(dataset_dir: str, index: Index) -> list[tuple[str, str]]:
    """The files left out by --skip-bad and why; FormatError if malformed."""
    lines = _read_lines(os.path.join(dataset_dir, SKIPPED_NAME), index.num_skipped, _is_skip_record)
    return [(line["path"], line["reason"]) for line in lines]


def _is_file_source(line: Any) -> bool:
    return isinstance(line, str)


def _is_row_source(line: Any) -> bool:
    return (
        isinstance(line, list)
        and len(line) == 2
        and isinstance(line[0], str)
        and type(line[1]) is int
        and 0 <= line[1] < 1 << 63
    )


def _is_skip_record(line: Any) -> bool:
    return (
        isinstance(line, dict)
        and set(line) == {"path", "reason"}
        and all(isinstance(v, str) for v in line.values())
    )


def _read_lines(path: str, count: int, is_valid: Callable[[Any], bool]) -> list[Any]:
    """Exactly ``count`` valid JSON lines, each at most MAX_LINE_NBYTES; FormatError otherwise."""
    lines: list[Any] = []
    with _open_regular(path) as fp:
        while True:
            raw = fp.readline(MAX_LINE_NBYTES + 1)
            if not raw:
                break
            if len(lines) == count:
                raise FormatError(f"{path}: holds more than the {count} lines the index declares")
            if len(raw) > MAX_LINE_NBYTES:
                raise FormatError(f"{path}: line {len(lines) + 1} is longer than {MAX_LINE_NBYTES} bytes")
            lines.append(_parse_line(raw, path, len(lines) + 1, is_valid))
    if len(lines) != count:
        raise FormatError(f"{path}: holds {len(lines)} lines, the index declares {count}")
    return lines


def _parse_line(raw: bytes, path: str, number: int, is_valid: Callable[[Any], bool]) -> Any:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FormatError(f"{path}: line {number} is not valid JSON") from None
    if not is_valid(value):
        raise FormatError(f"{path}: line {number} is not a valid entry")
    return value


def _open_regular(path: str) -> BinaryIO:
    return os.fdopen(open_regular(path), "rb")
