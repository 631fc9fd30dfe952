"""The on-disk format, version 3: constants, the index model and its validation.

This module builds and validates ``index.json`` and the blob header;
``docs/FORMAT.md`` states the same rules in prose. The writer, the reader and
``verify`` all go through it (discovery reads only an index's ``format`` key,
to refuse a dataset as an input).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError, Npz2mmapError
from ..text import brief, quoted
from .dtypes import dtype_from_json, dtype_to_json
from .files import decode_json, read_regular_file

FORMAT_NAME = "npz2mmap"
FORMAT_VERSION = 3
# Version 2 differs only in having no "shape" for ragged fields (their sample shape is then
# derived from the shapes table by readers that need it).
SUPPORTED_VERSIONS = frozenset({2, 3})

INDEX_NAME = "index.json"
BLOB_NAME = "data.npy"
SOURCES_NAME = "sources.jsonl"
SKIPPED_NAME = "skipped.jsonl"
DATASET_FILES = (INDEX_NAME, BLOB_NAME, SOURCES_NAME, SKIPPED_NAME)
# Hidden names beside OUT while it is written (write/publish.py): ".OUT<mark>..." and ".OUT<suffix>".
STAGING_MARK = ".npz2mmap-tmp-"
RETIRED_MARK = ".npz2mmap-old-"
LOCK_SUFFIX = ".npz2mmap-lock"

# 64 bytes is numpy's ARRAY_ALIGN and a cache line: any dtype view is aligned.
MIN_ALIGN = 64
MAX_ALIGN = 1 << 30
ALIGN_RULE = f"a power of two from {MIN_ALIGN} to {MAX_ALIGN}"


def is_valid_align(align: int) -> bool:
    """Whether ``align`` may be a dataset's alignment (ALIGN_RULE): its one home."""
    return MIN_ALIGN <= align <= MAX_ALIGN and not align & (align - 1)

OFFSET_DTYPE = np.dtype("<i8")
SHAPE_DTYPE = np.dtype("<i8")
CRC_DTYPE = np.dtype("<u4")

NPY_MAGIC = b"\x93NUMPY"
# The blob's .npy header is padded to this length, a multiple of 64, so the
# payload starts aligned and region file offsets do not depend on its size.
BLOB_HEADER_NBYTES = 128
MAX_INDEX_NBYTES = 64 << 20

# The payload starts with the blob's identity: what ties it to its index.
IDENTITY_MAGIC = b"npz2mmap-blob\x00\x00\x00"
IDENTITY_NBYTES = 64

# numpy's limits: a dimension and a byte count are npy_intp (int64), an array
# has at most NPY_MAXDIMS axes (64 since numpy 2.0, 32 before).
MAX_NBYTES = (1 << 63) - 1
MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
# data.npy is at most MAX_NBYTES long (the largest file offset, too).
MAX_PAYLOAD_NBYTES = MAX_NBYTES - BLOB_HEADER_NBYTES
# Field names are keys of index.json, of each sample's dict and of every message naming a field.
MAX_FIELD_NAME_CHARS = 255
# C0 and C1 controls and Unicode line breaks: a name holding one would break a line of output.
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

FIXED = "fixed"
RAGGED = "ragged"
MODES = frozenset({"files", "rows"})

# A field's shape in every sample: each dimension's length, or None where samples differ.
SampleShape = tuple["int | None", ...]


@dataclass(frozen=True)
class Region:
    """A byte range of the blob payload; ``crc32`` covers it (tables only)."""

    offset: int
    nbytes: int
    crc32: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Field:
    """One NPZ key across all samples: its dtype, shape and regions."""

    name: str
    dtype: np.dtype
    ndim: int
    shape: tuple[int, ...] | None  # None for ragged fields
    data: Region
    sample_crc32: Region
    offsets: Region | None = None  # ragged only: int64 (N + 1,) byte offsets
    shapes: Region | None = None  # ragged only: int64 (N, ndim)
    cast: bool = False  # sources were cast to ``dtype`` on request (--cast)
    # Ragged only: each dimension's length where every sample has it, None where samples differ;
    # None for a version 2 index, which does not record it (see sample_shape_of_table).
    ragged_shape: SampleShape | None = None

    @property
    def sample_shape(self) -> SampleShape | None:
        """Every sample's shape, None in the dimensions where samples differ; None if unrecorded."""
        return self.shape if self.shape is not None else self.ragged_shape

    @property
    def ragged(self) -> bool:
        return self.shape is None

    @property
    def stride(self) -> int:
        """Bytes per sample of a fixed field."""
        if self.shape is None:
            raise FormatError(f"field {self.name!r} is ragged and has no stride")
        return checked_nbytes(self.shape, self.dtype.itemsize, f"field {self.name!r}")

    def tables(self) -> dict[str, Region]:
        named = {"sample_crc32": self.sample_crc32, "offsets": self.offsets, "shapes": self.shapes}
        return {name: region for name, region in named.items() if region is not None}


