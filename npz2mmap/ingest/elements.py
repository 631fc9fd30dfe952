"""Source elements to stored bytes: byte-swapped to little-endian, padding kept, casts checked.

A stored element is its source's raw bytes with every primitive value (also
inside nested records and subarrays) byte-swapped to little-endian; padding
bytes between fields are copied verbatim. numpy's own structured copies leave
padding undefined, so the swap works on raw bytes through views that name only
the bytes to swap. A ``--cast`` stores numpy's cast of each value and is
refused unless every value casts back to exactly the source's value.

Everything streams in pieces of at most CHUNK_NBYTES, whatever the itemsize:
a piece may end inside an element, never inside a swapped value (at most 16
bytes).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np

from ..errors import MismatchError, SourceError
from ..format.dtypes import storage_dtype
from .npy_header import MemberHeader
from .npz import CHUNK_NBYTES

ComplexWarning = getattr(np, "exceptions", np).ComplexWarning  # np.ComplexWarning before numpy 1.25

Piece = bytes | bytearray | memoryview
MAX_VALUE_CHARS = 60


class ByteReader:
    """Exact-size reads over an iterator of byte chunks, copying only across chunk borders."""

    def __init__(self, chunks: Iterable[Piece], where: str) -> None:
        self.chunks = iter(chunks)
        self.where = where
        self.pending = memoryview(b"")

    def read(self, nbytes: int) -> memoryview:
        if not self.pending and nbytes:
            self.pending = self._next_chunk()
        if len(self.pending) >= nbytes:
            data, self.pending = self.pending[:nbytes], self.pending[nbytes:]
            return data
        out = bytearray(nbytes)
        filled = len(self.pending)
        out[:filled] = self.pending
        while filled < nbytes:
            view = self._next_chunk()
            take = min(len(view), nbytes - filled)
            out[filled : filled + take] = view[:take]
            filled += take
            self.pending = view[take:]
        return memoryview(out)

    def pieces(self, nbytes: int) -> Iterator[memoryview]:
        """The next ``nbytes`` in pieces as they arrived, without copying."""
        while nbytes:
            if not self.pending:
                self.pending = self._next_chunk()
            piece, self.pending = self.pending[:nbytes], self.pending[nbytes:]
            nbytes -= len(piece)
            yield piece

    def _next_chunk(self) -> memoryview:
        chunk = next(self.chunks, None)
        if chunk is None:
            raise SourceError(f"{self.where}: data ends early")
        return memoryview(chunk).cast("B")

    def finish(self) -> None:
        """Drain the chunks, so their source runs its end-of-data checks."""
        for _ in self.chunks:
            pass


def stored_pieces(
    chunks: Iterable[Piece], header: MemberHeader, stored: np.dtype, where: str, cast_option: str = "--cast"
) -> Iterator[Piece]:
    """The stored bytes of a member whose raw data arrives in ``chunks``, in file order.

    Raises SourceError naming ``where`` when a cast would change a value or
    cannot be made; the message names the cast as ``cast_option`` (the CLI's
    ``--cast``, the Writer's ``casts=``).
    """
    count = header.nbytes // header.dtype.itemsize
    cast = storage_dtype(header.dtype) != stored
    if not cast and _swap_views(header.dtype) is None:
        yield from chunks
        return
    reader = ByteReader(chunks, where)
    if cast:
        yield from _cast_pieces(reader, header, stored, count, cast_option)
    else:
        yield from _swapped(reader, header.dtype, count)
    reader.finish()


# --- byte swap ---------------------------------------------------------------


def _swap_views(dtype: np.dtype) -> tuple[np.dtype, np.dtype] | None:
    """(source, stored) views of ``dtype``'s bytes that name only the values to swap.

    Assigning the source view to the stored view of a copy of the raw bytes
    swaps every big-endian value and leaves every other byte (padding, strings
    of bytes, little-endian fields) as it was. None when nothing needs a swap.
    """
    if dtype.names is not None:
        found = []
        for field, offset in _fields(dtype):
            views = _swap_views(field)
            if views is not None:
                found.append((offset, views))
        if not found:
            return None
        return _record(found, dtype.itemsize, 0), _record(found, dtype.itemsize, 1)
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        views = _swap_views(base)
        return None if views is None else (np.dtype((views[0], shape)), np.dtype((views[1], shape)))
    if not _is_big_endian(dtype):
        return None
    unit = dtype.itemsize // 2 if dtype.kind == "c" else 4 if dtype.kind == "U" else dtype.itemsize
    source, target = _unit_views(unit)
    count = dtype.itemsize // unit
    return (source, target) if count == 1 else (np.dtype((source, (count,))), np.dtype((target, (count,))))


def _fields(dtype: np.dtype) -> list[tuple[np.dtype, int]]:
    """(dtype, offset) of each field of a record dtype, in the order of its names."""
    if dtype.fields is None:
        return []
    return [(dtype.fields[name][0], dtype.fields[name][1]) for name in dtype.names or ()]


def _record(found: list[tuple[int, tuple[np.dtype, np.dtype]]], itemsize: int, side: int) -> np.dtype:
    return np.dtype(
        {
            "names": [f"f{k}" for k in range(len(found))],
            "formats": [views[side] for _, views in found],
            "offsets": [offset for offset, _ in found],
            "itemsize": itemsize,
        }
    )


def _is_big_endian(dtype: np.dtype) -> bool:
    return dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")


def _unit_views(unit: int) -> tuple[np.dtype, np.dtype]:
    """Views that reverse the bytes of one ``unit``-byte value.

    Units of 2, 4 or 8 bytes are unsigned integers; longer ones (long double)
    are words taken in reverse order, each swapped.
    """
    if unit in (2, 4, 8):
        return np.dtype(f">u{unit}"), np.dtype(f"<u{unit}")
    word = math.gcd(unit, 8)
    words = unit // word
    names = [f"w{k}" for k in range(words)]
    source = np.dtype(
        {"names": names, "formats": [f">u{word}"] * words, "offsets": [k * word for k in range(words)]}
    )
    target = np.dtype(
        {
            "names": names,
            "formats": [f"<u{word}"] * words,
            "offsets": [(words - 1 - k) * word for k in range(words)],
        }
    )
    return source, target


def _swapped(reader: ByteReader, dtype: np.dtype, count: int) -> Iterator[Piece]:
    """``count`` elements of ``dtype`` from ``reader``, swapped, in bounded pieces."""
    views = _swap_views(dtype)
    if views is None:
        yield from _passed(reader, count * dtype.itemsize)
    elif dtype.itemsize <= CHUNK_NBYTES:
        per_piece = CHUNK_NBYTES // dtype.itemsize
        for start in range(0, count, per_piece):
            raw = reader.read(min(per_piece, count - start) * dtype.itemsize)
            out = bytearray(raw)
            np.frombuffer(out, views[1])[...] = np.frombuffer(raw, views[0])
            yield out
    else:
        for _ in range(count):
            yield from _swapped_element(reader, dtype)


def _swapped_element(reader: ByteReader, dtype: np.dtype) -> Iterator[Piece]:
    """One element larger than a piece: walk its structure down to pieces that fit."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        yield from _swapped(reader, base, math.prod(shape))
    elif dtype.names is not None:
        position = 0
        # Fields of a dtype read from a .npy header never overlap.
        for field, offset in sorted(_fields(dtype), key=lambda f: f[1]):
            yield from _passed(reader, offset - position)
            yield from _swapped(reader, field, 1)
            position = offset + field.itemsize
        yield from _passed(reader, dtype.itemsize - position)
    elif dtype.kind == "U":  # a long string of 4-byte characters
        yield from _swapped(reader, np.dtype(f"{dtype.byteorder}U1"), dtype.itemsize // 4)
    else:  # other values are at most 32 bytes, far below a chunk
        raise ValueError(f"cannot split a {dtype} value into pieces")


def _passed(reader: ByteReader, nbytes: int) -> Iterator[Piece]:
    for start in range(0, nbytes, CHUNK_NBYTES):
        yield reader.read(min(CHUNK_NBYTES, nbytes - start))


# --- cast --------------------------------------------------------------------


def _cast_pieces(
    reader: ByteReader, header: MemberHeader, stored: np.dtype, count: int, cast_option: str
) -> Iterator[Piece]:
    """Whole elements cast in pieces, each value checked to cast back exactly."""
    source = header.dtype
    largest = max(source.itemsize, stored.itemsize)
    if largest > CHUNK_NBYTES:
        raise SourceError(
            f"{reader.where}: {cast_option} of elements larger than {CHUNK_NBYTES} bytes "
            f"({source} to {stored}) is not supported"
        )
    per_piece = CHUNK_NBYTES // largest
    for start in range(0, count, per_piece):
        values = np.frombuffer(reader.read(min(per_piece, count - start) * source.itemsize), source)
        converted = _cast_or_refuse(values, stored, f"{reader.where}: ", start, header, cast_option)
        lost = np.flatnonzero(_lost(values, converted))
        if len(lost):
            k = int(lost[0])
            index = _element_index(start + k, header)
            wider = _wider(values[k], stored)
            raise MismatchError(
                f"{reader.where}: {_describe_lost(values, converted, k, index)} "
                f"({cast_option} keeps only values that {stored} represents exactly{wider})"
            )
        yield converted.view(np.uint8).data


def _wider(value: np.generic, stored: np.dtype) -> str:
    """For a string longer than the width declared, the width that holds it."""
    if stored.kind not in "SU" or value.dtype.kind not in "SU":
        return ""
    length = len(value.item())
    return f": declare a wider one, {stored.kind}{length} or more, for strings of {length} characters"


def _element_index(k: int, header: MemberHeader) -> tuple[int, ...]:
    """The array index of the k-th element in file order."""
    order: Literal["C", "F"] = "F" if header.fortran_order else "C"
    return tuple(int(i) for i in np.unravel_index(k, header.shape, order=order))


CAST_FAILURES = (UnicodeError, ValueError, TypeError, OverflowError)


def _cast_or_refuse(
    values: np.ndarray, dtype: np.dtype, where: str, start: int, header: MemberHeader, cast_option: str
) -> np.ndarray:
    """numpy's cast, or MismatchError naming the first value numpy cannot cast (bytes that are
    not ASCII to unicode), where it is (``start``: the first value's place in the member)."""
    try:
        return _cast(values, dtype)
    except CAST_FAILURES as exc:
        failed = exc
    k = next((k for k in range(len(values)) if not _casts(values[k : k + 1], dtype)), None)
    if k is None:  # only the values together fail: numpy's words, then
        raise MismatchError(f"{where}cannot cast {values.dtype} to {dtype}: {failed}") from None
    index = _element_index(start + k, header)
    at = f" at index {index}" if index else ""
    why = ": bytes that are not ASCII are no text" if isinstance(failed, UnicodeError) else ""
    raise MismatchError(
        f"{where}value {_show(values[k])}{at} has no {dtype} form{why} "
        f"({cast_option} keeps only values that {dtype} represents exactly)"
    )


def _casts(values: np.ndarray, dtype: np.dtype) -> bool:
    try:
        _cast(values, dtype)
    except CAST_FAILURES:
        return False
    return True


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """numpy's cast of ``values`` to ``dtype``, into zeroed memory so record padding is zero."""
    out = np.zeros(values.shape, dtype)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        # The cast back of a real source's complex values drops imaginary parts that are zero:
        # numpy's ComplexWarning says nothing a user should see (_lost compares what matters).
        warnings.simplefilter("ignore", ComplexWarning)
        out[...] = values
    return out


def _lost(values: np.ndarray, converted: np.ndarray) -> np.ndarray:
    """Per element, True where ``converted`` is not exactly ``values``.

    The cast back must give the source's value, and for integers the two
    values must also be equal as numbers: uint32 4294967295 stored as int32 -1
    casts back to the same bits. NaN matches NaN and NaT matches NaT; record
    padding is not a value. A datetime or timedelta of no unit (numpy's generic
    one) is exactly NaT only, as NaT of any unit is it.
    """
    if _unitless_time(values.dtype) and converted.dtype.kind in "mM":
        return np.logical_not(np.isnat(values) & np.isnat(converted))
    try:
        back = _cast(converted, values.dtype)
    except (UnicodeError, ValueError, TypeError, OverflowError):
        return np.ones(len(values), dtype=bool)
    lost = _changed(values, back)
    if values.dtype.kind in "biu" and converted.dtype.kind in "biu":
        lost |= np.logical_not((values == converted).reshape(len(values), -1).all(axis=1))
    return lost


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element along axis 0, whether two arrays of one dtype hold different values."""
    if a.dtype.names is not None:
        changed = np.zeros(len(a), dtype=bool)
        for name in a.dtype.names:
            changed |= _changed(a[name], b[name])
        return changed
    if a.dtype.kind == "f":
        same = _same_floats(a, b)
    elif a.dtype.kind == "c":
        same = _same_floats(a.real, b.real) & _same_floats(a.imag, b.imag)
    elif a.dtype.kind in "mM":
        same = (a == b) | (np.isnat(a) & np.isnat(b))
    elif a.dtype.kind == "V":
        same = _raw_rows(a) == _raw_rows(b)
    else:
        same = a == b
    rows = np.asarray(same, dtype=bool).reshape(len(a), -1 if a.size else 0)
    return np.logical_not(rows.all(axis=1))


def _same_floats(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _raw_rows(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(len(a), -1 if a.size else 0).view(np.uint8)


def _describe_lost(values: np.ndarray, converted: np.ndarray, k: int, index: tuple[int, ...]) -> str:
    """One line naming value ``k`` that a cast changes, where it is and what would be stored."""
    at = f" at index {index}" if index else ""
    if _unitless_time(values.dtype) and not np.isnat(values[k]):
        return (
            f"value {_show(values[k])}{at} has no unit, so no value of {converted.dtype} is exactly it"
        )
    return (
        f"value {_show(values[k])}{at} does not survive the cast to {converted.dtype}: "
        f"it would be stored as {_show(converted[k])}"
    )


def _unitless_time(dtype: np.dtype) -> bool:
    """A datetime64 or timedelta64 of numpy's generic unit (np.array([np.datetime64("NaT")]))."""
    return dtype.kind in "mM" and np.datetime_data(dtype)[0] == "generic"


def _show(value: np.generic) -> str:
    """A value as its exact Python value (a float32's, a record's fields' too), so a value and
    its cast, which numpy prints alike, (0.1,) and (0.1,), read as they differ."""
    text = repr(value.item()) if value.dtype.kind in "SUfcV" else str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."
