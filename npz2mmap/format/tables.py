"""The per-sample tables of a ragged field, checked whole: offsets, shapes and the recorded shape.

What readers check per access, ``verify`` here checks over a whole table at
once (docs/FORMAT.md, "Fields and regions"), vectorised without ever wrapping.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .index import Field, SampleShape, representable_nbytes


def representable_row_nbytes(shapes: NDArray[np.int64], itemsize: int) -> NDArray[np.int64]:
    """representable_nbytes of every row of a shapes table, -1 for a row numpy cannot make.

    Vectorised without ever wrapping: a float estimate (zero dimensions taken
    as 1, as numpy does) picks the rows whose exact product surely fits in
    int64; the others, rare and only in a damaged table, are computed exactly
    in Python ints.
    """
    shapes = np.asarray(shapes, dtype=np.int64)
    negative = (shapes < 0).any(axis=1)
    estimate = np.prod(np.maximum(shapes, 1).astype(np.float64), axis=1) * itemsize
    surely_fits = ~negative & (estimate < 2.0**62)  # float error is far below a factor of 2
    nbytes = np.full(len(shapes), -1, dtype=np.int64)
    nbytes[surely_fits] = np.prod(shapes[surely_fits], axis=1) * itemsize
    for i in np.flatnonzero(~surely_fits & ~negative):
        exact = representable_nbytes([int(d) for d in shapes[i]], itemsize)
        nbytes[i] = -1 if exact is None else exact
    return nbytes


def sample_shape_of_table(shapes: NDArray[np.int64]) -> SampleShape:
    """The sample shape a shapes table (num_samples, ndim) gives: each dimension's length where
    every row has the same, None where rows differ (everywhere when there is no row)."""
    if not len(shapes):
        return (None,) * shapes.shape[1]
    same = (shapes == shapes[0]).all(axis=0)
    first = shapes[0].tolist()
    return tuple(int(d) if agree else None for d, agree in zip(first, same.tolist(), strict=True))


def ragged_table_problem(f: Field, offsets: NDArray[np.int64], shapes: NDArray[np.int64]) -> str | None:
    """How a ragged field's offsets and shapes tables break the format's rules, or None.

    ``offsets`` run from 0 to the data size without decreasing, and every
    sample's shape is one numpy can make whose byte size is its offsets'
    difference. The checks readers make per access, over the whole table.
    """
    if offsets[0] != 0 or offsets[-1] != f.data.nbytes:
        return f"offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to {f.data.nbytes}"
    decreasing = offsets[1:] < offsets[:-1]  # compared, not subtracted: a difference could wrap
    if decreasing.any():
        return f"offsets decrease at sample {int(np.argmax(decreasing))}"
    sizes = np.diff(offsets)  # all offsets lie in 0..data.nbytes now
    nbytes = representable_row_nbytes(shapes, f.dtype.itemsize)
    mismatched = np.flatnonzero(nbytes != sizes)
    if not len(mismatched):
        return _sample_shape_problem(f, shapes)
    i = int(mismatched[0])
    shape = tuple(int(d) for d in shapes[i])
    if nbytes[i] < 0:
        return f"sample {i} has shape {shape}, which no numpy array of {f.dtype.itemsize}-byte items can have"
    return (
        f"shape x itemsize differs from the byte count at sample {i} "
        f"(shape {shape} of {f.dtype.itemsize}-byte items, {int(sizes[i])} bytes)"
    )


def _sample_shape_problem(f: Field, shapes: NDArray[np.int64]) -> str | None:
    """How a ragged field's recorded shape disagrees with its shapes table, or None."""
    if f.ragged_shape is None:  # a version 2 index records none
        return None
    found = sample_shape_of_table(shapes)
    if found == f.ragged_shape:
        return None
    axis = next(d for d, (a, b) in enumerate(zip(found, f.ragged_shape, strict=True)) if a != b)
    recorded = f.ragged_shape[axis]
    if recorded is None:
        return f"shape records that samples differ in dimension {axis}, but every one has {found[axis]}"
    row = int(np.flatnonzero(shapes[:, axis] != recorded)[0])
    return (
        f"shape records {recorded} in dimension {axis} for every sample, but sample {row} has "
        f"{int(shapes[row, axis])}"
    )


def shape_fits(ragged_shape: SampleShape | None, shape: Sequence[int]) -> bool:
    """Whether a sample's ``shape`` has the lengths its field's shape records (any, unrecorded)."""
    if ragged_shape is None:
        return True
    return all(want is None or want == dim for want, dim in zip(ragged_shape, shape, strict=True))
