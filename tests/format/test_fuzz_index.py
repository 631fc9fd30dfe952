"""Fuzzing the index and its tables: no forged dataset yields anything but FormatError.

Each mutant is written as a forger would write it: the blob identity names the
mutated index and table checksums match mutated tables, so every mutation
reaches validation. Opening, reading every sample, ``inspect``'s summary,
``verify`` (which reports, never raises) and ``merge --copy`` are all run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import GOLDEN_DIR, rewrite_blob, rewrite_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap.check.summary import describe_dataset
from npz2mmap.check.verify import verify
from npz2mmap.errors import FormatError
from npz2mmap.read.parts import Parts, PartsReader
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.merge import merge

GOLDEN = GOLDEN_DIR / "v3"
VALID = json.loads((GOLDEN / "index.json").read_text())

# Numbers at and past every limit: int32, int64, numpy's byte and dimension limits.
OVERFLOW_INTS = [2**31, 2**32, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 3, 63, 64, 65, 128, 512, *OVERFLOW_INTS, -1])
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(
        ["<f4", "|O", ">i8", "<U0", "V0", "(2,)<f4", "(0,)<i8", "fixed", "ragged", "npz2mmap", "files"]
        + ["[('a', '<i4')]", "<f4,<i4", "<M8[s]", "|V4", "|S4"]
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += paths(child, (*prefix, i))
    return found


ALL_PATHS = paths(VALID)
DTYPE_PATHS = [path for path in ALL_PATHS if path[-1] == "dtype"]


class Raw(str):
    """JSON text spliced into the document as it is: numbers and nesting json.dumps cannot write."""


def overflow_numbers() -> st.SearchStrategy[Any]:
    """Integers at the limits, and as raw text integers too long for Python to convert."""
    return st.sampled_from(OVERFLOW_INTS) | st.builds(
        lambda digits, sign: Raw(sign + "9" * digits), st.integers(19, 6000), st.sampled_from(["", "-"])
    )


def confused(value: Any) -> st.SearchStrategy[Any]:
    """``value`` as another JSON type: a number as text, a list as an object, an object as a list..."""
    if isinstance(value, bool) or value is None:
        return st.sampled_from([0, 1, "true", [], {}, 0.0])
    if isinstance(value, int):
        return st.sampled_from([str(value), float(value), [value], {"value": value}, value == 0, None])
    if isinstance(value, str):
        return st.sampled_from([[value], {value: value}, 0, value.encode().hex(), None])
    if isinstance(value, list):
        return st.sampled_from([dict(enumerate(value)), json.dumps(value), value[:1], [value], None])
    if isinstance(value, dict):
        return st.sampled_from([list(value.values()), list(value.items()), json.dumps(value), [value], None])
    return json_values


def nested_records(depth: int, leaf: str) -> Raw:
    return Raw('[["a", ' * depth + json.dumps(leaf) + "]]" * depth)


def deep_nesting() -> st.SearchStrategy[Any]:
    """Record dtypes nested around the limit and far past it, and plain nested lists."""
    records = st.builds(
        nested_records, st.sampled_from([1, 31, 32, 33, 100, 480]), st.sampled_from(["<i8", "|u1", "(2,)<f4"])
    )
    lists = st.integers(1, 600).map(lambda depth: Raw("[" * depth + "]" * depth))
    return records | lists


# Edits that keep the golden index valid, so the forged dataset opens and is read.
LEAF_DTYPES = {"image": "|u1", "label": "<i8", "points": "<f4"}
SAME_SIZE_DTYPES = {
    "image": ["|i1", "|b1", "|S1", "|V1"],
    "label": ["<f8", "<u8", "<M8[s]", "|V8", "|S8", "<f4,<i4", "(2,)<f4", "(1,)<i8"],
    "points": ["<i4", "<u4", "|S4", "|V4", "<U1", "(1,)<f4"],
}
SAME_SIZE_SHAPES = {"image": [[3, 2], [6], [1, 6], [6, 1, 1]], "label": [[1], [1, 1]]}
# Shapes whose element count is 0 (the data region stays empty) but numpy cannot make.
EMPTY_HUGE_SHAPES = [[2**62, 0], [2**62, 2**62, 0], [0, 2**63 - 1], [2**31] * 3 + [0], [0] * 63, [1] * 64]


@st.composite
def forged_indexes(draw: st.DrawFn) -> Any:
    """The golden index with plausible edits: same-size dtypes, deep records, reshapes, swapped names."""
    document = copy.deepcopy(VALID)
    fields = {f["name"]: f for f in document["fields"]}
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["dtype", "nest", "reshape", "empty-huge", "swap-names"]))
        name = draw(st.sampled_from(sorted(fields)))
        f = fields[name]
        if edit == "dtype":
            f["dtype"] = draw(st.sampled_from(SAME_SIZE_DTYPES[name]))
        elif edit == "nest":
            f["dtype"] = nested_records(draw(st.sampled_from([1, 2, 31, 32, 33, 64, 480])), LEAF_DTYPES[name])
        elif edit == "reshape" and name in SAME_SIZE_SHAPES:
            f["shape"] = draw(st.sampled_from(SAME_SIZE_SHAPES[name]))
            f["ndim"] = len(f["shape"])
        elif edit == "empty-huge" and "shape" in f:
            f["shape"] = draw(st.sampled_from(EMPTY_HUGE_SHAPES))
            f["ndim"] = len(f["shape"])
            f["data"]["nbytes"] = 0
        elif edit == "swap-names":
            other = fields[draw(st.sampled_from(sorted(fields)))]
            f["name"], other["name"] = other["name"], f["name"]
    return document


@st.composite
def mutated_indexes(draw: st.DrawFn) -> Any:
    """Forged or golden indexes, then broken: values replaced, deleted, nudged, overflowed, confused."""
    forged = draw(st.booleans())
    document = draw(forged_indexes()) if forged else copy.deepcopy(VALID)
    broken = not forged or draw(st.booleans())
    for _ in range(draw(st.integers(1, 3)) if broken else 0):
        action = draw(st.sampled_from(["replace", "delete", "nudge", "overflow", "deep", "confuse"]))
        path = draw(st.sampled_from(DTYPE_PATHS if action == "deep" and draw(st.booleans()) else ALL_PATHS))
        parent = document
        try:
            for step in path[:-1]:
                parent = parent[step]
            value = parent[path[-1]]
            if action == "delete" and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif action == "nudge" and isinstance(value, int):
                parent[path[-1]] += draw(st.sampled_from([-64, -1, 1, 8, 64, 2**40, 2**62]))
            elif action == "overflow":
                parent[path[-1]] = draw(overflow_numbers())
            elif action == "deep":
                parent[path[-1]] = draw(deep_nesting())
            elif action == "confuse":
                parent[path[-1]] = draw(confused(value))
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    if draw(st.integers(0, 19)) == 7:  # not a boundary, which hypothesis favours
        document = draw(json_values)
    return document


def index_text(document: Any) -> bytes:
    """The document as JSON, with every Raw value spliced in as it is."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {key: mark(child) for key, child in value.items()}
        if isinstance(value, list):
            return [mark(child) for child in value]
        return value

    text = json.dumps(mark(document))
    for k, raw in enumerate(raws):
        text = text.replace(f'"@@raw{k}@@"', raw)
    return text.encode()


