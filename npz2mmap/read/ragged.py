"""A batch's samples of one ragged field: located in the mapping and checked, then copied or padded.

No torch here. Readers locate the samples (``DatasetReader.ragged_rows``);
nothing is read until ``copies``, ``padded`` or ``fill_padded`` copies each
sample's bytes once, straight from the mapping into the result.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..format.index import SampleShape, representable_nbytes

# Mean elements per sample from which one memcpy per sample beats building
# an element index for the whole batch (measured: a memcpy through memoryviews
# costs about as much as indexing 30 elements).
LOOP_MIN_ELEMENTS = 32

# The ragged fields of a batch, by name, each with its shape in every sample (None in each
# dimension in which samples differ), or None where only its name is known (named by a user).
RaggedShapes = Mapping[str, "SampleShape | None"]

# The keys a padded batch adds beside each ragged field (PaddedCollate and the
# workers' slots both name them through these functions, and only them).
LENGTHS_SUFFIX = "_lengths"
SHAPES_SUFFIX = "_shapes"
MASK_SUFFIX = "_mask"


def lengths_key(name: str) -> str:
    """The key of ragged field ``name``'s lengths in a padded batch."""
    return name + LENGTHS_SUFFIX


def shapes_key(name: str) -> str:
    """The key of ragged field ``name``'s shapes in a padded batch."""
    return name + SHAPES_SUFFIX


def mask_key(name: str) -> str:
    """The key of ragged field ``name``'s mask in a padded batch."""
    return name + MASK_SUFFIX


def lengths_axis(shape: SampleShape) -> int | None:
    """The dimension a ragged field's lengths measure: the one in which its samples differ;
    None when they may differ in several (no one length describes a sample)."""
    varying = [axis for axis, length in enumerate(shape) if length is None]
    return varying[0] if len(varying) == 1 else None


def check_padded_keys(field_names: Iterable[str], ragged: RaggedShapes, mask: bool) -> None:
    """Raise ValueError if a padded batch would put two things under one key.

    A ragged field's lengths, shapes (and mask) key may be another field's
    name, or another generated key: one would silently replace the other in
    the batch. A field known by name only is checked for the keys it surely takes.
    """
    held: dict[str, str] = {}
    for name in field_names:
        for key, what in _padded_keys(name, name in ragged, ragged.get(name), mask):
            if key in held:
                raise ValueError(
                    f"PaddedCollate: key {key!r} would hold both {held[key]} and {what}; "
                    "select the fields to keep with MmapDataset(path, fields=[...]) or rename one of them"
                )
            held[key] = what


def _padded_keys(
    name: str, is_ragged: bool, shape: SampleShape | None, mask: bool
) -> Iterator[tuple[str, str]]:
    """The keys field ``name`` takes in a padded batch, each with what it holds (for messages);
    of a ragged field whose ``shape`` is not known, those it takes whatever its shape."""
    yield name, f"field {name!r}"
    if not is_ragged:
        return
    if shape is not None and lengths_axis(shape) is not None:
        yield lengths_key(name), f"the lengths of ragged field {name!r}"
    if shape is not None and len(shape) > 1:
        yield shapes_key(name), f"the shapes of ragged field {name!r}"
    if mask:
        yield mask_key(name), f"the mask of ragged field {name!r}"


def padded_extras(name: str, shapes: NDArray[np.int64], shape: SampleShape | None) -> dict[str, np.ndarray]:
    """The arrays a padded batch holds beside ragged field ``name`` of these sample ``shapes`` (n, ndim),
    but its mask: ``name_lengths`` (int64 (n,), along the one dimension in which samples differ)
    and, for samples of two or more dimensions, ``name_shapes`` (int64 (n, ndim)).
    ``shape`` is the field's in every sample; None, known by name only, counts every dimension as varying."""
    shape = (None,) * shapes.shape[1] if shape is None else shape
    out = {}
    axis = lengths_axis(shape)
    if axis is not None:
        out[lengths_key(name)] = np.ascontiguousarray(shapes[:, axis], dtype=np.int64)
    if shapes.shape[1] > 1:
        out[shapes_key(name)] = np.ascontiguousarray(shapes, dtype=np.int64)
    return out


