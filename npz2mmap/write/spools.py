"""The Writer's spools: append-only files a sample's arrays are written to as they come, in
their stored bytes, each append undone whole if it is cut short; and the source names, kept
as sources.jsonl lines in a spool of their own.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np

from .. import fsutil
from ..errors import SourceError
from ..format.provenance import MAX_LINE_NBYTES
from ..ingest.elements import Piece, stored_pieces
from ..ingest.npy_header import MemberHeader
from ..ingest.npz import CHUNK_NBYTES

SPOOL_BUFFER_NBYTES = 1 << 20


def array_header(key: str, value: np.ndarray) -> MemberHeader:
    """What the .npy header of ``value`` saved in C order would declare."""
    return MemberHeader(key, value.dtype, value.shape, False, 0, value.nbytes)


def c_order_bytes(value: np.ndarray) -> Iterator[Piece]:
    """The raw bytes of ``value`` in C order, padding as in memory, in pieces of about CHUNK_NBYTES.

    Viewed as opaque items of its itemsize, numpy copies records byte for
    byte (its structured copies leave padding undefined).
    """
    raw = value.view(np.dtype((np.void, value.dtype.itemsize)))
    if raw.flags.c_contiguous:
        flat = raw.reshape(-1).view(np.uint8)
        for start in range(0, len(flat), CHUNK_NBYTES):
            yield flat[start : start + CHUNK_NBYTES].data
        return
    row_nbytes = raw.itemsize * math.prod(raw.shape[1:])
    if raw.ndim > 1 and row_nbytes > CHUNK_NBYTES:
        for row in raw:
            yield from c_order_bytes(row)
        return
    rows_per_piece = max(1, CHUNK_NBYTES // max(1, row_nbytes))
    for start in range(0, len(raw), rows_per_piece):
        piece = np.ascontiguousarray(raw[start : start + rows_per_piece])
        yield piece.reshape(-1).view(np.uint8).data


class Marks(NamedTuple):
    """How far the tables and the spools a sample is written to went before it."""

    num_samples: int
    spools: tuple[Spool, ...]
    spool_nbytes: tuple[int, ...]


class Spool:
    """An append-only file written through a small buffer; the last append can be undone."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | fsutil.BINARY, 0o600)
        self.flushed = 0  # bytes in the file
        self.buffer = bytearray()

    @property
    def nbytes(self) -> int:
        return self.flushed + len(self.buffer)

    def write(self, piece: Piece) -> None:
        self.buffer += piece
        if len(self.buffer) >= SPOOL_BUFFER_NBYTES:
            self.flush()

    def write_stored(self, value: np.ndarray, stored: np.dtype, where: str) -> int:
        """Append ``value`` as stored with dtype ``stored``; return the CRC-32 of what was written."""
        crc = 0
        header = array_header("", value)
        for piece in stored_pieces(c_order_bytes(value), header, stored, where, cast_option="casts="):
            self.write(piece)
            crc = zlib.crc32(piece, crc)
        return crc

    def flush(self) -> None:
        nbytes = len(self.buffer)
        fsutil.write_all_at(self.fd, self.buffer, self.flushed)
        self.flushed += nbytes
        # A new buffer, not clear(): a failed write's traceback may still hold a view of the old one.
        self.buffer = bytearray()

    def truncate(self, nbytes: int) -> None:
        """Forget everything after the first ``nbytes``, in the buffer and in the file.

        The buffer is replaced, not resized, so a view of it that an error
        left alive cannot stop the undo; the file is cut to what was flushed,
        dropping the part of a failed write that reached it.
        """
        if nbytes >= self.flushed:
            self.buffer = self.buffer[: nbytes - self.flushed]
        else:
            self.buffer = bytearray()
            self.flushed = nbytes
        with fsutil.io_errors_ignored():  # bytes past ``flushed`` are never read; this only frees them
            os.ftruncate(self.fd, self.flushed)

    def close(self) -> None:
        """Close the file once: forgotten first, so an interrupt never leaves it to be closed twice."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class SourceNames(Sequence[str]):
    """Every sample's source name, kept as sources.jsonl lines in a spool: 8 bytes of memory each."""

    def __init__(self, path: str) -> None:
        self.spool = Spool(path)
        self.ends: array[int] = array("q")  # where each line ends in the spool

    def line(self, name: str, label: str) -> bytes:
        """The line ``name`` becomes; SourceError if readers would refuse it as too long."""
        line = (json.dumps(name) + "\n").encode("utf-8")
        if len(line) > MAX_LINE_NBYTES:
            raise SourceError(
                f"{label}: its source name takes {len(line):,} bytes in sources.jsonl, "
                f"more than the {MAX_LINE_NBYTES:,} a line may hold"
            )
        return line

    def record(self, end: int) -> None:
        self.ends.append(end)

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, k: int) -> str: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[str]: ...
    def __getitem__(self, k: int | slice) -> str | Sequence[str]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        end = self.ends[k]
        start = self.ends[k - 1] if k % len(self) else 0
        self.spool.flush()
        return str(json.loads(fsutil.read_at(self.spool.fd, end - start, start)))

    def __iter__(self) -> Iterator[str]:
        """In order, reading the spool once."""
        self.spool.flush()
        with open(self.spool.path, "rb") as fp:
            for _ in range(len(self)):
                yield str(json.loads(fp.readline(MAX_LINE_NBYTES)))
