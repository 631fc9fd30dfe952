"""Reading a .npy header as np.load would, from any stream, never evaluating code.

Accepts exactly the headers np.load accepts (numpy/lib/_format_impl.py): versions 1.0, 2.0
and 3.0, a dict literal of descr, fortran_order and shape, a size numpy can represent. The
result, a MemberHeader, says what the data that follows holds; where the bytes come from
(a zip member, a .npy file) is the caller's (npz.py, sources.py).
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import SourceError
from ..format.index import (
    NPY_MAGIC,
    checked_nbytes,
    representable_nbytes,
)
from ..text import brief

# .npy version -> (bytes of the header length, header text encoding), as numpy reads them.
NPY_VERSIONS = {(1, 0): (2, "latin1"), (2, 0): (4, "latin1"), (3, 0): (4, "utf-8")}

# np.load's default max_header_size, in characters: the header of a dtype with thousands of
# fields is longer (numpy's own tests save one of 145,588 bytes), so the caller may raise it.
MAX_NPY_HEADER_CHARS = 10_000

# The most anyone may raise it to: literal_eval's cost grows with the text, and a dtype read from
# a header this long still fits the index (a few MiB of JSON, well under MAX_INDEX_NBYTES).
MAX_HEADER_SIZE_LIMIT = 1_000_000

HEADER_KEYS = {"descr", "fortran_order", "shape"}

# Accepted header texts remembered (see _parsed_header): at most this many, each at most this long.
HEADER_CACHE_ENTRIES = 4096

HEADER_CACHE_MAX_CHARS = 1024

ParsedHeader = tuple[np.dtype, tuple[int, ...], bool, int]  # dtype, shape, fortran order, data nbytes

_accepted_headers: dict[tuple[str, tuple[int, int]], ParsedHeader] = {}

# numpy's own header text (format._write_array_header): a simple type string, then spaces and a newline.
_DIM = r"(?:0|[1-9][0-9]{0,18})"

_CANONICAL_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[A-Za-z][A-Za-z0-9\[\]]*)', 'fortran_order': (False|True), "
    rf"'shape': \((|{_DIM},|{_DIM}(?:, {_DIM})+)\), \}} *\n?"
)


class HeaderLimit(NamedTuple):
    """The longest .npy header read, in characters (np.load's ``max_header_size``), and how a
    message names the option that raises it (formatted with the length that would do)."""

    max_chars: int = MAX_NPY_HEADER_CHARS
    option: str = "max_header_size={}"


NP_LOAD_LIMIT = HeaderLimit()

CLI_HEADER_OPTION = "--max-header-size {}"

# The copy re-reads headers the scan accepted; their length is fixed by the member's scanned size.
SCANNED_LIMIT = HeaderLimit(MAX_HEADER_SIZE_LIMIT)


def header_limit(max_header_size: int | HeaderLimit | None) -> HeaderLimit:
    """The limit a caller asked for: None for np.load's default, or a number of characters (a
    HeaderLimit, as the CLI passes, also names its option). TypeError unless an int, ValueError
    unless from 1 to MAX_HEADER_SIZE_LIMIT."""
    if max_header_size is None:
        return NP_LOAD_LIMIT
    limit = max_header_size if isinstance(max_header_size, HeaderLimit) else HeaderLimit(max_header_size)
    chars = limit.max_chars
    if isinstance(chars, (bool, np.bool_)) or not isinstance(chars, (int, np.integer)):
        raise TypeError(f"max_header_size must be an integer, not {type(chars).__name__}")
    chars = int(chars)  # numpy's integers too, taken as the number they are
    if not 1 <= chars <= MAX_HEADER_SIZE_LIMIT:
        raise ValueError(
            f"max_header_size must be from 1 to {MAX_HEADER_SIZE_LIMIT:,} characters, found {chars:,}"
        )
    return limit._replace(max_chars=chars)


@dataclass(frozen=True)
class MemberHeader:
    """What the ``.npy`` header of one NPZ member declares."""

    key: str
    dtype: np.dtype  # as np.load returns it
    shape: tuple[int, ...]
    fortran_order: bool
    header_nbytes: int
    nbytes: int  # of the array data that follows the header


class NotNpyError(SourceError):
    """Bytes that do not start as a .npy file does."""


class Readable(Protocol):
    def read(self, nbytes: int, /) -> bytes: ...


def parse_npy_header(
    stream: Readable, key: str, where: str, limit: HeaderLimit = NP_LOAD_LIMIT
) -> MemberHeader:
    """Parse a .npy header (versions 1.0, 2.0, 3.0) from the start of ``stream``.

    Accepts exactly the headers np.load accepts with ``max_header_size=limit.max_chars``
    (numpy/lib/_format_impl.py, ``_read_array_header`` and ``read_array``), except
    dtypes that hold Python objects or have no size; never evaluates code. Raises SourceError.
    """
    magic = stream.read(len(NPY_MAGIC) + 2)
    if not magic:
        raise NotNpyError(f"{where}: empty, not a .npy array")
    if magic[: len(NPY_MAGIC)] != NPY_MAGIC[: len(magic)]:
        raise NotNpyError(f"{where}: not a .npy array (bad magic bytes)")
    if len(magic) != len(NPY_MAGIC) + 2:
        raise SourceError(f"{where}: ends early ({len(magic)} of {len(NPY_MAGIC) + 2} bytes)")
    version = (magic[-2], magic[-1])
    if version not in NPY_VERSIONS:
        raise SourceError(f"{where}: .npy format version {version[0]}.{version[1]} is not supported")
    length_nbytes, encoding = NPY_VERSIONS[version]
    text_nbytes = int.from_bytes(read_exactly(stream, length_nbytes, where), "little")
    # Checked before reading: a UTF-8 character takes at most 4 bytes.
    bytes_per_char = 4 if encoding == "utf-8" else 1
    if text_nbytes > limit.max_chars * bytes_per_char:
        raise _header_too_long(text_nbytes, "bytes", -(-text_nbytes // bytes_per_char), limit, where)
    try:
        text = read_exactly(stream, text_nbytes, where).decode(encoding)
    except UnicodeDecodeError:
        raise SourceError(f"{where}: .npy header is not valid {encoding}") from None
    if len(text) > limit.max_chars:
        raise _header_too_long(len(text), "characters", len(text), limit, where)
    dtype, shape, fortran, nbytes = _parsed_header(text, version, where)
    return MemberHeader(key, dtype, shape, fortran, len(magic) + length_nbytes + text_nbytes, nbytes)


def _header_too_long(
    length: int, unit: str, fewest_chars: int, limit: HeaderLimit, where: str
) -> SourceError:
    """The error for a header over the limit: np.load's default says so, and the way out is named
    (a limit of ``length`` reads it, as a text of ``length`` bytes has at most that many characters)."""
    default = " (np.load's default)" if limit.max_chars == MAX_NPY_HEADER_CHARS else ""
    if fewest_chars > MAX_HEADER_SIZE_LIMIT:
        way_out = f"npz2mmap reads no header over {MAX_HEADER_SIZE_LIMIT:,} characters"
    else:
        way_out = f"pass {limit.option.format(min(length, MAX_HEADER_SIZE_LIMIT))} if you trust this file"
    return SourceError(
        f"{where}: .npy header of {length:,} {unit} exceeds the limit of {limit.max_chars:,}"
        f"{default}; {way_out}"
    )


def _parsed_header(text: str, version: tuple[int, int], where: str) -> ParsedHeader:
    """``_check_header_dict`` of the header's literal, remembered by the exact header text.

    Sources mostly repeat a few headers (and each is read by the scan and
    again by the copy), so a header text already accepted is not parsed
    again; only short texts are kept, and a full cache is emptied, so its
    memory stays bounded. Headers that are refused are never kept.
    """
    cache_key = (text, version)
    parsed = _accepted_headers.get(cache_key)
    if parsed is None:
        literal: object = _canonical_header(text)
        if literal is None:
            literal = _header_literal(text, version, where)
        parsed = _check_header_dict(literal, where)
        if len(text) <= HEADER_CACHE_MAX_CHARS:
            if len(_accepted_headers) >= HEADER_CACHE_ENTRIES:
                _accepted_headers.clear()
            _accepted_headers[cache_key] = parsed
    return parsed


def _canonical_header(text: str) -> dict[str, object] | None:
    """The literal of a header exactly as numpy writes it, without the Python parser; None for any other.

    Only texts that ast.literal_eval reads as the same dict match: a plain
    type string, a bool, a tuple of decimal ints without leading zeros.
    """
    match = _CANONICAL_HEADER.fullmatch(text)
    if match is None:
        return None
    descr, fortran, dims = match.groups()
    shape = tuple(int(d) for d in dims.replace(",", " ").split())
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}


def _header_literal(text: str, version: tuple[int, int], where: str) -> object:
    """The header's literal, read as np.load reads it: Python 2 longs (``3L``) allowed up to 2.0."""
    try:
        try:
            return ast.literal_eval(text)
        except SyntaxError:
            if version > (2, 0):
                raise
            return ast.literal_eval(_drop_long_suffixes(text))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, tokenize.TokenError):
        raise SourceError(f"{where}: .npy header is not a valid Python literal") from None