class RaggedRows:
    """Where each sample of a batch lies: its source, byte offset and shape, all checked.

    ``sources`` are byte arrays (one per part, each a field's data region);
    row ``j`` is ``shapes[j]`` elements of ``dtype`` at byte ``starts[j]`` of
    ``sources[part[j]]``; ``sample_shape`` is the field's shape in every sample
    (None where samples differ). Holds views of a mapping, so it is not
    picklable: pickle its ``copies()`` instead.
    """

    def __init__(
        self,
        name: str,
        dtype: np.dtype,
        sources: Sequence[NDArray[np.uint8]],
        part: NDArray[np.intp],
        starts: NDArray[np.int64],
        shapes: NDArray[np.int64],
        sample_shape: SampleShape | None = None,
    ) -> None:
        self.name = name
        self.sample_shape = sample_shape
        self.dtype = dtype
        self.sources = list(sources)
        self.part = part
        self.starts = starts
        self.shapes = shapes
        self._padded_shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getstate__(self) -> Any:
        raise TypeError("RaggedRows holds views of a mapping; pickle its copies() instead")

    def extras(self) -> dict[str, np.ndarray]:
        """The lengths (and shapes) a padded batch holds beside this field (see padded_extras)."""
        return padded_extras(self.name, self.shapes, self.sample_shape)

    def padded_shape(self) -> tuple[int, ...]:
        """(n, *largest shape of the batch)."""
        if self._padded_shape is None:
            if not len(self):
                self._padded_shape = (0,) * (1 + self.shapes.shape[1])
            elif self.shapes.shape[1] == 1:
                self._padded_shape = (len(self), int(self.shapes[:, 0].max()))
            else:
                self._padded_shape = (len(self), *(int(d) for d in self.shapes.max(axis=0)))
        return self._padded_shape

    def copies(self) -> list[np.ndarray]:
        """Each sample as a fresh, writable array with every byte of it (record padding included)."""
        nbytes = self.row_nbytes()
        return [
            np.array(self.sources[p][s : s + n]).view(self.dtype).reshape(shape)
            for p, s, n, shape in zip(
                self.part.tolist(), self.starts.tolist(), nbytes.tolist(), self.shapes.tolist(), strict=True
            )
        ]

    def fill_padded(self, out: np.ndarray, pad_value: float = 0) -> np.ndarray:
        """Write the padded batch into ``out`` (e.g. a preallocated shared buffer) and return it.

        ``out`` must be a writable C-contiguous numpy array of ``padded_shape()``
        and the field's dtype (TypeError for another type, ValueError otherwise). Every sample's bytes are
        copied once from the mapping; padding elements are ``pad_value`` (cast
        as ``np.full`` casts it), with zero bytes between a record's fields.
        """
        problem = self._out_problem(out)
        if problem is not None:
            raise (TypeError if not isinstance(out, np.ndarray) else ValueError)(
                f"field {self.name!r}: out must be a writable C-contiguous numpy array of shape "
                f"{self.padded_shape()} and dtype {self.dtype}; {problem}"
            )
        target = out.view(raw_unit(self.dtype))
        target[...] = pad_element(self.dtype, pad_value, self.name)
        self._copy_into(target)
        return out

    def _out_problem(self, out: object) -> str | None:
        """What keeps ``out`` from taking the padded batch (fill_padded's message), or None."""
        if not isinstance(out, np.ndarray):
            hint = " (a tensor's .numpy() views its memory)" if hasattr(out, "numpy") else ""
            return f"got a {type(out).__name__}{hint}"
        if out.shape != self.padded_shape() or out.dtype != self.dtype:
            return f"got shape {out.shape} and dtype {out.dtype}"
        if not out.flags.writeable:
            return "it is read-only"
        if not out.flags.c_contiguous:
            return "it is not C-contiguous"
        return None

    def _copy_into(self, target: np.ndarray) -> None:
        """Every sample into its row of ``target`` (padded_shape(), in raw_unit), padding untouched."""
        if len(self) and self.shapes.shape[1] == 1:
            self._copy_flat_rows(target)
        else:
            self._copy_rows(target)

    def row_nbytes(self) -> NDArray[np.int64]:
        """Every sample's size in bytes."""
        # Readers checked every row's extent, so these products do not overflow.
        return np.prod(self.shapes, axis=1, dtype=np.int64) * self.dtype.itemsize

    def fill_packed(self, out: NDArray[np.uint8], offsets: NDArray[np.int64]) -> None:
        """Copy sample ``j``'s bytes to ``out[offsets[j]:]`` (e.g. a shared slot), one memcpy per sample.

        ``out`` must be a writable 1-d C-contiguous uint8 array that holds every
        sample at its offset (ValueError otherwise).
        """
        nbytes = self.row_nbytes()
        flags = out.flags
        if out.dtype != np.uint8 or out.ndim != 1 or not flags.c_contiguous or not flags.writeable:
            raise ValueError(f"field {self.name!r}: out must be a writable C-contiguous 1-d uint8 array")
        inside = len(offsets) == len(self) and bool(((offsets >= 0) & (offsets + nbytes <= len(out))).all())
        if not inside:
            raise ValueError(f"field {self.name!r}: the {len(self)} samples do not lie inside out at offsets")
        _copy_by_slices(out.data, offsets.tolist(), self.sources, self.part, self.starts, nbytes)

    def mask(self) -> NDArray[np.bool_]:
        """True where the padded batch holds real elements."""
        return valid_mask_of(self.shapes, self.padded_shape()[1:])

    def _copy_flat_rows(self, target: np.ndarray) -> None:
        """1-d samples into (n, width) ``target``: a memcpy per sample, or an element index for short ones."""
        itemsize = self.dtype.itemsize
        counts = self.shapes[:, 0]
        if int(counts.sum()) >= LOOP_MIN_ELEMENTS * len(self):
            row_nbytes = target.shape[1] * itemsize
            if row_nbytes:  # else every sample is empty
                firsts = range(0, len(target) * row_nbytes, row_nbytes)
                out = target.view(np.uint8).reshape(-1).data
                _copy_by_slices(out, firsts, self.sources, self.part, self.starts, counts * itemsize)
        elif (self.starts % itemsize == 0).all() and all(len(s) % itemsize == 0 for s in self.sources):
            sources = [s.view(target.dtype) for s in self.sources]
            _copy_by_element_index(target, sources, self.part, self.starts // itemsize, counts)
        else:  # only a damaged offsets table puts a sample between elements
            as_bytes = target.view(np.uint8)
            _copy_by_element_index(as_bytes, self.sources, self.part, self.starts, counts * itemsize)

    def _copy_rows(self, target: np.ndarray) -> None:
        """Samples of any ndim, one slice copy per sample (no faster way for n-d is worth its code)."""
        unit = target.dtype
        for row, p, s, n, shape in zip(
            target,
            self.part.tolist(),
            self.starts.tolist(),
            self.row_nbytes().tolist(),
            self.shapes.tolist(),
            strict=True,
        ):
            row[tuple(slice(0, d) for d in shape)] = self.sources[p][s : s + n].view(unit).reshape(shape)


def _copy_by_slices(
    out: memoryview,
    firsts: Sequence[int],
    sources: list[NDArray[np.uint8]],
    part: NDArray[np.intp],
    starts: NDArray[np.int64],
    nbytes: NDArray[np.int64],
) -> None:
    """Row ``j`` to ``out[firsts[j]:]``, one memcpy per row through memoryviews (a numpy slice
    assignment costs twice as much per call)."""
    views = [source.data for source in sources]
    if len(views) == 1:
        source = views[0]
        for first, s, n in zip(firsts, starts.tolist(), nbytes.tolist(), strict=True):
            out[first : first + n] = source[s : s + n]
        return
    for first, p, s, n in zip(firsts, part.tolist(), starts.tolist(), nbytes.tolist(), strict=True):
        out[first : first + n] = views[p][s : s + n]


def _copy_by_element_index(
    target: np.ndarray,
    sources: list[np.ndarray],
    part: NDArray[np.intp],
    starts: NDArray[np.int64],
    counts: NDArray[np.int64],
) -> None:
    """One element index per source for the whole batch: a fixed number of numpy calls, however many rows."""
    flat = target.reshape(-1)
    width = target.shape[1]
    for p, source in enumerate(sources):
        rows = np.flatnonzero(part == p) if len(sources) > 1 else np.arange(len(target))
        row_counts = counts[rows]
        total = int(row_counts.sum())
        if total == 0:
            continue
        within = np.arange(total, dtype=np.int64)
        within -= np.repeat(np.cumsum(row_counts) - row_counts, row_counts)  # position inside its row
        gathered = source[np.repeat(starts[rows], row_counts) + within]
        flat[np.repeat(rows * width, row_counts) + within] = gathered


def raw_unit(dtype: np.dtype) -> np.dtype:
    """A dtype of the same itemsize that numpy copies as plain bytes (records included)."""
    if dtype.itemsize in (1, 2, 4, 8):
        return np.dtype(f"u{dtype.itemsize}")
    return np.dtype((np.void, dtype.itemsize))


def pad_element(dtype: np.dtype, pad_value: float, name: str = "data") -> Any:
    """``pad_value`` as one element of ``dtype``, in raw_unit.

    The default 0 pads what is not a number with its empty value: zero bytes
    ('' for strings, b'' for bytes, a record of zero bytes), NaT for datetimes
    and timedeltas. Any other value must be one of ``dtype`` exactly, as cast
    by numpy (a float field takes its nearest float): ValueError naming the
    field ``name`` otherwise (-1 or 0.5 for uint8, 0.5 for bool, 5 for a string).
    """
    element = np.zeros(1, dtype=dtype)
    if _is_default_zero(pad_value) and dtype.kind not in "biufc":
        if dtype.kind in "Mm":
            element[0] = dtype.type("NaT")
        return element.view(raw_unit(dtype))[0]
    try:
        with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # ComplexWarning and the like: a value that does not fit is refused below
            np.copyto(element, pad_value, casting="unsafe")
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"field {name!r}: pad_value {pad_value!r} is not a {dtype} ({exc})") from None
    if not _pads_as_given(element[0], pad_value, dtype):
        raise ValueError(
            f"field {name!r}: pad_value {pad_value!r} is not a {dtype}: it would pad with {element[0]!r}"
        )
    return element.view(raw_unit(dtype))[0]