@dataclass(frozen=True)
class Index:
    """Everything ``index.json`` says about a dataset."""

    num_samples: int
    align: int
    payload_nbytes: int
    fields: tuple[Field, ...]
    tool_version: str
    mode: str = "files"
    num_sources: int = 0
    num_skipped: int = 0
    part: tuple[int, int] | None = None  # (i, n): made by ``convert --part i/n``
    digest: bytes = b""  # SHA-256 of index.json as read; empty for an index not yet written
    version: int = FORMAT_VERSION  # as read; writers write FORMAT_VERSION only

    @property
    def blob_nbytes(self) -> int:
        return BLOB_HEADER_NBYTES + self.payload_nbytes

    def field(self, name: str) -> Field:
        for candidate in self.fields:
            if candidate.name == name:
                return candidate
        known = ", ".join(f.name for f in self.fields)
        raise KeyError(f"no field {name!r}; the dataset has: {known}")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


def representable_nbytes(shape: Sequence[int], itemsize: int) -> int | None:
    """The byte size of an array of ``shape`` and ``itemsize``, or None if numpy cannot make one.

    numpy's rule: at most MAX_NDIM axes, every dimension a non-negative int64,
    and the product of the non-zero dimensions times the itemsize at most
    MAX_NBYTES (so ``(2**62, 2**62, 0)`` is refused although it holds nothing).
    Python ints throughout, and the product stops growing once past the limit.
    """
    if len(shape) > MAX_NDIM:
        return None
    extent = itemsize
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= MAX_NBYTES:
            return None
        extent *= dim or 1
        if extent > MAX_NBYTES:
            return None
    return 0 if 0 in shape else extent


def checked_nbytes(
    shape: Sequence[int], itemsize: int, where: str, error: type[Npz2mmapError] = FormatError
) -> int:
    """``prod(shape) * itemsize`` of numbers read from a file; raise ``error`` naming ``where``
    if numpy cannot represent such an array (see representable_nbytes)."""
    nbytes = representable_nbytes(shape, itemsize)
    if nbytes is None:
        raise error(
            f"{where}: shape {brief(tuple(shape))} of {itemsize}-byte items is too large for numpy (at most "
            f"{MAX_NDIM} dimensions, and under 2**63 bytes even with its zero-length axes taken as 1)"
        )
    return nbytes


# --- the blob header -------------------------------------------------------


def blob_header(payload_nbytes: int) -> bytes:
    """The .npy version 1.0 header of a 1-D uint8 array of ``payload_nbytes``.

    Always BLOB_HEADER_NBYTES long (padded with spaces), so every payload
    offset has the same file offset whatever the payload size.
    """
    if not 0 <= payload_nbytes < 1 << 63:
        raise FormatError(f"payload of {payload_nbytes} bytes cannot be described")
    text = f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({payload_nbytes},), }}"
    prefix = NPY_MAGIC + b"\x01\x00" + (BLOB_HEADER_NBYTES - 10).to_bytes(2, "little")
    return prefix + text.ljust(BLOB_HEADER_NBYTES - 11).encode("latin1") + b"\n"


def blob_identity(index_digest: bytes, version: int = FORMAT_VERSION) -> bytes:
    """The identity region at payload offset 0: magic, version, and the index's SHA-256.

    A blob names the exact bytes of its index, so an edited index, or a
    dataset replaced after a reader read its index, is found before any read.
    Derived from content, not drawn at random, so a conversion stays
    byte-identical from run to run.
    """
    if len(index_digest) != 32:
        raise ValueError("an index digest is 32 bytes of SHA-256")
    head = IDENTITY_MAGIC + version.to_bytes(4, "little")
    return (head + index_digest).ljust(IDENTITY_NBYTES, b"\0")


def index_digest(index_text: bytes) -> bytes:
    return hashlib.sha256(index_text).digest()


# --- index.json: writing ---------------------------------------------------