def _drop_long_suffixes(text: str) -> str:
    """Remove the ``L`` that follows a number token, as numpy's ``_filter_header`` does."""
    tokens = []
    after_number = False
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if after_number and token.type == tokenize.NAME and token.string == "L":
            continue
        tokens.append(token)
        after_number = token.type == tokenize.NUMBER
    return tokenize.untokenize(tokens)


def _check_header_dict(header: object, where: str) -> ParsedHeader:
    """The dtype np.load would return, the shape, the order and the data's byte size."""
    if not isinstance(header, dict) or header.keys() != HEADER_KEYS:
        raise SourceError(f"{where}: .npy header must be a dict with keys {sorted(HEADER_KEYS)}")
    shape, fortran = header["shape"], header["fortran_order"]
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise SourceError(f"{where}: .npy header shape {brief(shape)} is not a tuple of non-negative ints")
    if not isinstance(fortran, bool):
        raise SourceError(f"{where}: .npy header fortran_order {brief(fortran)} is not a bool")
    descr = header["descr"]
    dtype = _descr_dtype(descr, where)
    if dtype.hasobject:
        raise SourceError(
            f"{where}: dtype {dtype} holds pickled Python objects, which npz2mmap never loads; "
            "convert them to a numeric or fixed-width string array first"
        )
    element, subshape = _split_subarray(dtype)
    nbytes = checked_nbytes(shape, element.itemsize, where, SourceError)
    if dtype.subdtype is not None:
        _check_subarray(descr, element, subshape, math.prod(shape), where)
    if element.itemsize == 0:
        raise SourceError(f"{where}: dtype {element} has no size")
    return element, shape, fortran, nbytes


