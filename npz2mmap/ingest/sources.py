"""What a source holds: the arrays of an NPZ file, a ``.npy`` file or a sample directory.

The scan, the copy and ``verify --sources`` read every kind through one
interface (``open_source``): the source's keys, each key's checked ``.npy``
header, and its data in bounded chunks. A ``.npy`` file is one array under
the key ``arr_0``, the name ``np.savez(f, array)`` gives it, so it converts
exactly as that NPZ would; a sample directory holds one array per
``NAME.npy`` file directly inside it, under the key NAME. Other files in a
sample directory are ignored, hidden ones (``.DS_Store``, ``._NAME.npy``) too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import zlib
from collections.abc import Iterator, Sequence
from typing import BinaryIO, Protocol

from .. import fsutil
from ..errors import KeyAbsentError, SourceError
from ..format.dtypes import storage_dtype
from ..format.index import IDENTITY_MAGIC, NPY_MAGIC
from ..text import quoted
from .npy_header import NP_LOAD_LIMIT, HeaderLimit, MemberHeader, parse_npy_header
from .npz import (
    CHUNK_NBYTES,
    IN_SAMPLE_DIR,
    NO_CRC32,
    NPY_FILE,
    NPY_SUFFIX,
    MemberLocation,
    blob_check_nbytes,
    check_no_overlap,
    data_after_header,
    first_stored_bytes,
    is_transposed,
    located_bytes,
    members,
    open_regular_file,
    read_member_header,
    refuse_blob_data,
    source_errors,
)
from .zip_directory import FileView, ZipEntry, directory_entries

NPY_FILE_KEY = "arr_0"


class Source(Protocol):
    """The arrays of one source, by key."""

    def keys(self) -> list[str]:
        """Every key, sorted."""

    def header(self, key: str) -> MemberHeader:
        """The checked header of ``key``; SourceError naming the file (and key)."""

    def data_chunks(self, key: str, header: MemberHeader) -> Iterator[bytes]:
        """The array bytes of ``key`` in file order, at most CHUNK_NBYTES at a time."""

    def location(self, key: str) -> MemberLocation:
        """Where the bytes of ``key``, whose header was read, lie (see npzfile.located_bytes)."""

    def located_bytes(self, key: str, location: MemberLocation) -> Iterator[bytes]:
        """The .npy header and data of ``key`` read at ``location``, with no zip parsing; checked
        against it as they are read (npzfile.located_bytes)."""


def is_npy_path(path: str) -> bool:
    return path.lower().endswith(NPY_SUFFIX)


def is_hidden(name: str) -> bool:
    """Whether a directory entry is hidden, so never a source nor a field: ``.DS_Store``, macOS's
    ``._NAME.npy`` companions, a bare ``.npy``, the hidden directories beside a dataset being written."""
    return name.startswith(".")


def is_field_name(name: str) -> bool:
    """Whether an entry of a sample directory, if a file, is one of its fields: ``NAME.npy``, not hidden."""
    return is_npy_path(name) and not is_hidden(name)


SAMPLE_DIR, NPY, NPZ = "a directory of .npy files", "a .npy file", "an NPZ file"


def kind_now(path: str) -> str:
    """What a source is: a directory is a sample directory, a ``*.npy`` file one array, anything
    else an NPZ file."""
    return _kind(path, _mode_now(path))


def _kind(path: str, mode: int) -> str:
    if stat.S_ISDIR(mode):
        return SAMPLE_DIR
    return NPY if is_npy_path(path) else NPZ


def _mode_now(path: str) -> int:
    """The st_mode of what ``path`` names, links followed; 0 if there is none (opening it says why)."""
    try:
        return os.stat(path).st_mode
    except (OSError, ValueError) as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return 0


def kind_scanned(location: MemberLocation) -> str:
    """What the scan found the source of a member to be."""
    if location.flags & IN_SAMPLE_DIR:
        return SAMPLE_DIR
    return NPY if location.flags & NPY_FILE else NPZ


@contextlib.contextmanager
def open_source(
    path: str, scanned: str | None = None, limit: HeaderLimit = NP_LOAD_LIMIT
) -> Iterator[Source]:
    """Open a source by what it is (see kind_now). Raises SourceError naming the path, also when
    it is no longer what the scan found (``scanned``, one of kind_now's answers); headers
    longer than ``limit`` are refused."""
    mode = _mode_now(path)
    kind = _kind(path, mode)
    if scanned is not None and kind != scanned:
        raise SourceError(f"{path}: changed since it was scanned ({scanned} then, {kind} now)")
    if kind != SAMPLE_DIR and mode:
        # Never open a pipe or a device (opening one may have effects); one swapped in after
        # this check is refused by the type of the descriptor opened.
        _check_regular(path, mode)
    if kind == SAMPLE_DIR:
        with _SampleDir(path, limit) as sample_dir:
            yield sample_dir
    elif kind == NPY:
        with _NpyFile(path, limit) as npy:
            yield _OneArray(npy)
    else:
        with _Npz(path, limit) as npz:
            yield npz


def read_headers(path: str, keys: Sequence[str] | None = None) -> dict[str, MemberHeader]:
    """The headers of ``keys`` (all if None) of one source, without reading any array data."""
    return scan_source(path, keys)[0]


def scan_source(
    path: str, keys: Sequence[str] | None = None, limit: HeaderLimit = NP_LOAD_LIMIT
) -> tuple[dict[str, MemberHeader], dict[str, MemberLocation]]:
    """The headers of ``keys`` (all if None) of one source and where each member lies."""
    with open_source(path, limit=limit) as source:
        available = source.keys()
        if not available:  # a bad file (np.savez of nothing), left out by --skip-bad, not a disagreement
            raise SourceError(f"{path}: holds no arrays")
        headers = {}
        for key in available if keys is None else keys:
            if key not in available:  # a disagreement on keys, which --skip-bad does not leave out
                message = f"{path}: no key {key!r} (has: {quoted(available)})"
                raise KeyAbsentError(message, path, key, tuple(available))
            headers[key] = source.header(key)
        return headers, {key: source.location(key) for key in headers}


class _Npz:
    """An NPZ file, opened at once; its zip directory is parsed only when keys or headers are asked."""

    def __init__(self, path: str, limit: HeaderLimit) -> None:
        self.path = path
        self.limit = limit
        try:
            self.fd, self.file_nbytes = open_regular_file(path)
        except OSError as exc:
            fsutil.reraise_if_from_a_handler(exc)
            raise _cannot_open(path, exc) from None
        # Made on first use: the copy reads members by location, without them.
        self.entries: dict[str, ZipEntry] | None = None
        self.view: FileView | None = None
        self.locations: dict[str, MemberLocation] = {}

    def __enter__(self) -> _Npz:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def _zip(self) -> tuple[FileView, dict[str, ZipEntry]]:
        if self.view is None or self.entries is None:
            self.view = FileView(self.fd, self.file_nbytes, self.path)
            directory, directory_offset = directory_entries(self.view)
            entries, by_key = members(directory, self.path)
            check_no_overlap(self.view, entries, directory_offset, self.path)
            if entries and min(entry.header_offset for entry in entries) > 0:  # no member at byte 0
                _refuse_bytes_before_the_zip(bytes(self.view.read(0, len(NPY_MAGIC))), self.path)
            self.entries = by_key  # only once every check passed: a refused file stays refused
        return self.view, self.entries

    def keys(self) -> list[str]:
        return sorted(self._zip()[1])

    def header(self, key: str) -> MemberHeader:
        view, entries = self._zip()
        header, self.locations[key] = read_member_header(view, entries[key], self.path, self.limit)
        return header

    def data_chunks(self, key: str, header: MemberHeader) -> Iterator[bytes]:
        """Read by the location header() found, so the CRC-32 of the whole member is checked."""
        if key not in self.locations:
            self.header(key)
        chunks = self.located_bytes(key, self.locations[key])
        return data_after_header(chunks, header.header_nbytes)

    def location(self, key: str) -> MemberLocation:
        return self.locations[key]

    def located_bytes(self, key: str, location: MemberLocation) -> Iterator[bytes]:
        return located_bytes(self.fd, self.file_nbytes, location, key, f"{self.path}[{key}]")


# How np.load tells an NPZ: by its first bytes, a member's local header or (empty) the end record.
NP_LOAD_ZIP_PREFIXES = (b"PK\x03\x04", b"PK\x05\x06")


def _refuse_bytes_before_the_zip(start: bytes, path: str) -> None:
    """SourceError for an .npz whose zip does not start at its first byte. np.load reads only a
    file that starts as a zip does as an NPZ (numpy/lib/_npyio_impl.py, load): one that starts as
    a .npy file is that one array, and anything else, a pickle say, is refused."""
    if start.startswith(NP_LOAD_ZIP_PREFIXES):
        return
    if start.startswith(NPY_MAGIC):
        raise SourceError(
            f"{path}: not a valid zip/npz file: it starts as a .npy file does, and np.load reads it "
            "as one array; rename it to .npy to convert that array"
        )
    raise SourceError(
        f"{path}: not a valid zip/npz file: its zip does not start at its first byte, and np.load "
        "reads no such file as an NPZ (bytes before it, a pickle say, are not converted)"
    )


class _NpyFile:
    """One open ``.npy`` file, which must be exactly its header and its data.

    np.load ignores bytes after the data; they are refused here, as in an NPZ
    member, so that a ``.npy`` file converts exactly as the NPZ holding it would.
    """

    def __init__(self, path: str, limit: HeaderLimit) -> None:
        self.path = path
        self.limit = limit
        self.fp = _open_npy(path)
        self.header_crc32 = NO_CRC32  # of the header bytes header() last read

    def __enter__(self) -> _NpyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fp.close()

    def header(self, key: str) -> MemberHeader:
        file_nbytes = os.fstat(self.fp.fileno()).st_size
        if file_nbytes == 0:
            raise SourceError(f"{self.path}: empty file (0 bytes), not a .npy array")
        with source_errors(self.path):
            self.fp.seek(0)
            header = parse_npy_header(self.fp, key, self.path, self.limit)
        declared = header.header_nbytes + header.nbytes
        if declared > file_nbytes:
            raise SourceError(
                f"{self.path}: header declares {header.nbytes} data bytes but the file holds "
                f"{file_nbytes - header.header_nbytes}"
            )
        if declared < file_nbytes:
            raise SourceError(
                f"{self.path}: {file_nbytes - declared} bytes follow the {header.nbytes} data bytes its "
                f"header declares; np.load would ignore them, npz2mmap does not: truncate the file to "
                f"{declared} bytes or save the array again"
            )
        with source_errors(self.path):
            self.header_crc32 = zlib.crc32(fsutil.read_at(self.fp.fileno(), header.header_nbytes, 0))
        self._refuse_blob(header)
        return header

    def _refuse_blob(self, header: MemberHeader) -> None:
        """DatasetInputError for an npz2mmap blob under any name or dtype: its bytes say so."""
        if header.nbytes < len(IDENTITY_MAGIC):
            return
        fd = self.fp.fileno()
        with source_errors(self.path):
            if is_transposed(header):

                def read(offset: int, nbytes: int) -> bytes:
                    return fsutil.read_at(fd, nbytes, header.header_nbytes + offset)

                start, dtype = first_stored_bytes(header, read), storage_dtype(header.dtype)
            else:
                nbytes = min(blob_check_nbytes(header.dtype), header.nbytes)
                start, dtype = fsutil.read_at(fd, nbytes, header.header_nbytes), header.dtype
        refuse_blob_data(start, dtype, self.path)

    def data_chunks(self, header: MemberHeader) -> Iterator[bytes]:
        with source_errors(self.path):
            self.fp.seek(header.header_nbytes)
            remaining = header.nbytes
            while remaining:
                chunk = self.fp.read(min(CHUNK_NBYTES, remaining))
                if not chunk:
                    raise SourceError(f"{self.path}: ends {remaining} bytes early (changed since scanned?)")
                remaining -= len(chunk)
                yield chunk
            if self.fp.read(1):
                raise SourceError(f"{self.path}: holds more bytes than its header declares")

    def location(self) -> MemberLocation:
        """The whole file (a .npy file is exactly its header and data) and the CRC-32 of the header
        header() read: the file has no checksum of its own, so the copy can tell only a changed header."""
        file_nbytes = os.fstat(self.fp.fileno()).st_size
        return MemberLocation(file_nbytes, 0, file_nbytes, file_nbytes, self.header_crc32, NPY_FILE)

    def located_bytes(self, key: str, location: MemberLocation) -> Iterator[bytes]:
        """The file's bytes, once its header is checked again and found to be the one scanned."""
        self.header(key)
        if self.header_crc32 != location.crc32:
            raise SourceError(f"{self.path}: changed since it was scanned (another .npy header)")
        file_nbytes = os.fstat(self.fp.fileno()).st_size
        unchecked = location._replace(crc32=NO_CRC32)
        return located_bytes(self.fp.fileno(), file_nbytes, unchecked, key, self.path)


class _OneArray:
    """A ``.npy`` file as a source: one key, ``arr_0``."""

    def __init__(self, npy: _NpyFile) -> None:
        self.npy = npy

    def keys(self) -> list[str]:
        return [NPY_FILE_KEY]

    def header(self, key: str) -> MemberHeader:
        return self.npy.header(key)

    def data_chunks(self, key: str, header: MemberHeader) -> Iterator[bytes]:
        return self.npy.data_chunks(header)

    def location(self, key: str) -> MemberLocation:
        return self.npy.location()

    def located_bytes(self, key: str, location: MemberLocation) -> Iterator[bytes]:
        return self.npy.located_bytes(key, location)


class _SampleDir:
    """A directory whose ``NAME.npy`` files are the fields of one sample, opened on first use."""

    def __init__(self, path: str, limit: HeaderLimit) -> None:
        self.path = path
        self.limit = limit
        self.files = sample_dir_files(path)
        self.opened: dict[str, _NpyFile] = {}
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> _SampleDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def keys(self) -> list[str]:
        return sorted(self.files)

    def header(self, key: str) -> MemberHeader:
        return self._file(key).header(key)

    def data_chunks(self, key: str, header: MemberHeader) -> Iterator[bytes]:
        return self._file(key).data_chunks(header)

    def location(self, key: str) -> MemberLocation:
        location = self._file(key).location()
        return location._replace(flags=location.flags | IN_SAMPLE_DIR)

    def located_bytes(self, key: str, location: MemberLocation) -> Iterator[bytes]:
        if key not in self.files:
            raise SourceError(f"{self.path}[{key}]: key vanished since the file was scanned")
        return self._file(key).located_bytes(key, location)

    def _file(self, key: str) -> _NpyFile:
        if key not in self.opened:
            path = self.files[key]
            mode = _mode_now(path)
            if mode:  # never open a pipe, device or socket, as open_source never does
                _check_regular(path, mode)
            self.opened[key] = self.stack.enter_context(_NpyFile(path, self.limit))
        return self.opened[key]


def sample_dir_files(path: str) -> dict[str, str]:
    """Field name -> path of each ``*.npy`` entry directly in ``path``, hidden ones left out;
    SourceError if none."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        raise SourceError(f"{path}: cannot list directory ({exc.strerror})") from None
    files: dict[str, str] = {}
    for entry in entries:
        if is_field_name(entry.name) and not _is_dir(entry):
            key = entry.name[: -len(NPY_SUFFIX)]
            if key in files:
                first = os.path.basename(files[key])
                raise SourceError(f"{path}: field {key!r} appears twice ({first} and {entry.name})")
            files[key] = entry.path
    if not files:
        raise SourceError(f"{path}: holds no .npy files; not a sample directory")
    return files


def holds_npy_files(entries: Sequence[os.DirEntry[str]]) -> bool:
    """Whether a directory with these entries is a sample directory."""
    return any(is_field_name(e.name) and not _is_dir(e) for e in entries)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False


def _check_regular(path: str, mode: int) -> None:
    try:
        fsutil.check_regular(mode)
    except fsutil.NotRegularFile as exc:
        raise SourceError(f"{path}: {exc}") from None


def _open_npy(path: str) -> BinaryIO:
    """Open without blocking; a pipe, device, directory or broken link in its place is refused."""
    try:
        return os.fdopen(fsutil.open_regular(path), "rb")
    except fsutil.NotRegularFile as exc:
        raise SourceError(f"{path}: {exc}") from None
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        raise _cannot_open(path, exc) from None


def _cannot_open(path: str, exc: OSError) -> SourceError:
    """Why a source could not be opened, the same for an NPZ and a .npy file: a broken link or a
    link loop named as such, anything else by the system's words."""
    if exc.errno in (errno.ENOENT, errno.ELOOP) and os.path.lexists(path):
        return SourceError(f"{path}: {fsutil.describe_kind(path)}, not a regular file")
    return SourceError(f"{path}: {exc.strerror or exc}")
