"""Fuzzing the index loader: no mutated index yields anything but FormatError."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap.errors import FormatError
from npz2mmap.reader import DatasetReader
from npz2mmap.verify import verify

GOLDEN = Path(__file__).parent / "data" / "golden" / "v2"
VALID = json.loads((GOLDEN / "index.json").read_text())

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 3, 63, 64, 128, 512, 2**31, 2**63, -1])
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(
        ["<f4", "|O", ">i8", "<U0", "V0", "fixed", "ragged", "npz2mmap", "files", "[('a', '<i4')]"]
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


@st.composite
def mutated_indexes(draw: st.DrawFn) -> Any:
    document = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = document
        try:
            for step in path[:-1]:
                parent = parent[step]
            action = draw(st.sampled_from(["replace", "delete", "nudge"]))
            if action == "delete" and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif action == "nudge" and isinstance(parent[path[-1]], int):
                parent[path[-1]] += draw(st.sampled_from([-64, -1, 1, 8, 64, 2**40]))
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    if draw(st.booleans()):
        document = draw(json_values) if draw(st.integers(0, 9)) == 0 else document
    return document


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_indexes())
def test_mutated_indexes_raise_only_format_error(document) -> None:
    tmp = Path(tempfile.mkdtemp())
    try:
        dataset = tmp / "ds"
        shutil.copytree(GOLDEN, dataset)
        (dataset / "index.json").write_text(json.dumps(document))
        try:
            reader = DatasetReader(dataset)
        except FormatError:
            return
        for name in reader.field_names:
            for i in range(len(reader)):
                try:
                    reader.view(name, i)
                except FormatError:
                    pass
        verify(dataset)
    finally:
        shutil.rmtree(tmp)


@pytest.mark.parametrize(
    "raw", [b"\x00" * 10, b'{"format": "npz2mmap", "version": 1' + b"[" * 100_000, b"1e999999"]
)
def test_pathological_json_raises_format_error(tmp_path, raw) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN, dataset)
    (dataset / "index.json").write_bytes(raw)
    with pytest.raises(FormatError):
        DatasetReader(dataset)
