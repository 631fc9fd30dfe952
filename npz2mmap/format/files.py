"""Bounded reading of a dataset's small files (``index.json``, ``manifest.json``, the ``.jsonl``
files): opened without blocking, read up to a size, decoded as JSON with every number bounded.

The index, the manifest and the provenance files are read only through here, so a pipe in a
file's place, a huge file or a number too long to convert is refused the same way everywhere.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import fsutil
from ..errors import FormatError
from ..text import brief

# Every number in an index is at most 2**63 - 1, which has 19 digits; longer
# numbers are refused before Python converts them (which is quadratic, and
# past 4300 digits a ValueError).
MAX_INT_DIGITS = len(str((1 << 63) - 1))


def open_regular(path: str, missing: str = "missing") -> int:
    """A read-only descriptor of a dataset file that must be a regular file.

    Opened without blocking and checked on the descriptor (fsutil.open_regular),
    so a pipe or a device in its place is refused at once. Raises FormatError
    naming the file; ``missing`` says what its absence means.
    """
    try:
        return fsutil.open_regular(path)
    except FileNotFoundError:
        raise FormatError(f"{path}: {missing}") from None
    except OSError as exc:
        if not fsutil.is_io_error(exc):  # a signal handler's, not the file's: the caller's to see
            raise
        raise FormatError(f"{path}: cannot open ({exc.strerror or exc})") from None
    except fsutil.NotRegularFile as exc:
        raise FormatError(f"{path}: {exc}") from None


def read_regular_file(path: str, max_nbytes: int) -> bytes:
    """The whole of a small dataset file (``index.json``, ``manifest.json``), never more
    than ``max_nbytes`` read, so a huge file in its place is refused; FormatError otherwise."""
    fd = open_regular(path, missing="missing; is this an npz2mmap dataset?")
    try:
        with os.fdopen(fd, "rb") as fp:
            raw = fp.read(max_nbytes + 1)
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > max_nbytes:
        raise FormatError(f"{path}: larger than {max_nbytes} bytes; not a valid {os.path.basename(path)}")
    return raw


class _TooManyDigits(ValueError):
    pass


def _bounded_int(text: str) -> int:
    """json's int parser with the digits bounded first: longer numbers are never converted."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _TooManyDigits(digits)
    return int(text)


def decode_json(raw: bytes, where: str) -> Any:
    """The JSON value of ``raw``; FormatError if it is not UTF-8 JSON, nests too deeply,
    holds an integer of more than MAX_INT_DIGITS digits or an object with a key twice
    (which json would read as its last value, where another reader may take the first)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except _TooManyDigits as exc:
        raise FormatError(
            f"{where}: holds an integer of {exc.args[0]} digits; no number npz2mmap reads has more "
            f"than {MAX_INT_DIGITS}"
        ) from None
    except ValueError as exc:  # also UnicodeDecodeError and json.JSONDecodeError
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {brief(key)} appears twice in one object")
            seen.add(key)
    return document