def _is_default_zero(value: Any) -> bool:
    return type(value) is int and value == 0


def _pads_as_given(stored: Any, value: Any, dtype: np.dtype) -> bool:
    """Whether the element cast from ``value`` is that value (floats: up to rounding, NaN as NaN)."""
    if dtype.kind in "fc":
        given = complex(value) if isinstance(value, (int, float, complex, np.number)) else None
        if given is None:
            return False
        if dtype.kind == "f" and given.imag != 0:
            return False  # a float field cannot hold an imaginary part
        parts = [(complex(stored).real, given.real), (complex(stored).imag, given.imag)]
        return all(math.isnan(a) == math.isnan(b) and math.isinf(a) == math.isinf(b) for a, b in parts)
    try:
        return bool(stored == value)
    except (TypeError, ValueError):
        return False


def check_padded_size(name: str, shape: tuple[int, ...], itemsize: int) -> None:
    """Raise ValueError if numpy cannot make an array of ``shape`` (samples (2**60, 0) and (0, 2**60)
    pad to 2**120 elements)."""
    if representable_nbytes(shape, itemsize) is None:
        raise ValueError(f"field {name!r}: a batch padded to {shape} is too large for numpy")


def valid_mask_of(shapes: NDArray[np.int64], padded_shape: Sequence[int]) -> NDArray[np.bool_]:
    """(n, *padded_shape) bools, True where a sample of ``shapes`` holds an element: one compare per axis."""
    n, ndim = len(shapes), len(padded_shape)
    mask = np.ones((n,) + (1,) * ndim, dtype=bool)
    for axis, width in enumerate(padded_shape):
        inside = np.arange(width) < shapes[:, axis, None]
        mask = mask & inside.reshape((n,) + (1,) * axis + (width,) + (1,) * (ndim - axis - 1))
    return mask