def exercise(dataset: Path, scratch: Path) -> None:
    """Every way a dataset is read: nothing but FormatError may escape, and no output is made of it."""
    with contextlib.suppress(FormatError):
        reader = PartsReader(Parts(dataset))
        for name in reader.field_names:
            for i in range(len(reader)):
                with contextlib.suppress(FormatError):
                    reader.view(name, i)
            with contextlib.suppress(FormatError):
                reader.gather(name, np.arange(len(reader)))
            with contextlib.suppress(FormatError):
                reader.shapes(name)
    with contextlib.suppress(FormatError):
        describe_dataset(dataset)
    report = verify(dataset)
    merged = scratch / "merged"
    try:
        merge([dataset], merged, copy=True)
    except FormatError:
        assert not merged.exists()
        return
    merged_report = verify(merged)
    if report.ok:
        assert merged_report.ok, merged_report.problems
        assert_same_samples(dataset, merged)


def assert_same_samples(dataset: Path, merged: Path) -> None:
    one, other = DatasetReader(dataset), DatasetReader(merged)
    assert one.field_names == other.field_names and len(one) == len(other)
    for name in one.field_names:
        for i in range(len(one)):
            assert one.view(name, i).tobytes() == other.view(name, i).tobytes()


@contextlib.contextmanager
def golden_copy():
    scratch = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(GOLDEN, scratch / "ds")
        yield scratch
    finally:
        shutil.rmtree(scratch)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_indexes())
def test_mutated_indexes_raise_only_format_error(document) -> None:
    with golden_copy() as scratch:
        rewrite_index(scratch / "ds", index_text(document))
        exercise(scratch / "ds", scratch)


# The golden ragged field 'points' (<f4, ndim 2): its tables, as payload offsets and int64 entries.
POINTS_TABLES = {"offsets": (448, 4), "shapes": (512, 6)}


@st.composite
def forged_tables(draw: st.DrawFn) -> dict[str, list[tuple[int, int]]]:
    """Entries of 'points' tables to overwrite: (entry, value), values at and past every limit."""
    int64s = [v for v in OVERFLOW_INTS if -(2**63) <= v < 2**63]
    values = st.sampled_from([0, 1, 2, 8, 24, -1, *int64s]) | st.integers(-(2**63), 2**63 - 1)
    edits: dict[str, list[tuple[int, int]]] = {}
    for _ in range(draw(st.integers(1, 4))):
        table = draw(st.sampled_from(sorted(POINTS_TABLES)))
        entry = draw(st.integers(0, POINTS_TABLES[table][1] - 1))
        edits.setdefault(table, []).append((entry, draw(values)))
    return edits


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forged_tables())
def test_forged_ragged_tables_raise_only_format_error(edits) -> None:
    with golden_copy() as scratch:
        dataset = scratch / "ds"
        payload = (dataset / "data.npy").read_bytes()[128:]
        crcs = {}
        for table, changes in edits.items():
            offset, count = POINTS_TABLES[table]
            entries = np.frombuffer(payload, "<i8", count, offset).copy()
            for entry, value in changes:
                entries[entry] = value
            rewrite_blob(dataset, offset, entries.tobytes())
            crcs[table] = zlib.crc32(entries.tobytes())

        def record_checksums(document: dict) -> None:
            points = next(f for f in document["fields"] if f["name"] == "points")
            for table, crc in crcs.items():
                points[table]["crc32"] = crc

        rewrite_index(dataset, record_checksums)
        exercise(dataset, scratch)


@pytest.mark.parametrize(
    "raw", [b"\x00" * 10, b'{"format": "npz2mmap", "version": 1' + b"[" * 100_000, b"1e999999"]
)
def test_pathological_json_raises_format_error(tmp_path, raw) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN, dataset)
    rewrite_index(dataset, raw)
    with pytest.raises(FormatError):
        DatasetReader(dataset)