def index_to_json(index: Index) -> str:
    """Serialise deterministically: same dataset, same bytes."""
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_samples": index.num_samples,
        "align": index.align,
        "payload_nbytes": index.payload_nbytes,
        "fields": [_field_to_json(f) for f in index.fields],
        "provenance": {
            "tool": FORMAT_NAME,
            "tool_version": index.tool_version,
            "mode": index.mode,
            "num_sources": index.num_sources,
            "num_skipped": index.num_skipped,
            "part": list(index.part) if index.part is not None else None,
        },
    }
    return json.dumps(document, sort_keys=True, indent=1) + "\n"


def _field_to_json(f: Field) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name, "dtype": dtype_to_json(f.dtype), "ndim": f.ndim, "cast": f.cast}
    out["kind"] = RAGGED if f.shape is None else FIXED
    if f.sample_shape is None:
        raise ValueError(f"field {f.name!r}: a ragged field's shape must be known to write its index")
    out["shape"] = list(f.sample_shape)
    out["data"] = _region_to_json(f.data)
    for name, region in f.tables().items():
        out[name] = _region_to_json(region)
    return out


def _region_to_json(region: Region) -> dict[str, int]:
    out = {"offset": region.offset, "nbytes": region.nbytes}
    if region.crc32 is not None:
        out["crc32"] = region.crc32
    return out


# --- index.json: reading and validation ------------------------------------


def load_index(dataset_dir: str | os.PathLike[str]) -> Index:
    """Read and fully validate ``index.json``; raise FormatError on the first problem."""
    path = os.path.join(os.fspath(dataset_dir), INDEX_NAME)
    if not os.path.isdir(dataset_dir):
        what = "not a directory" if os.path.lexists(dataset_dir) else "no such dataset"
        if not os.path.lexists(dataset_dir) and is_being_written(os.fspath(dataset_dir)):
            what += (
                " yet: a conversion, Writer or merge is writing it (or one was stopped: its hidden "
                "files are beside it); open it once that has finished"
            )
        raise FormatError(f"{os.fspath(dataset_dir)}: {what}")
    raw = read_regular_file(path, MAX_INDEX_NBYTES)
    return dataclasses.replace(parse_index(decode_json(raw, path), path), digest=index_digest(raw))


def is_being_written(dataset_dir: str) -> bool:
    """Whether the hidden lock or staging files of a write to ``dataset_dir`` lie beside it."""
    parent, name = os.path.split(os.path.normpath(os.path.abspath(dataset_dir)))
    try:
        entries = os.listdir(parent)
    except OSError:
        return False
    marks = (f".{name}{LOCK_SUFFIX}", f".{name}{STAGING_MARK}")
    return any(entry.startswith(marks) for entry in entries)


def parse_index(document: Any, where: str) -> Index:
    """Validate a decoded index document and build the Index it describes."""
    doc = _Obj(document, where)
    name = doc.get("format", str)
    version = doc.get("version", int, minimum=0)
    if name != FORMAT_NAME:
        raise FormatError(f"{where}: format is {brief(name)}, expected {FORMAT_NAME!r}")
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        advice = "convert the sources again" if version < FORMAT_VERSION else "upgrade npz2mmap"
        raise FormatError(
            f"{where}: format version {version} is not supported by this reader "
            f"(supports {supported}); {advice}"
        )
    doc.require_keys({"format", "version", "num_samples", "align", "payload_nbytes", "fields", "provenance"})
    num_samples = doc.get("num_samples", int, minimum=0)
    align = doc.get("align", int, minimum=MIN_ALIGN)
    if not is_valid_align(align):
        raise FormatError(f"{where}: align must be {ALIGN_RULE}, found {align}")
    payload_nbytes = doc.get("payload_nbytes", int, minimum=0, maximum=MAX_PAYLOAD_NBYTES)
    provenance = _Obj(doc.get("provenance", dict), f"{where}: provenance")
    provenance.require_keys({"tool", "tool_version", "mode", "num_sources", "num_skipped", "part"})
    provenance.get("tool", str)
    mode = provenance.get("mode", str)
    if mode not in MODES:
        raise FormatError(f"{where}: provenance mode {brief(mode)} is not one of {sorted(MODES)}")
    fields = tuple(
        _parse_field(item, num_samples, version, f"{where}: fields[{i}]")
        for i, item in enumerate(doc.get("fields", list))
    )
    if not fields and num_samples:
        raise FormatError(
            f"{where}: no fields for {num_samples} samples; only an empty dataset (0 samples) has no fields"
        )
    index = Index(
        num_samples=num_samples,
        align=align,
        payload_nbytes=payload_nbytes,
        fields=fields,
        tool_version=provenance.get("tool_version", str),
        mode=mode,
        num_sources=provenance.get("num_sources", int, minimum=0),
        num_skipped=provenance.get("num_skipped", int, minimum=0),
        part=_parse_part(provenance.value["part"], f"{where}: provenance part"),
        version=version,
    )
    check_layout(index, where)
    return index


