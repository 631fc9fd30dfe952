"""Reading untrusted NPZ files: member headers, then member data in bounded chunks.

Nothing here blocks on, unpickles, evaluates or allocates what a file merely
claims: a source is opened without blocking and must be a regular file; a
member's zip sizes must be possible for its compression and lie inside the
file; a ``.npy`` header is read as a literal by np.load's own rules, its size
must be one numpy can represent and match what the zip entry holds, and every
read is bounded by those checked sizes.
"""

from __future__ import annotations

import ast
import contextlib
import io
import itertools
import math
import re
import struct
import tokenize
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Protocol

import numpy as np

from .. import fsutil
from ..errors import DatasetInputError, SourceError
from ..format.dtypes import storage_dtype
from ..format.index import (
    IDENTITY_MAGIC,
    NPY_MAGIC,
    checked_nbytes,
    representable_nbytes,
)
from ..text import brief
from .zip_directory import FileView, ZipEntry

NPY_SUFFIX = ".npy"
# .npy version -> (bytes of the header length, header text encoding), as numpy reads them.
NPY_VERSIONS = {(1, 0): (2, "latin1"), (2, 0): (4, "latin1"), (3, 0): (4, "utf-8")}
# np.load's default max_header_size, in characters: the header of a dtype with thousands of
# fields is longer (numpy's own tests save one of 145,588 bytes), so the caller may raise it.
MAX_NPY_HEADER_CHARS = 10_000
# The most anyone may raise it to: literal_eval's cost grows with the text, and a dtype read from
# a header this long still fits the index (a few MiB of JSON, well under MAX_INDEX_NBYTES).
MAX_HEADER_SIZE_LIMIT = 1_000_000
CHUNK_NBYTES = 4 << 20
HEADER_PIECE_NBYTES = 4096  # of a deflated member read at a time for its header
HEADER_INFLATE_NBYTES = 256  # inflated at a time for it: a .npy header is mostly 128 bytes
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

# Deflate expands at most 1032-fold (a 258-byte match costs at least 2 bits).
DEFLATE_MAX_RATIO = 1032
DEFLATE_SLACK_NBYTES = 1024
# A zip local file header: signature, version, flags, 18 bytes we do not need, name and extra lengths.
ZIP_LOCAL_HEADER = struct.Struct("<4s2xH18xHH")
ZIP_LOCAL_SIGNATURE = b"PK\x03\x04"
ZIP_STORED, ZIP_DEFLATED = 0, 8
ZIP_ENCRYPTED_FLAG = 0x1
ZIP_PATCHED_FLAG = 0x20
ZIP_STRONG_ENCRYPTION_FLAG = 0x40
ZIP_UTF8_FLAG = 0x800

# What reading a damaged or hostile file can raise from the standard library.
_READ_ERRORS = (zlib.error, OSError, ValueError)


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
    if not isinstance(chars, int) or isinstance(chars, bool):
        raise TypeError(f"max_header_size must be an integer, not {type(chars).__name__}")
    if not 1 <= chars <= MAX_HEADER_SIZE_LIMIT:
        raise ValueError(
            f"max_header_size must be from 1 to {MAX_HEADER_SIZE_LIMIT:,} characters, found {chars:,}"
        )
    return limit


@dataclass(frozen=True)
class MemberHeader:
    """What the ``.npy`` header of one NPZ member declares."""

    key: str
    dtype: np.dtype  # as np.load returns it
    shape: tuple[int, ...]
    fortran_order: bool
    header_nbytes: int
    nbytes: int  # of the array data that follows the header


class MemberLocation(NamedTuple):
    """Where the scan found a member's bytes, so the copy reads them with no zip parsing.

    The copy checks what it reads against every field: the file's size, the
    member's size and, for a zip member, its CRC-32.
    """

    file_nbytes: int  # of the file holding the member, when scanned
    offset: int  # of the member's first stored byte in that file
    stored_nbytes: int  # bytes it occupies there (deflated or not)
    nbytes: int  # its .npy header and data, uncompressed
    crc32: int  # of those bytes, from the zip directory; for a .npy file, of its header alone
    flags: int  # DEFLATED, NAMED_NPY, NPY_FILE, IN_SAMPLE_DIR


