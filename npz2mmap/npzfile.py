"""Reading untrusted NPZ files: member headers, then member data in bounded chunks.

Nothing here unpickles or allocates what a header merely claims: a header is
parsed with ``ast.literal_eval``, object dtypes are refused, and the size a
header declares must match the size the zip entry actually holds.
"""

from __future__ import annotations

import ast
import contextlib
import os
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from .errors import SourceError
from .spec import NPY_MAGIC

NPY_SUFFIX = ".npy"
# numpy's own limit on header size; larger headers come only from hostile files.
MAX_NPY_HEADER_NBYTES = 10_000
CHUNK_NBYTES = 4 << 20
PREFETCH_MAX_NBYTES = 4 << 20
HEADER_KEYS = {"descr", "fortran_order", "shape"}

# What a damaged or hostile zip can raise from the standard library.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
    ValueError,
)


@dataclass(frozen=True)
class MemberHeader:
    """What the ``.npy`` header of one NPZ member declares."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    header_nbytes: int

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


def member_key(name: str) -> str:
    """The key numpy gives a member: its name without a ``.npy`` suffix."""
    return name[: -len(NPY_SUFFIX)] if name.endswith(NPY_SUFFIX) else name


@contextlib.contextmanager
def source_errors(where: str) -> Iterator[None]:
    """Turn what zipfile and friends raise into a SourceError naming ``where``."""
    try:
        yield
    except _ZIP_ERRORS as exc:
        raise SourceError(f"{where}: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, zipfile.BadZipFile):
        return f"not a valid zip/npz file ({exc})"
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def open_npz(path: str) -> Iterator[zipfile.ZipFile]:
    """Open an NPZ file; errors while opening are the source's, errors in the body are not."""
    with source_errors(path):
        fp = open(path, "rb")
        try:
            _prefetch_small_file(fp)
            zf = zipfile.ZipFile(fp)
        except BaseException:
            fp.close()
            raise
    with fp, zf:
        yield zf


def _prefetch_small_file(fp: IO[bytes]) -> None:
    """Ask for a small file in one read before zipfile hops between its end and its start.

    On a cold cache those hops cost a disk read each; the whole file is read
    by the copy pass anyway. Larger files are left to the kernel's readahead.
    """
    size = os.fstat(fp.fileno()).st_size
    if size <= PREFETCH_MAX_NBYTES and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fp.fileno(), 0, size, os.POSIX_FADV_WILLNEED)


def members(zf: zipfile.ZipFile, path: str) -> dict[str, zipfile.ZipInfo]:
    """Map key -> zip entry, refusing duplicate keys."""
    found: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if info.is_dir():
            continue
        key = member_key(info.filename)
        if key in found:
            raise SourceError(f"{path}: key {key!r} appears twice in the archive")
        found[key] = info
    return found


def read_headers(path: str, keys: Sequence[str] | None = None) -> dict[str, MemberHeader]:
    """Read the headers of ``keys`` (all members if None) without reading any array data."""
    headers: dict[str, MemberHeader] = {}
    with open_npz(path) as zf:
        entries = members(zf, path)
        wanted = sorted(entries) if keys is None else list(keys)
        for key in wanted:
            if key not in entries:
                raise SourceError(f"{path}: no key {key!r} (has: {', '.join(sorted(entries)) or 'none'})")
            headers[key] = read_member_header(zf, entries[key], path)
    return headers


def read_member_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> MemberHeader:
    where = f"{path}[{member_key(info.filename)}]"
    with source_errors(where), zf.open(info) as stream:
        header = parse_npy_header(stream, member_key(info.filename), where)
    declared = header.header_nbytes + header.nbytes
    if declared != info.file_size:
        raise SourceError(
            f"{where}: header declares {header.nbytes} data bytes but the member holds "
            f"{info.file_size - header.header_nbytes}"
        )
    return header


def parse_npy_header(stream: IO[bytes], key: str, where: str) -> MemberHeader:
    """Parse a .npy header (versions 1.0, 2.0, 3.0) from the start of ``stream``."""
    magic = read_exactly(stream, len(NPY_MAGIC) + 2, where)
    if magic[: len(NPY_MAGIC)] != NPY_MAGIC:
        raise SourceError(f"{where}: not a .npy array (bad magic bytes)")
    version = (magic[-2], magic[-1])
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise SourceError(f"{where}: .npy format version {version[0]}.{version[1]} is not supported")
    length_nbytes = 2 if version == (1, 0) else 4
    text_nbytes = int.from_bytes(read_exactly(stream, length_nbytes, where), "little")
    if text_nbytes > MAX_NPY_HEADER_NBYTES:
        raise SourceError(
            f"{where}: .npy header of {text_nbytes} bytes is larger than {MAX_NPY_HEADER_NBYTES}"
        )
    raw = read_exactly(stream, text_nbytes, where)
    encoding = "utf-8" if version == (3, 0) else "latin1"
    try:
        text = raw.decode(encoding)
        header = ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise SourceError(f"{where}: .npy header is not a valid Python literal") from None
    dtype, shape, fortran = _check_header_dict(header, where)
    return MemberHeader(key, dtype, shape, fortran, len(magic) + length_nbytes + text_nbytes)


def _check_header_dict(header: object, where: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        raise SourceError(f"{where}: .npy header must be a dict with keys {sorted(HEADER_KEYS)}")
    shape, fortran = header["shape"], header["fortran_order"]
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise SourceError(f"{where}: .npy header shape {shape!r} is not a tuple of non-negative ints")
    if not isinstance(fortran, bool):
        raise SourceError(f"{where}: .npy header fortran_order {fortran!r} is not a bool")
    try:
        dtype = np.lib.format.descr_to_dtype(header["descr"])
    except (TypeError, ValueError, KeyError, IndexError, SyntaxError):
        raise SourceError(f"{where}: .npy header descr {header['descr']!r} is not a valid dtype") from None
    if dtype.hasobject:
        raise SourceError(
            f"{where}: dtype {dtype} holds pickled Python objects, which npz2mmap never loads; "
            "convert them to a numeric or fixed-width string array first"
        )
    if dtype.itemsize == 0:
        raise SourceError(f"{where}: dtype {dtype} has no size")
    return dtype, shape, fortran


def read_exactly(stream: IO[bytes], nbytes: int, where: str) -> bytes:
    data = stream.read(nbytes)
    if len(data) != nbytes:
        raise SourceError(f"{where}: member ends early ({len(data)} of {nbytes} bytes)")
    return data


def iter_data_chunks(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, header: MemberHeader, where: str
) -> Iterator[bytes]:
    """Yield the member's array bytes in file order, in chunks of at most CHUNK_NBYTES.

    Chunks may end inside an element: memory stays bounded whatever the
    itemsize. Reads the entry to its end, so zipfile checks its CRC; raises
    SourceError if the data is short, long or corrupt.
    """
    chunk_nbytes = CHUNK_NBYTES
    with source_errors(where), zf.open(info) as stream:
        read_exactly(stream, header.header_nbytes, where)
        remaining = header.nbytes
        while remaining:
            chunk = read_exactly(stream, min(chunk_nbytes, remaining), where)
            remaining -= len(chunk)
            yield chunk
        if stream.read(1):
            raise SourceError(f"{where}: member holds more bytes than its header declares")
