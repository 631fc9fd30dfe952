"""Hypothesis strategies for dtypes and arrays the converter must carry exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def scalar_dtypes() -> st.SearchStrategy[np.dtype]:
    endianness = "?"  # either byte order
    return st.one_of(
        hnp.boolean_dtypes(),
        hnp.integer_dtypes(endianness=endianness),
        hnp.unsigned_integer_dtypes(endianness=endianness),
        hnp.floating_dtypes(endianness=endianness),
        hnp.complex_number_dtypes(endianness=endianness),
        hnp.datetime64_dtypes(endianness=endianness),
        hnp.timedelta64_dtypes(endianness=endianness),
        hnp.byte_string_dtypes(min_len=1, max_len=6),
        hnp.unicode_string_dtypes(endianness=endianness, min_len=1, max_len=6),
    )


def dtypes() -> st.SearchStrategy[np.dtype]:
    """Scalar dtypes and small structured dtypes built from them."""
    records = st.lists(scalar_dtypes(), min_size=1, max_size=3).map(
        lambda parts: np.dtype([(f"f{i}", d) for i, d in enumerate(parts)])
    )
    return st.one_of(scalar_dtypes(), records)


BYTE_ORDERS = (None, "<", ">", "=")


@st.composite
def nested_dtypes(draw: st.DrawFn, depth: int = 3) -> np.dtype:
    """numpy's dtype space for one element: scalars and records nesting records and subarrays.

    Record members may be scalars, records or subarrays of either (and
    subarrays of subarrays, which numpy keeps unflattened inside a record);
    records are packed, aligned or laid out with explicit offsets and a larger
    itemsize (padding), with titles or without names (numpy names them f0...);
    any part may be forced to a byte order.
    """
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(scalar_dtypes())
    members = []
    for _ in range(draw(st.integers(0, 3))):
        member = draw(nested_dtypes(depth - 1))
        for _ in range(draw(st.integers(0, 2))):
            member = np.dtype((member, draw(st.sampled_from([(2,), (1, 3), (3,)]))))
        members.append(member)
    names = [f"n{k}" for k in range(len(members))]
    layout = draw(st.sampled_from(["packed", "aligned", "offsets", "titles"]))
    if layout == "offsets" or not members:
        offsets, end = [], 0
        for member in members:
            offsets.append(end + draw(st.integers(0, 3)))
            end = offsets[-1] + member.itemsize
        itemsize = max(1, end + draw(st.integers(0, 3)))
        dtype = np.dtype({"names": names, "formats": members, "offsets": offsets, "itemsize": itemsize})
    elif layout == "titles":
        dtype = np.dtype({"names": names, "formats": members, "titles": [f"title {n}" for n in names]})
    else:
        dtype = np.dtype({"names": names, "formats": members}, align=layout == "aligned")
    order = draw(st.sampled_from(BYTE_ORDERS))
    return dtype if order is None else dtype.newbyteorder(order)


def array_shapes() -> st.SearchStrategy[tuple[int, ...]]:
    return hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@st.composite
def field_samples(draw: st.DrawFn, num_samples: int) -> list[np.ndarray]:
    """``num_samples`` arrays of one dtype and ndim; fixed or ragged, C or Fortran order."""
    dtype = draw(dtypes())
    ndim = draw(st.integers(0, 3))
    ragged = draw(st.booleans()) and ndim > 0
    fixed_shape = draw(hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=0, max_side=4)) if ndim else ()
    arrays = []
    for _ in range(num_samples):
        shape = (
            draw(hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=0, max_side=4))
            if ragged
            else fixed_shape
        )
        array = draw(hnp.arrays(dtype, shape))
        arrays.append(np.asfortranarray(array) if array.ndim > 1 and draw(st.booleans()) else array)
    return arrays


@st.composite
def padded_record_dtypes(draw: st.DrawFn, depth: int = 2) -> np.dtype:
    """Records with padding: aligned or explicit offsets with gaps, nested, with subarrays.

    Leaves come in either byte order; the whole record may be forced to one.
    """
    formats = []
    for _ in range(draw(st.integers(1, 3))):
        nested = depth > 0 and draw(st.integers(0, 3)) == 0
        base = draw(padded_record_dtypes(depth - 1)) if nested else draw(scalar_dtypes())
        shape = draw(st.sampled_from([(), (2,), (2, 3)]))
        formats.append(np.dtype((base, shape)) if shape else base)
    names = [f"f{k}" for k in range(len(formats))]
    if draw(st.booleans()):
        dtype = np.dtype({"names": names, "formats": formats}, align=True)
    else:
        offsets, end = [], 0
        for f in formats:
            offsets.append(end + draw(st.integers(0, 5)))
            end = offsets[-1] + f.itemsize
        itemsize = end + draw(st.integers(0, 5))
        dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})
    order = draw(st.sampled_from([None, "<", ">"]))
    return dtype if order is None else dtype.newbyteorder(order)


def numeric_dtypes() -> st.SearchStrategy[np.dtype]:
    """The dtypes `inspect --stats` covers: bool, integers of every width, floats up to longdouble."""
    return st.one_of(
        hnp.boolean_dtypes(),
        hnp.integer_dtypes(endianness="<"),
        hnp.unsigned_integer_dtypes(endianness="<"),
        hnp.floating_dtypes(endianness="<", sizes=(16, 32, 64)),
        st.just(np.dtype(np.longdouble)),
    )


def extreme_values(dtype: np.dtype) -> list[object]:
    """The values of ``dtype`` that break naive statistics: range ends, denormals, NaN, infinities."""
    if dtype.kind == "b":
        return [False, True]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [int(info.min), int(info.max), int(info.max) - 1, 0, 1]
    f = np.finfo(dtype)
    return [f.max, -f.max, f.smallest_subnormal, -f.smallest_subnormal, f.tiny, 0.0, -0.0, 1.0]


def _offset_arrays(dtype: np.dtype, size: int) -> st.SearchStrategy[np.ndarray]:
    """A large common offset plus small noise (millisecond timestamps near 1.7e12 and the like)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        spread = min(1000, int(info.max) // 2)
        bases = [int(info.min), int(info.max) - spread] + ([1_700_000_000_000] if dtype.itemsize == 8 else [])
        unit = 1
    else:
        f = np.finfo(dtype)
        spread = 1000
        bases = [float(f.max) / 2, -float(f.max) / 2, 1.7e12 if float(f.max) > 1e13 else 1000.0]
        unit = None
    noise = st.lists(st.integers(0, spread), min_size=size, max_size=size)

    def build(base: object, steps: list[int]) -> np.ndarray:
        if unit is not None:
            return np.array([base + k * unit for k in steps], dtype=dtype)  # type: ignore[operator]
        start = np.asarray(base, dtype=dtype)
        step = np.maximum(np.spacing(start), np.asarray(1, dtype=dtype))
        return start + np.asarray(steps, dtype=dtype) * step

    return st.builds(build, st.sampled_from(bases), noise)


@st.composite
def extreme_arrays(draw: st.DrawFn, dtype: np.dtype, max_size: int = 40) -> np.ndarray:
    """One-dimensional arrays of ``dtype``: a mix of extremes and any values, a constant, or an offset."""
    if dtype == np.longdouble:  # float64's values: the figures are Python floats
        return draw(extreme_arrays(np.dtype(np.float64), max_size)).astype(dtype)
    size = draw(st.integers(0, max_size))
    element = st.one_of(st.sampled_from(extreme_values(dtype)), hnp.from_dtype(dtype))
    mode = draw(
        st.sampled_from(["mixed", "constant", "offset"] if dtype.kind != "b" else ["mixed", "constant"])
    )
    if mode == "offset":
        return draw(_offset_arrays(dtype, size))
    if mode == "constant":
        return np.full(size, draw(element), dtype=dtype)
    return np.array(draw(st.lists(element, min_size=size, max_size=size)), dtype=dtype)


@st.composite
def shape_mixes(draw: st.DrawFn, max_sources: int = 30, ndim: int = 2) -> list[tuple[int, ...]]:
    """One field's sample shape in each of up to ``max_sources`` sources: a main shape that most
    sources share, or not, and a few or many others (a transposed image, a ragged tail)."""
    pool = draw(
        st.lists(
            hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=1, max_side=4),
            min_size=2,
            max_size=7,
            unique=True,
        )
    )
    num_sources = draw(st.integers(1, 12) | st.integers(1, max_sources) | st.just(max_sources))
    num_odd = min(num_sources, draw(st.integers(1, 6) | st.integers(0, num_sources)))
    odd = draw(st.sets(st.integers(0, num_sources - 1), min_size=num_odd, max_size=num_odd))
    return [draw(st.sampled_from(pool[1:])) if k in odd else pool[0] for k in range(num_sources)]
