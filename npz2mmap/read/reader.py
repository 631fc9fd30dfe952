"""Reading: map a dataset's blob read-only and hand out zero-copy views of samples.

No torch here, so the CLI can use it. Opening costs the same for any number
of samples: the index is validated, the blob's size and header checked, and
the per-sample tables are views of the mapping, never parsed.
"""

from __future__ import annotations

import mmap
import os
import weakref
import zlib
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .. import fsutil
from ..errors import FormatError
from ..format.files import open_regular
from ..format.index import (
    BLOB_HEADER_NBYTES,
    BLOB_NAME,
    CRC_DTYPE,
    IDENTITY_NBYTES,
    OFFSET_DTYPE,
    SHAPE_DTYPE,
    Field,
    Index,
    Region,
    SampleShape,
    blob_header,
    blob_identity,
    load_index,
    representable_nbytes,
)
from ..format.manifest import MANIFEST_NAME, is_manifest_dir
from ..format.tables import ragged_table_problem, representable_row_nbytes, sample_shape_of_table, shape_fits
from ..text import quoted
from .features import Feature
from .indices import normalise_index, normalise_indices
from .ragged import RaggedRows

ADVICE = {
    name: getattr(mmap, f"MADV_{name.upper()}")
    for name in ("normal", "random", "sequential", "willneed")
    if hasattr(mmap, f"MADV_{name.upper()}")
}


