"""Reading untrusted NPZ files: member headers, then member data in bounded chunks.

Nothing here blocks on, unpickles, evaluates or allocates what a file merely
claims: a source is opened without blocking and must be a regular file; a
member's zip sizes must be possible for its compression and lie inside the
file; a ``.npy`` header is read as a literal by np.load's own rules, its size
must be one numpy can represent and match what the zip entry holds, and every
read is bounded by those checked sizes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, NoReturn

import numpy as np

from .. import fsutil
from ..errors import DatasetInputError, SourceError
from ..format.dtypes import storage_dtype
from ..format.index import (
    IDENTITY_MAGIC,
)
from .npy_header import NP_LOAD_LIMIT, HeaderLimit, MemberHeader, NotNpyError, parse_npy_header
from .zip_directory import LOCAL_SIGNATURE, FileView, ZipEntry

NPY_SUFFIX = ".npy"

CHUNK_NBYTES = 4 << 20

HEADER_PIECE_NBYTES = 4096  # of a deflated member read at a time for its header

HEADER_INFLATE_NBYTES = 256  # inflated at a time for it: a .npy header is mostly 128 bytes

# Deflate expands at most 1032-fold (a 258-byte match costs at least 2 bits).
DEFLATE_MAX_RATIO = 1032

DEFLATE_SLACK_NBYTES = 1024

# A zip local file header: signature, version, flags, 18 bytes we do not need, name and extra lengths.
ZIP_LOCAL_HEADER = struct.Struct("<4s2xH18xHH")


ZIP_STORED, ZIP_DEFLATED = 0, 8

ZIP_ENCRYPTED_FLAG = 0x1

ZIP_PATCHED_FLAG = 0x20

ZIP_STRONG_ENCRYPTION_FLAG = 0x40

ZIP_UTF8_FLAG = 0x800

# What reading a damaged or hostile file can raise from the standard library.
_READ_ERRORS = (zlib.error, OSError, ValueError)


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
    if signature != LOCAL_SIGNATURE:
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