def _parse_part(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise FormatError(f"{where} must be null or [i, n], found {brief(value)}")
    i, n = (_as_int(v, where, minimum=0) for v in value)
    if not i < n:
        raise FormatError(f"{where}: part {i} of {n} does not exist")
    return i, n


def _parse_field(document: Any, num_samples: int, version: int, where: str) -> Field:
    doc = _Obj(document, where)
    name = doc.get("name", str)
    if not _is_text(name):
        raise FormatError(f"{where}: field name {brief(name)} is not valid text")
    where = f"{where} ({brief(name)})"
    doc = _Obj(document, where)
    kind = doc.get("kind", str)
    dtype = dtype_from_json(doc.get("dtype", (str, list)), where)
    ndim = doc.get("ndim", int, minimum=0)
    if ndim >= MAX_NDIM:
        raise FormatError(
            f"{where}: ndim {ndim} leaves no room for the sample axis (numpy allows {MAX_NDIM} dimensions)"
        )
    if kind == FIXED:
        doc.require_keys({"name", "kind", "dtype", "ndim", "cast", "shape", "data", "sample_crc32"})
        listed = doc.get("shape", list)
        if len(listed) != ndim:
            raise FormatError(f"{where}: shape {brief(listed)} does not have ndim {ndim}")
        shape = tuple(_as_int(v, f"{where}: shape", minimum=0) for v in listed)
        offsets = shapes = None
        ragged_shape: SampleShape | None = None
    elif kind == RAGGED:
        keys = {"name", "kind", "dtype", "ndim", "cast", "data", "offsets", "shapes", "sample_crc32"}
        doc.require_keys(keys if version == 2 else keys | {"shape"})
        if ndim == 0:
            raise FormatError(f"{where}: a ragged field needs ndim of at least 1")
        shape = None
        if version == 2:  # records no shape: only a 1-d field's is known without the tables
            ragged_shape = (None,) if ndim == 1 else None
        else:
            ragged_shape = _parse_ragged_shape(doc.get("shape", list), ndim, where)
        offsets = _parse_region(doc.get("offsets", dict), f"{where}: offsets", table=True)
        shapes = _parse_region(doc.get("shapes", dict), f"{where}: shapes", table=True)
    else:
        raise FormatError(f"{where}: kind is {brief(kind)}, expected {FIXED!r} or {RAGGED!r}")
    f = Field(
        name=name,
        dtype=dtype,
        ndim=ndim,
        shape=shape,
        data=_parse_region(doc.get("data", dict), f"{where}: data", table=False),
        sample_crc32=_parse_region(doc.get("sample_crc32", dict), f"{where}: sample_crc32", table=True),
        offsets=offsets,
        shapes=shapes,
        cast=doc.get("cast", bool),
        ragged_shape=ragged_shape,
    )
    _check_region_sizes(f, num_samples, where)
    return f


def _parse_ragged_shape(listed: list[Any], ndim: int, where: str) -> SampleShape:
    """A ragged field's shape: ndim entries, each a length or null (samples differ), one null at least."""
    if len(listed) != ndim:
        raise FormatError(f"{where}: shape {brief(listed)} does not have ndim {ndim}")
    shape = tuple(None if v is None else _as_int(v, f"{where}: shape", minimum=0) for v in listed)
    if None not in shape:
        raise FormatError(
            f"{where}: a ragged field's shape {brief(listed)} must be null in a dimension in which "
            "samples differ"
        )
    return shape


def _parse_region(document: Any, where: str, table: bool) -> Region:
    doc = _Obj(document, where)
    doc.require_keys({"offset", "nbytes", "crc32"} if table else {"offset", "nbytes"})
    crc = doc.get("crc32", int, minimum=0, maximum=0xFFFFFFFF) if table else None
    bound = {"minimum": 0, "maximum": MAX_PAYLOAD_NBYTES}
    return Region(doc.get("offset", int, **bound), doc.get("nbytes", int, **bound), crc)


def _check_region_sizes(f: Field, num_samples: int, where: str) -> None:
    """Each region holds what num_samples samples need, as arrays numpy can make."""
    expected = {"sample_crc32": checked_nbytes((num_samples,), CRC_DTYPE.itemsize, f"{where}: sample_crc32")}
    if f.shape is not None:
        # Readers view the data as one (num_samples, *shape) array.
        expected["data"] = checked_nbytes((num_samples, *f.shape), f.dtype.itemsize, f"{where}: all samples")
    else:
        expected["offsets"] = checked_nbytes((num_samples + 1,), OFFSET_DTYPE.itemsize, f"{where}: offsets")
        expected["shapes"] = checked_nbytes((num_samples, f.ndim), SHAPE_DTYPE.itemsize, f"{where}: shapes")
        _check_ragged_data_size(f, num_samples, where)
    regions = {"data": f.data, **f.tables()}
    for name, nbytes in expected.items():
        if regions[name].nbytes != nbytes:
            raise FormatError(
                f"{where}: {name} holds {regions[name].nbytes} bytes, expected {nbytes} "
                f"for {num_samples} samples"
            )


def _check_ragged_data_size(f: Field, num_samples: int, where: str) -> None:
    """A ragged field's data is whole elements, and none at all without samples."""
    if f.data.nbytes % f.dtype.itemsize or (num_samples == 0 and f.data.nbytes):
        raise FormatError(
            f"{where}: data holds {f.data.nbytes} bytes, not whole {f.dtype.itemsize}-byte elements "
            f"of {num_samples} samples"
        )


def field_name_problem(name: str) -> str | None:
    """Why a writer must not store ``name`` as a field name (see docs/FORMAT.md), or None."""
    if not name:
        return "is empty"
    if len(name) > MAX_FIELD_NAME_CHARS:
        return f"has {len(name):,} characters, more than the {MAX_FIELD_NAME_CHARS} a field name may have"
    if _CONTROL_CHARS.search(name):
        return "holds a control character"
    if not _is_text(name):
        return "is not valid text (it holds a lone surrogate)"
    return None


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def check_layout(index: Index, where: str) -> None:
    """Every region aligned, inside the payload, and no two overlapping."""
    names = [f.name for f in index.fields]
    if len(set(names)) != len(names):
        raise FormatError(f"{where}: field names are not unique")
    if index.payload_nbytes < IDENTITY_NBYTES:
        raise FormatError(
            f"{where}: payload of {index.payload_nbytes} bytes has no room for its "
            f"{IDENTITY_NBYTES}-byte identity"
        )
    spans = [(0, IDENTITY_NBYTES, "the blob identity")]
    for f in index.fields:
        for name, region in {"data": f.data, **f.tables()}.items():
            label = f"field {f.name!r} {name}"
            if (BLOB_HEADER_NBYTES + region.offset) % index.align:
                raise FormatError(
                    f"{where}: {label} at offset {region.offset} is not {index.align}-byte aligned"
                )
            if region.end > index.payload_nbytes:
                raise FormatError(
                    f"{where}: {label} ends at {region.end}, past the payload of {index.payload_nbytes} bytes"
                )
            if region.nbytes:
                spans.append((region.offset, region.end, label))
    spans.sort()
    for (_, end, label), (start, _, next_label) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise FormatError(f"{where}: {label} overlaps {next_label}")


class _Obj:
    """A JSON object with typed, range-checked access that raises FormatError."""

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise FormatError(f"{where}: expected a JSON object, found {type(value).__name__}")
        self.value = value
        self.where = where

    def require_keys(self, keys: set[str]) -> None:
        missing = sorted(keys - self.value.keys())
        extra = sorted(self.value.keys() - keys)
        if missing:
            raise FormatError(f"{self.where}: missing key(s) {quoted(missing)}")
        if extra:
            raise FormatError(f"{self.where}: unexpected key(s) {quoted(extra)}")

    def get(self, key: str, kind: Any, minimum: int | None = None, maximum: int = MAX_NBYTES) -> Any:
        if key not in self.value:
            raise FormatError(f"{self.where}: missing key(s) {key}")
        value = self.value[key]
        if kind is int:
            return _as_int(value, f"{self.where}: {key}", minimum, maximum)
        if not isinstance(value, kind):
            expected = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise FormatError(f"{self.where}: {key} must be {expected}, found {type(value).__name__}")
        return value


def _as_int(value: Any, where: str, minimum: int | None = None, maximum: int = MAX_NBYTES) -> int:
    """An int of the index; none is larger than MAX_NBYTES (a count, a size or an offset)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatError(f"{where} must be an integer, found {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be at least {minimum}, found {brief(value)}")
    if value > maximum:
        raise FormatError(f"{where} must be at most {maximum}, found {brief(value)}")
    return value