class DatasetReader:
    """A read-only mapping of one dataset directory (one part of a dataset of parts).

    Raises FormatError when the index is invalid or the blob does not match it
    (``check_identity=False`` lets ``verify`` go on past an edited index).
    Pickles as its recipe (path and index), mapped again where it is loaded.
    """

    def __init__(
        self, path: str | os.PathLike[str], index: Index | None = None, check_identity: bool = True
    ) -> None:
        self.path = os.fspath(path)
        if index is None and is_manifest_dir(self.path):
            raise FormatError(
                f"{self.path}: a dataset of parts ({MANIFEST_NAME}); a DatasetReader reads one part: "
                f"open one of the parts it lists, or the whole as MmapDataset({self.path!r})"
            )
        self.index = index if index is not None else load_index(self.path)
        # The index read travels with the path: a copy loaded elsewhere maps the blob again and,
        # as this reader would, refuses a dataset replaced since.
        self._recipe = (self.path, self.index, check_identity)
        self.blob_path = os.path.join(self.path, BLOB_NAME)
        self._mmap, self._hint_fd = _map_blob(self.blob_path, self.index, check_identity)
        if self._hint_fd is not None:
            weakref.finalize(self, os.close, self._hint_fd)
        self.payload: NDArray[np.uint8] = np.frombuffer(
            self._mmap, dtype=np.uint8, count=self.index.payload_nbytes, offset=BLOB_HEADER_NBYTES
        )
        self._fields = {f.name: _FieldView(f, self.payload, len(self)) for f in self.index.fields}
        self._derived: dict[str, SampleShape] = {}  # sample shapes a version 2 index does not record

    def __len__(self) -> int:
        return self.index.num_samples

    def __reduce__(self) -> tuple[type[DatasetReader], tuple[str, Index | None, bool]]:
        return type(self), self._recipe  # the mapping does not pickle: a worker maps the blob again

    def __repr__(self) -> str:
        return f"DatasetReader({self.path!r}, samples={len(self)}, fields={list(self.field_names)})"

    @property
    def field_names(self) -> tuple[str, ...]:
        return self.index.field_names

    @property
    def features(self) -> dict[str, Feature]:
        """Each field's dtype and shape in every sample (None where samples differ), by name:
        the dataset's schema."""
        return {f.name: Feature(f.dtype, self.sample_shape(f.name), f.ndim) for f in self.index.fields}

    def sample_shape(self, name: str) -> SampleShape:
        """Field ``name``'s shape in every sample, None in each dimension in which samples differ.

        From the index; for a version 2 index, which does not record it for a
        ragged field, from the shapes table (checked whole first, as ``shapes``).
        """
        f = self.index.field(name)
        if f.sample_shape is not None:
            return f.sample_shape
        if name not in self._derived:  # once per reader, not per batch
            self._derived[name] = sample_shape_of_table(self.shapes(name))
        return self._derived[name]

    def sample_index(self, i: int) -> int:
        """Normalise ``i`` (see normalise_index)."""
        return normalise_index(i, self.index.num_samples)

    def view(self, name: str, i: int) -> np.ndarray:
        """Sample ``i`` of field ``name`` as a read-only view of the mapping (no copy)."""
        return self._field(name).sample(self.sample_index(i))

    def column(self, name: str) -> np.ndarray:
        """A fixed field as one read-only (num_samples, *shape) view; ValueError for a ragged one."""
        view = self._field(name)
        if view.column is None:
            raise ValueError(
                f"field {name!r} is ragged, so it has no column: read it sample by sample "
                f"(view({name!r}, i)) or as padded rows (ragged_rows({name!r}, indices))"
            )
        return view.column

    def table(self, name: str, table: str) -> np.ndarray:
        """A per-sample table of a field ('sample_crc32', 'offsets', 'shapes') as a view."""
        return self._field(name).tables[table]

    def table_problems(self, name: str) -> list[str]:
        """How a field's tables break the format: checksum mismatches, else inconsistent ragged tables.

        Reads every table (not the data): O(num_samples), which opening never is.
        Shared by verify, which reports them, and readers that need whole
        tables (merge, lengths), which refuse them.
        """
        f = self.index.field(name)
        problems = [
            f"the {table} table is corrupt (checksum mismatch)"
            for table, region in f.tables().items()
            if zlib.crc32(self.payload[region.offset : region.end].data) != region.crc32
        ]
        if not problems and f.ragged:
            problem = ragged_table_problem(f, self.table(name, "offsets"), self.table(name, "shapes"))
            problems += [problem] if problem else []
        return problems

    def shapes(self, name: str) -> NDArray[np.int64]:
        """Every sample's shape of a field, (num_samples, ndim), from the index or tables only.

        A ragged field's tables are checked whole first (table_problems), so
        every shape returned is one numpy can make; FormatError otherwise.
        """
        f = self.index.field(name)
        if f.shape is not None:
            return np.tile(np.array(f.shape, dtype=np.int64), (len(self), 1))
        self.check_tables(name)
        return np.asarray(self.table(name, "shapes"), dtype=np.int64)

    def check_tables(self, name: str) -> None:
        """Raise FormatError, naming the dataset and field, if table_problems finds any."""
        problems = self.table_problems(name)
        if problems:
            raise FormatError(f"{self.path}: field {name!r}: {problems[0]}; run npz2mmap verify")

    def _field(self, name: str) -> _FieldView:
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; the dataset has: {quoted(self._fields)}") from None

    def has_identity(self) -> bool:
        """Whether the blob names exactly the index read (an edited index does not)."""
        return bytes(self.payload[:IDENTITY_NBYTES]) == blob_identity(self.index.digest, self.index.version)

    def advise(self, advice: str) -> None:
        """Tell the kernel how the blob will be read: one of ADVICE ('random', 'sequential', ...)."""
        if advice not in ADVICE:
            raise ValueError(f"advice must be one of {', '.join(ADVICE)}, got {advice!r}")
        if self._mmap is not None and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(ADVICE[advice])

    def sample_indices(self, indices: Sequence[int] | NDArray[np.integer]) -> NDArray[np.int64]:
        """Normalise many indices at once; IndexError naming the first out of range."""
        return normalise_indices(indices, self.index.num_samples)

    def byte_ranges(
        self, name: str, indices: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Where samples ``indices`` (normalised) of a field lie in the blob file: offsets and
        sizes in bytes, from the tables (checked as ``locate`` checks them)."""
        view = self._field(name)
        starts, shapes = view.locate(indices)
        if view.column is not None:
            nbytes = np.full(len(indices), self.index.field(name).stride, dtype=np.int64)
        else:
            nbytes = view.offsets[indices + 1].astype(np.int64, copy=False) - starts
        return starts + (BLOB_HEADER_NBYTES + view.field.data.offset), nbytes

    def will_need(self, names: Sequence[str], indices: NDArray[np.int64]) -> int:
        """Ask the kernel to read exactly these samples' bytes of fields ``names`` into the page
        cache now, in the background, all at once (so the disk has many reads in flight); the
        number of requests made. Nothing where the platform has no madvise (then each sample is
        read as it is copied)."""
        fd = self._hint_fd
        if not len(indices) or (
            fd is None and (not hasattr(self._mmap, "madvise") or "willneed" not in ADVICE)
        ):
            return 0
        pieces = [self.byte_ranges(name, indices) for name in names]
        starts = np.concatenate([p[0] for p in pieces])
        ends = starts + np.concatenate([p[1] for p in pieces])
        requests = 0
        for start, end in page_runs(starts, ends):
            for piece in range(start, end, WILL_NEED_CHUNK):  # Linux reads no more of one request
                length = min(WILL_NEED_CHUNK, end - piece)
                if fd is not None:  # releases the GIL, where madvise holds it while the disk is busy
                    os.posix_fadvise(fd, piece, length, os.POSIX_FADV_WILLNEED)
                else:
                    self._mmap.madvise(ADVICE["willneed"], piece, length)
                requests += 1
        return requests

    def gather(
        self, name: str, indices: Sequence[int] | NDArray[np.integer], out: np.ndarray | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Copy many samples of a field in one pass: one (len(indices), *shape) array.

        For a fixed field, one gather straight from the mapping into ``out`` (or
        a new array): the only copy between page cache and batch. A ragged field
        gives a list of per-sample copies.
        """
        idx = self.sample_indices(indices)
        view = self._field(name)
        if view.column is None:
            return self.ragged_rows(name, idx).copies()
        if out is None:
            out = np.empty((len(idx), *view.column.shape[1:]), dtype=view.column.dtype)
        column, target = as_raw(view.column), as_raw(out)
        if len(idx) > 1 and idx[-1] - idx[0] == len(idx) - 1 and (np.diff(idx) == 1).all():
            target[...] = column[idx[0] : idx[-1] + 1]  # a contiguous run: one memcpy
        else:
            # Indices are checked above; mode="raise" would buffer the whole batch once more.
            np.take(column, idx, axis=0, out=target, mode="clip")
        return out

    def ragged_rows(self, name: str, indices: Sequence[int] | NDArray[np.integer]) -> RaggedRows:
        """Where many samples of a field lie, their tables checked (FormatError as ``view`` raises it).

        Reads no sample data: the result copies or pads them (see RaggedRows).
        """
        idx = self.sample_indices(indices)
        starts, shapes = self.locate(name, idx)
        f = self.index.field(name)
        part = np.zeros(len(idx), dtype=np.intp)
        return RaggedRows(name, f.dtype, [self.data(name)], part, starts, shapes, self.sample_shape(name))

    def locate(self, name: str, indices: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Byte offsets in ``data(name)`` and shapes of samples ``indices`` (normalised), checked."""
        return self._field(name).locate(indices)

    def data(self, name: str) -> NDArray[np.uint8]:
        """A field's data region as read-only bytes of the mapping."""
        return self._field(name).data

    def view_consecutive(self, name: str, first: int, count: int) -> np.ndarray:
        """Samples ``first`` to ``first + count - 1`` as one read-only (count, *shape) view.

        Raises IndexError past the end, FormatError unless they share one shape
        and lie back to back (as the rows of one source file do).
        """
        if not 0 <= first <= first + count <= len(self):
            raise IndexError(f"samples {first}..{first + count - 1} are out of range for {len(self)} samples")
        return self._field(name).consecutive(first, count)


# The most one madvise(MADV_WILLNEED) asks for. Linux reads at most the larger of the
# device's read_ahead_kb and max_sectors_kb of one request and drops the rest (at 128 KB of
# read-ahead, 4 MB of a 12 MB request here): 128 KiB is the default read_ahead_kb, under
# both on any common device.
WILL_NEED_CHUNK = 128 * 1024


def page_runs(starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[int, int]]:
    """The byte ranges [start, end) widened to whole pages, sorted, those that touch joined."""
    keep = ends > starts
    if not keep.any():
        return []
    page = mmap.PAGESIZE
    first = (starts[keep] // page) * page
    last = -(-ends[keep] // page) * page
    order = np.argsort(first, kind="stable")
    first, last = first[order], np.maximum.accumulate(last[order])
    new_run = np.ones(len(first), dtype=bool)
    new_run[1:] = first[1:] > last[:-1]
    run_starts = first[new_run]
    run_ends = last[np.flatnonzero(new_run)[1:] - 1].tolist() + [int(last[-1])]
    return list(zip(run_starts.tolist(), run_ends, strict=True))


def as_raw(array: np.ndarray) -> np.ndarray:
    """A record or non-native-order array as raw bytes per element (a void dtype), which numpy
    copies whole.

    numpy copies records field by field and leaves their padding bytes
    undefined, and makes a stack or concatenation of big-endian arrays native
    (so a view of it back in the source's order would swap every value); other
    arrays are returned as they are.
    """
    if array.dtype.names is None and array.dtype.isnative:
        return array
    return array.view(np.dtype((np.void, array.dtype.itemsize)))


def copy_bytes(array: np.ndarray) -> np.ndarray:
    """A fresh, writable copy of ``array`` with every byte of it, record padding included."""
    raw = as_raw(array)
    return array.copy() if raw is array else np.array(raw).view(array.dtype)


class _FieldView:
    """Views of one field's data and tables over the payload."""

    def __init__(self, field: Field, payload: NDArray[np.uint8], num_samples: int) -> None:
        self.field = field
        self.data = _region(payload, field.data)
        self.tables: dict[str, np.ndarray] = {
            "sample_crc32": _region(payload, field.sample_crc32).view(CRC_DTYPE)
        }
        self.column: np.ndarray | None = None
        if field.shape is not None:
            self.column = self.data.view(field.dtype).reshape(num_samples, *field.shape)
        else:
            self.offsets = _region(payload, field.offsets).view(OFFSET_DTYPE)
            self.shapes = _region(payload, field.shapes).view(SHAPE_DTYPE).reshape(-1, field.ndim)
            self.tables.update(offsets=self.offsets, shapes=self.shapes)
            # The dimensions the index says every sample shares, checked with each access.
            recorded = field.ragged_shape or (None,) * field.ndim
            self.held_axes = [axis for axis, length in enumerate(recorded) if length is not None]
            self.held_lengths = np.array([recorded[axis] for axis in self.held_axes], dtype=np.int64)

    def sample(self, i: int) -> np.ndarray:
        if self.column is not None:
            return self.column[i, ...]
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        shape = tuple(int(d) for d in self.shapes[i])
        if not self._extent_is_valid(start, end, shape) or not shape_fits(self.field.ragged_shape, shape):
            raise self._corrupt(i)
        return self.data[start:end].view(self.field.dtype).reshape(shape)

    def locate(self, idx: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Byte offsets and shapes of samples ``idx``; FormatError, as ``sample`` raises it, for a bad one.

        The checks of ``_extent_is_valid``, vectorised: extents are compared
        before they are subtracted, and shapes whose product could wrap are
        refused by representable_row_nbytes.
        """
        if self.column is not None:
            stride = self.field.stride
            shapes = np.tile(np.array(self.column.shape[1:], dtype=np.int64), (len(idx), 1))
            return idx * stride, shapes
        starts = self.offsets[idx].astype(np.int64, copy=False)
        ends = self.offsets[idx + 1].astype(np.int64, copy=False)
        shapes = self.shapes[idx].astype(np.int64, copy=False).reshape(len(idx), self.field.ndim)
        if len(idx) and not (self._all_valid(starts, ends, shapes) and self._all_fit(shapes)):
            in_bounds = (starts >= 0) & (starts <= ends) & (ends <= len(self.data))
            # Where a difference wraps, the extent is out of bounds anyway.
            valid = in_bounds & (ends - starts == self._row_nbytes(shapes))
            valid &= (shapes[:, self.held_axes] == self.held_lengths).all(axis=1)
            raise self._corrupt(int(idx[np.argmin(valid)]))
        return starts, shapes

    def _all_fit(self, shapes: NDArray[np.int64]) -> bool:
        """Whether every shape has the lengths the index records for every sample."""
        return not self.held_axes or bool((shapes[:, self.held_axes] == self.held_lengths).all())

    def _all_valid(
        self, starts: NDArray[np.int64], ends: NDArray[np.int64], shapes: NDArray[np.int64]
    ) -> bool:
        """Whether every extent is valid (the checks of ``locate``), in few numpy calls.

        Read as unsigned, a negative number is larger than any size, so one
        maximum bounds each table on both sides; within bounds, no difference
        or product wraps.
        """
        size = len(self.data)
        if starts.view(np.uint64).max() > size or ends.view(np.uint64).max() > size:
            return False
        nbytes = ends - starts
        if shapes.shape[1] != 1:
            row_nbytes = self._row_nbytes(shapes)  # -1 for a shape numpy cannot make
            return bool(row_nbytes.min() >= 0 and (nbytes == row_nbytes).all())
        lengths = shapes[:, 0]
        itemsize = self.field.dtype.itemsize
        if lengths.view(np.uint64).max() > size // itemsize:
            return False
        return bool((nbytes == (lengths * itemsize if itemsize != 1 else lengths)).all())

    def _row_nbytes(self, shapes: NDArray[np.int64]) -> NDArray[np.int64]:
        """Bytes of each shape, -1 for one numpy cannot make (never a wrapped product)."""
        itemsize = self.field.dtype.itemsize
        if shapes.shape[1] != 1:
            return representable_row_nbytes(shapes, itemsize)
        lengths = shapes[:, 0]  # representable_row_nbytes for one axis, without its float estimate
        return np.where((lengths >= 0) & (lengths <= len(self.data) // itemsize), lengths * itemsize, -1)

    def _corrupt(self, i: int) -> FormatError:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        shape = tuple(int(d) for d in self.shapes[i])
        return FormatError(
            f"field {self.field.name!r} sample {i}: tables are corrupt "
            f"(bytes {start}..{end} of {len(self.data)}, shape {shape}); run npz2mmap verify"
        )

    def consecutive(self, first: int, count: int) -> np.ndarray:
        if self.column is not None:
            return self.column[first : first + count]
        shapes = self.shapes[first : first + count]
        offsets = self.offsets[first : first + count + 1]
        shape = tuple(int(d) for d in shapes[0]) if count else (0,) * self.field.ndim
        start, end = int(offsets[0]), int(offsets[-1])
        row_nbytes = representable_nbytes(shape, self.field.dtype.itemsize)
        if (
            row_nbytes is None
            or not self._extent_is_valid(start, end, (count, *shape))
            or (shapes != shapes[:1]).any()
            or (count and not shape_fits(self.field.ragged_shape, shape))
            or (np.diff(offsets) != row_nbytes).any()
        ):
            raise FormatError(
                f"field {self.field.name!r} samples {first}..{first + count - 1}: "
                "not one shape back to back, or tables are corrupt; run npz2mmap verify"
            )
        return self.data[start:end].view(self.field.dtype).reshape(count, *shape)

    def _extent_is_valid(self, start: int, end: int, shape: tuple[int, ...]) -> bool:
        """Bytes ``start..end`` of the data hold an array of ``shape`` that numpy can make.

        Tables are checked per access, in Python ints, so opening never scans them.
        """
        nbytes = representable_nbytes(shape, self.field.dtype.itemsize)
        return nbytes is not None and 0 <= start <= end <= len(self.data) and end - start == nbytes


def _region(payload: NDArray[np.uint8], region: Region | None) -> NDArray[np.uint8]:
    if region is None:
        raise FormatError("a ragged field lacks its tables")
    return payload[region.offset : region.end]


def check_blob(blob_path: str, index: Index) -> None:
    """Check a blob against its index without mapping it; FormatError if it does not match."""
    os.close(open_blob(blob_path, index))


def open_blob(blob_path: str, index: Index) -> int:
    """A descriptor of the blob, checked against its index; the caller closes it.

    Whatever is read through it is the file that was checked, even if the
    path is replaced meanwhile. Raises FormatError if it does not match.
    """
    fd = open_regular(blob_path)
    try:
        _check_blob(fd, blob_path, index)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_blob(blob_path: str, index: Index, check_identity: bool = True) -> tuple[mmap.mmap, int | None]:
    """Map the blob read-only after checking its type, size, identity and header: the mapping, and
    the descriptor checked, kept for posix_fadvise where there is one (None elsewhere), so the
    blob is opened and checked once and exact reads hint at the very file mapped.

    The size check comes first: mapping a truncated file and touching past its
    end would kill the process with SIGBUS. The identity names the exact index
    read, so a blob replaced since (or an edited index) is refused here.
    """
    fd = open_regular(blob_path)
    keep = hasattr(os, "posix_fadvise") and "willneed" in ADVICE
    try:
        _check_blob(fd, blob_path, index, check_identity)
        mapping = mmap.mmap(fd, index.blob_nbytes, access=mmap.ACCESS_READ)
    except BaseException:
        os.close(fd)
        raise
    if not keep:
        os.close(fd)
    return mapping, fd if keep else None


def _check_blob(fd: int, blob_path: str, index: Index, check_identity: bool = True) -> None:
    """FormatError unless the blob is the index's size, names the index and has its header.

    The size is known before the identity is read: a blob too short to hold
    an identity is truncated whatever the index, and one of the wrong size
    is another index's only if it holds another identity.
    """
    size = os.fstat(fd).st_size
    identity_nbytes = BLOB_HEADER_NBYTES + IDENTITY_NBYTES
    names_index = size >= identity_nbytes and (
        fsutil.read_at(fd, IDENTITY_NBYTES, BLOB_HEADER_NBYTES) == blob_identity(index.digest, index.version)
    )
    if size != index.blob_nbytes:
        belongs = names_index or size < identity_nbytes
        raise FormatError(size_problem(blob_path, size, index) if belongs else identity_problem(blob_path))
    if check_identity and not names_index:
        raise FormatError(identity_problem(blob_path))
    if fsutil.read_at(fd, BLOB_HEADER_NBYTES, 0) != blob_header(index.payload_nbytes):
        raise FormatError(f"{blob_path}: .npy header does not match the index")


def size_problem(blob_path: str, size: int, index: Index) -> str:
    """A blob ``size`` bytes long where its index expects another size: how much shorter or longer."""
    expected = (
        f"the index expects {index.blob_nbytes:,} ({BLOB_HEADER_NBYTES} + payload_nbytes "
        f"{index.payload_nbytes:,}); convert its sources again"
    )
    if size < index.blob_nbytes:
        return f"{blob_path}: truncated: {size:,} bytes, but {expected}"
    extra = size - index.blob_nbytes
    return f"{blob_path}: {extra:,} byte{'s' if extra > 1 else ''} too long: {size:,} bytes, but {expected}"


def identity_problem(blob_path: str) -> str:
    return (
        f"{blob_path}: does not belong to the index read (index.json was edited, or the "
        "dataset was replaced after it was opened); open it again, or run npz2mmap verify"
    )