NO_CRC32 = -1
DEFLATED = 1
NAMED_NPY = 2  # the zip entry's name is the key with ".npy" (else the key itself)
NPY_FILE = 4  # a .npy file of its own, not a zip member
IN_SAMPLE_DIR = 8  # a .npy file of a sample directory
LOCATION_FIELDS = len(MemberLocation._fields)


def member_key(name: str) -> str:
    """The key numpy gives a member: its name without a ``.npy`` suffix."""
    return name[: -len(NPY_SUFFIX)] if name.endswith(NPY_SUFFIX) else name


@contextlib.contextmanager
def source_errors(where: str) -> Iterator[None]:
    """Turn what reading and inflating raise into a SourceError naming ``where``."""
    try:
        yield
    except _READ_ERRORS as exc:
        raise SourceError(f"{where}: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def open_regular_file(path: str) -> tuple[int, int]:
    """A read-only descriptor of ``path``, opened without blocking, and the file's size; SourceError
    unless it is a regular file.

    The type is that of the open descriptor, not of the path, so a file
    replaced by a FIFO or a device after it was checked is still refused.
    """
    try:
        return fsutil.open_regular_sized(path)
    except fsutil.NotRegularFile as exc:
        raise SourceError(f"{path}: {exc}") from None


def members(entries: Iterable[ZipEntry], path: str) -> tuple[list[ZipEntry], dict[str, ZipEntry]]:
    """Every entry and the map key -> zip entry, refusing an empty or duplicate key at the entry
    that has it (so a bad directory stops there); empty directory entries are no members.

    A directory entry that holds bytes is a member like any other, with the
    key ``np.load`` gives it (its name, slash included).
    """
    every: list[ZipEntry] = []
    found: dict[str, ZipEntry] = {}
    for entry in entries:
        every.append(entry)
        if entry.is_dir() and entry.file_size == 0:
            continue
        key = member_key(entry.filename)
        if not key:
            raise SourceError(f"{path}: field name '' is empty")  # as the plan says, but at once
        if key in found:
            raise SourceError(f"{path}: key {key!r} appears twice in the archive")
        found[key] = entry
    return every, found


def check_no_overlap(view: FileView, entries: list[ZipEntry], directory_offset: int, path: str) -> None:
    """Refuse a file whose members share bytes or reach into the central directory; SourceError
    naming the file and both keys.

    Entries pointing at the same or overlapping bytes let a small file expand
    into a large dataset (a zip bomb by overlap). Each entry spans its local
    header and its stored data; in order of start, no span may pass the next
    one's start (zipfile's ``_end_offset`` rule, which it applies to each member
    it opens), nor the directory's. Every entry is checked, not only the keys
    asked for. Entries already in order (numpy writes them so) are checked in
    one pass; others are sorted first, a sort bounded as the entry count is.
    """
    previous: ZipEntry | None = None
    previous_end = 0
    for entry in entries:
        if previous is not None and entry.header_offset < previous.header_offset:
            _check_sorted_spans(view, entries, directory_offset, path)
            return
        end = _stored_end(view, entry, path)
        if previous is not None and previous_end > entry.header_offset:
            _refuse_overlap(previous, entry, min(previous_end, end), path)
        previous, previous_end = entry, end
    if previous is not None and previous_end > directory_offset:
        _refuse_into_directory(previous, directory_offset, path)


def _check_sorted_spans(view: FileView, entries: list[ZipEntry], directory_offset: int, path: str) -> None:
    """check_no_overlap for entries out of order: the spans sorted by start."""
    spans = sorted(
        (entry.header_offset, _stored_end(view, entry, path), n) for n, entry in enumerate(entries)
    )
    for (_, end, n), (next_start, next_end, next_n) in itertools.pairwise(spans):
        if end > next_start:
            _refuse_overlap(entries[n], entries[next_n], min(end, next_end), path)
    if spans[-1][1] > directory_offset:
        _refuse_into_directory(entries[spans[-1][2]], directory_offset, path)


def _refuse_overlap(entry: ZipEntry, following: ZipEntry, shared_end: int, path: str) -> NoReturn:
    keys = member_key(entry.filename), member_key(following.filename)
    raise SourceError(
        f"{path}: not a valid zip/npz file (members {keys[0]!r} and {keys[1]!r} overlap, "
        f"bytes {following.header_offset} to {shared_end}: a possible zip bomb)"
    )


def _refuse_into_directory(entry: ZipEntry, directory_offset: int, path: str) -> NoReturn:
    key = member_key(entry.filename)
    raise SourceError(
        f"{path}: not a valid zip/npz file (member {key!r} runs into the central "
        f"directory at byte {directory_offset}: a possible zip bomb)"
    )


def read_member_header(
    view: FileView, entry: ZipEntry, path: str, limit: HeaderLimit = NP_LOAD_LIMIT
) -> tuple[MemberHeader, MemberLocation]:
    """Check a member's zip sizes, then read its .npy header; SourceError naming file and key.

    The header is read from the member's bytes where the zip says they are,
    inflated if need be, as zipfile would read them, without its per-member
    stream objects.
    """
    key = member_key(entry.filename)
    where = f"{path}[{key}]"
    location = check_member_sizes(view, entry, path)
    start = _MemberStart(view, location)
    try:
        header = parse_npy_header(start, key, where, limit)
        declared = header.header_nbytes + header.nbytes
        if declared != entry.file_size:
            raise SourceError(
                f"{where}: header declares {header.nbytes} data bytes but the member holds "
                f"{entry.file_size - header.header_nbytes}"
            )
        if header.nbytes >= len(IDENTITY_MAGIC):  # mostly read already, with the header
            if is_transposed(header) and not location.flags & DEFLATED:
                data_at = location.offset + header.header_nbytes
                read = lambda offset, nbytes: bytes(view.read(data_at + offset, nbytes))  # noqa: E731
                refuse_blob_data(first_stored_bytes(header, read), header.dtype.newbyteorder("<"), where)
            else:  # a deflated Fortran-order member would need inflating to its far elements: not looked at
                refuse_blob_data(start.read(blob_check_nbytes(header.dtype)), header.dtype, where)
    except NotNpyError as exc:  # a readme.txt zipped in: np.load returns such a member as bytes
        raise SourceError(
            f"{exc}; np.load gives such a member as raw bytes, not an array: "
            "name the keys to convert with --keys"
        ) from None
    except zlib.error as exc:
        raise SourceError(f"{where}: {exc}") from exc
    return header, location


# Past this itemsize only the bytes as found are compared with the identity (a record this
# large saved in another byte order is no plausible way to hide a blob).
MAX_SWAPPED_CHECK_NBYTES = 4096


def blob_check_nbytes(dtype: np.dtype) -> int:
    """How many bytes of an array's data refuse_blob_data needs: whole elements up to the identity's size."""
    if dtype.itemsize == 0 or dtype.itemsize > MAX_SWAPPED_CHECK_NBYTES:
        return len(IDENTITY_MAGIC)
    return max(len(IDENTITY_MAGIC), -(-len(IDENTITY_MAGIC) // dtype.itemsize) * dtype.itemsize)


def is_transposed(header: MemberHeader) -> bool:
    """Whether the array's bytes lie in another order than they are stored in (Fortran order)."""
    return header.fortran_order and sum(d > 1 for d in header.shape) > 1


def first_stored_bytes(header: MemberHeader, read_at: Callable[[int, int], bytes]) -> bytes:
    """The bytes the array's first elements take once stored (C order, little-endian), read
    element by element from their places in its Fortran-order data: enough to hold the identity."""
    dtype, shape = header.dtype, header.shape
    count = min(math.prod(shape), blob_check_nbytes(dtype) // max(dtype.itemsize, 1))
    places = np.ravel_multi_index(np.unravel_index(np.arange(count), shape), shape, order="F")
    raw = b"".join(read_at(int(place) * dtype.itemsize, dtype.itemsize) for place in places)
    if len(raw) != count * dtype.itemsize:
        return b""
    return np.frombuffer(raw, dtype).astype(storage_dtype(dtype)).tobytes()


def refuse_blob_data(data_start: bytes, dtype: np.dtype, where: str) -> None:
    """DatasetInputError when an array's data is stored starting with the identity every npz2mmap
    blob starts with: a dataset's blob, copied, linked, zipped or saved again in another dtype or
    byte order (compared as it would be stored, little-endian)."""
    stored = data_start
    little = storage_dtype(dtype)
    if (
        little != dtype
        and len(data_start) == blob_check_nbytes(dtype)
        and len(data_start) % dtype.itemsize == 0
    ):
        stored = np.frombuffer(data_start, dtype).astype(little).tobytes()
    if stored[: len(IDENTITY_MAGIC)] == IDENTITY_MAGIC or data_start[: len(IDENTITY_MAGIC)] == IDENTITY_MAGIC:
        raise DatasetInputError(
            f"{where}: holds the blob of an npz2mmap dataset (its data starts with the blob identity), "
            "not a source; convert its sources again by naming the paths listed in its dataset's "
            "sources.jsonl, or join datasets with npz2mmap merge"
        )


class _MemberStart:
    """Reads from the start of a member's uncompressed bytes (enough for its .npy header).

    The stored bytes are read through ``view`` a piece (HEADER_PIECE_NBYTES)
    ahead at most, so a header takes one read, and when the member is
    deflated only what the header needs is inflated (HEADER_INFLATE_NBYTES at
    a time); never past the member, nor past the size the zip gives it
    (as zipfile stops there).
    """

    def __init__(self, view: FileView, location: MemberLocation) -> None:
        self.view = view
        self.position = location.offset
        self.end = location.offset + location.stored_nbytes
        self.inflater = zlib.decompressobj(-zlib.MAX_WBITS) if location.flags & DEFLATED else None
        self.left = location.nbytes  # uncompressed bytes the zip says the member holds
        self.pending = b""
        self.used = 0  # bytes of ``pending`` already returned

    def read(self, nbytes: int) -> bytes:
        if len(self.pending) - self.used < nbytes:
            self._fill(nbytes)
        data = self.pending[self.used : self.used + nbytes]
        self.used += len(data)
        return data

    def _fill(self, nbytes: int) -> None:
        """Hold at least ``nbytes`` unread bytes, fewer only at the member's end."""
        pieces = [self.pending[self.used :]]
        wanted = nbytes - len(pieces[0])
        while wanted > 0 and self.left > 0:
            more = self._more(wanted)[: self.left]
            if not more:
                break
            pieces.append(more)
            wanted -= len(more)
            self.left -= len(more)
        self.pending, self.used = b"".join(pieces), 0

    def _more(self, wanted: int) -> bytes:
        if self.inflater is None:
            return bytes(self._stored(max(wanted, HEADER_PIECE_NBYTES)))
        nbytes = max(wanted, HEADER_INFLATE_NBYTES)
        if self.inflater.unconsumed_tail:
            return self.inflater.decompress(self.inflater.unconsumed_tail, nbytes)
        while not self.inflater.eof:
            raw = self._stored(HEADER_PIECE_NBYTES)
            if not raw:
                break
            data = self.inflater.decompress(raw, nbytes)
            if data:
                return data
        return b""

    def _stored(self, nbytes: int) -> memoryview:
        data = self.view.read(self.position, min(nbytes, self.end - self.position))
        self.position += len(data)
        return data


def check_member_sizes(view: FileView, entry: ZipEntry, path: str) -> MemberLocation:
    """Refuse zip sizes that no real member has, before anything is planned by them; say where it lies.

    A stored member occupies exactly its size, a deflated one at least
    1/1032 of it, and either lies inside the file. Other compressions (never
    written by numpy) have no such bound and are refused. SourceError naming the file and key.
    """
    where = f"{path}[{member_key(entry.filename)}]"
    if entry.flag_bits & ZIP_ENCRYPTED_FLAG:
        raise SourceError(f"{where}: member is encrypted")
    if entry.compress_type == ZIP_STORED:
        if entry.compress_size != entry.file_size:
            raise SourceError(
                f"{where}: stored member declares {entry.file_size} bytes but occupies {entry.compress_size}"
            )
    elif entry.compress_type == ZIP_DEFLATED:
        limit = entry.compress_size * DEFLATE_MAX_RATIO + DEFLATE_SLACK_NBYTES
        if entry.file_size > limit:
            raise SourceError(
                f"{where}: member declares {entry.file_size} bytes, more than its {entry.compress_size} "
                f"deflated bytes can hold (at most {limit})"
            )
    else:
        raise SourceError(
            f"{where}: compression method {entry.compress_type} is not supported "
            "(numpy writes stored or deflated members)"
        )
    offset = _check_member_inside_file(view, entry, path, where)
    flags = (DEFLATED if entry.compress_type == ZIP_DEFLATED else 0) | (
        NAMED_NPY if entry.filename.endswith(NPY_SUFFIX) else 0
    )
    return MemberLocation(view.file_nbytes, offset, entry.compress_size, entry.file_size, entry.crc32, flags)


def _check_member_inside_file(view: FileView, entry: ZipEntry, path: str, where: str) -> int:
    """Where the member's stored bytes start, after its local header, which must name it as
    the zip directory does (as zipfile checks when it opens a member)."""
    flags, name_nbytes, offset = _local_header(view, entry, path)
    name_start = entry.header_offset + ZIP_LOCAL_HEADER.size
    _check_local_name(bytes(view.read(name_start, name_nbytes)), flags, entry, where)
    if entry.flag_bits & ZIP_PATCHED_FLAG:
        raise SourceError(f"{where}: compressed patched data (flag bit 5)")
    if entry.flag_bits & ZIP_STRONG_ENCRYPTION_FLAG:
        raise SourceError(f"{where}: strong encryption (flag bit 6)")
    return offset


def _stored_end(view: FileView, entry: ZipEntry, path: str) -> int:
    """Where the entry's stored bytes end, by the lengths its local header gives."""
    return _local_header(view, entry, path)[2] + entry.compress_size


def _local_header(view: FileView, entry: ZipEntry, path: str) -> tuple[int, int, int]:
    """The flags and name length of the entry's local header, which must be one, and where its
    stored bytes start; they must end inside the file. SourceError naming the file and key."""
    start = entry.header_offset
    file_nbytes = view.file_nbytes
    if not 0 <= start <= file_nbytes - ZIP_LOCAL_HEADER.size:
        raise SourceError(
            f"{path}[{member_key(entry.filename)}]: member header at byte {start} "
            f"lies outside the {file_nbytes}-byte file"
        )
    signature, flags, name_nbytes, extra_nbytes = ZIP_LOCAL_HEADER.unpack(
        view.read(start, ZIP_LOCAL_HEADER.size)
    )
    if signature != ZIP_LOCAL_SIGNATURE:
        raise SourceError(f"{path}[{member_key(entry.filename)}]: no zip member header at byte {start}")
    offset = start + ZIP_LOCAL_HEADER.size + name_nbytes + extra_nbytes
    end = offset + entry.compress_size
    if end > file_nbytes:
        raise SourceError(
            f"{path}[{member_key(entry.filename)}]: member of {entry.compress_size} bytes would end "
            f"at byte {end}, past the end of the {file_nbytes}-byte file"
        )
    return flags, name_nbytes, offset


def _check_local_name(name: bytes, flags: int, entry: ZipEntry, where: str) -> None:
    """zipfile's own check, with its message, for members whose headers are read without it."""
    try:
        text = name.decode("utf-8" if flags & ZIP_UTF8_FLAG or name.isascii() else "cp437")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{where}: {exc}") from None
    if text != entry.orig_filename:
        raise SourceError(
            f"{where}: not a valid zip/npz file (File name in directory "
            f"{entry.orig_filename!r} and header {name!r} differ.)"
        )


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


def data_after_header(chunks: Iterator[bytes], header_nbytes: int) -> Iterator[bytes]:
    """The chunks of a member's bytes (see located_bytes) without its first ``header_nbytes``."""
    skip = header_nbytes
    for chunk in chunks:
        if skip >= len(chunk):
            skip -= len(chunk)
            continue
        yield chunk[skip:] if skip else chunk
        skip = 0


def located_bytes(
    fd: int, file_nbytes: int, location: MemberLocation, key: str, where: str
) -> Iterator[bytes]:
    """A member's uncompressed bytes (.npy header and data) read where the scan found them.

    In chunks of at most CHUNK_NBYTES. SourceError, naming ``where``, when the
    file's size (``file_nbytes``, the open file's) is not the one scanned,
    when the member's bytes are more or fewer than scanned, or when their
    CRC-32 is not the zip directory's; the checks that need every byte run
    after the last chunk.
    """
    if file_nbytes != location.file_nbytes:
        raise SourceError(
            f"{where}: changed since it was scanned "
            f"(the file held {location.file_nbytes} bytes, now {file_nbytes})"
        )
    stored = _stored_chunks(fd, location.offset, location.stored_nbytes, where)
    chunks = _inflated(stored, location.nbytes, where) if location.flags & DEFLATED else stored
    produced = 0
    crc = 0
    for chunk in chunks:
        produced += len(chunk)
        if produced > location.nbytes:
            raise SourceError(f"{where}: member holds more bytes than its header declares")
        if location.crc32 != NO_CRC32:
            crc = zlib.crc32(chunk, crc)
        yield chunk
    if produced != location.nbytes:
        raise SourceError(f"{where}: ends early ({produced} of {location.nbytes} bytes)")
    if location.crc32 != NO_CRC32 and crc != location.crc32:
        name = key + NPY_SUFFIX if location.flags & NAMED_NPY else key
        raise SourceError(f"{where}: Bad CRC-32 for file {name!r} (corrupt, or changed since it was scanned)")


def _stored_chunks(fd: int, offset: int, nbytes: int, where: str) -> Iterator[bytes]:
    end = offset + nbytes
    while offset < end:
        try:
            chunk = fsutil.read_at(fd, min(CHUNK_NBYTES, end - offset), offset)
        except OSError as exc:
            fsutil.reraise_if_from_a_handler(exc)
            raise SourceError(f"{where}: cannot read ({exc.strerror or exc})") from None
        if not chunk:
            raise SourceError(f"{where}: ends early (changed since it was scanned?)")
        offset += len(chunk)
        yield chunk


def _inflated(chunks: Iterator[bytes], nbytes: int, where: str) -> Iterator[bytes]:
    """Raw deflate data inflated in pieces of at most CHUNK_NBYTES, never more than ``nbytes`` + 1 in all."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    produced = 0
    try:
        for chunk in chunks:
            pending = chunk
            while True:
                piece = inflater.decompress(pending, CHUNK_NBYTES)
                pending = inflater.unconsumed_tail
                produced += len(piece)
                if piece:
                    yield piece
                if produced > nbytes or (not pending and len(piece) < CHUNK_NBYTES):
                    break
            if produced > nbytes or inflater.eof:
                break
    except zlib.error as exc:
        raise SourceError(f"{where}: not a valid zip/npz file ({exc})") from None