def _descr_dtype(descr: Any, where: str) -> np.dtype:
    try:
        with warnings.catch_warnings():
            # np.load accepts deprecated spellings (such as 'a5') with a warning; so do we, quietly.
            warnings.simplefilter("ignore")
            return np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError):
        raise SourceError(f"{where}: .npy header descr {brief(descr)} is not a valid dtype") from None


def _split_subarray(dtype: np.dtype) -> tuple[np.dtype, tuple[int, ...]]:
    """The element dtype and the shape a (possibly nested) subarray dtype expands into."""
    subshape: tuple[int, ...] = ()
    while dtype.subdtype is not None:
        dtype, shape = dtype.subdtype
        subshape += shape
    return dtype, subshape


def _check_subarray(descr: Any, element: np.dtype, subshape: tuple[int, ...], count: int, where: str) -> None:
    """Refuse a subarray descr such as ``('<f8', (2,))`` unless np.load can read it.

    np.load reads ``count`` items of the subarray dtype, which gives
    ``count * prod(subshape)`` elements, and refuses unless that equals ``count``.
    """
    if representable_nbytes((count, *subshape), element.itemsize) is None or (
        count and math.prod(subshape) != 1
    ):
        raise SourceError(
            f"{where}: .npy header descr {brief(descr)} is a subarray dtype "
            f"with {count} items of shape {subshape}, which np.load cannot read"
        )


def read_exactly(stream: Readable, nbytes: int, where: str) -> bytes:
    data = stream.read(nbytes)
    if len(data) != nbytes:
        raise SourceError(f"{where}: ends early ({len(data)} of {nbytes} bytes)")
    return data
