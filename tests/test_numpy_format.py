"""numpy's own .npy test material, taken from the installed numpy, through every way in.

Every array of numpy's ``test_format.py`` (``basic_arrays``, ``record_arrays``,
the dtypes of ``test_descr_to_dtype``, ``test_load_padded_dtype`` and
``test_metadata_dtype``) goes through ``convert`` of an NPZ file, ``convert``
of a ``.npy`` file and ``Writer``. Each is either refused at conversion with
one line naming the file and key, or converts into a dataset that
``DatasetReader``, ``MmapDataset``, ``inspect`` and ``verify`` open, whose
sample holds exactly numpy's bytes of the source (``np.load``), byte-swapped
by numpy to little-endian. The same property runs on generated dtypes.
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import nested_dtypes

from npz2mmap.appender import Writer
from npz2mmap.cli import cli
from npz2mmap.converter import convert
from npz2mmap.errors import FormatError, Npz2mmapError
from npz2mmap.reader import DatasetReader
from npz2mmap.spec import dtype_from_json, dtype_nesting_problem, dtype_to_json
from npz2mmap.verify import verify

with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)  # its marks are numpy's own
    test_format = importlib.import_module("numpy.lib.tests.test_format")

KEY = "arr"
ROUTES = ("npz", "npy", "writer")


def _parametrized_dtypes(test: object) -> list[np.dtype]:
    """The dtypes a test of numpy's test_format.py is parametrized with."""
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    return [np.dtype(dt) for mark in marks for dt in mark.args[1]]


def numpy_arrays() -> Iterator[tuple[str, np.ndarray]]:
    """(label, array) for every array numpy's own format tests save and load."""
    for i, array in enumerate(test_format.basic_arrays):
        yield f"basic_arrays[{i}] {array.dtype.str} {array.shape}", array
    for i, array in enumerate(test_format.record_arrays):
        yield f"record_arrays[{i}]", array
    for name in ("test_descr_to_dtype", "test_load_padded_dtype", "test_metadata_dtype"):
        for i, dtype in enumerate(_parametrized_dtypes(getattr(test_format, name))):
            yield f"{name}[{i}]", np.ones(3, dtype)


def zero_padded(array: np.ndarray) -> np.ndarray:
    """The array's values in a fresh array whose record padding is zero (np.ones leaves it unset)."""
    copy = np.zeros(array.shape, array.dtype, order="F" if np.isfortran(array) else "C")
    copy[...] = array
    return copy


def expected_bytes(source: np.ndarray) -> bytes:
    """numpy's bytes of ``source`` in C order, every value byte-swapped by numpy to little-endian.

    Padding stays zero, as in the zero-padded sources.
    """
    little = np.zeros(source.shape, source.dtype.newbyteorder("<"))
    little[...] = source
    return little.tobytes()


def write_source(route: str, array: np.ndarray, src_dir: Path) -> Path:
    src_dir.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # np.save warns of metadata it drops and of format 2.0 and 3.0
        if route == "npy":
            path = src_dir / "s.npy"
            np.save(path, array)
        else:
            path = src_dir / "s.npz"
            np.savez(path, **{KEY: array})
    return path


def load_source(path: Path) -> np.ndarray:
    """The source array as np.load reads it (an NPZ's member, or the .npy file's array)."""
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            return loaded[KEY]
    return loaded


def build(route: str, array: np.ndarray, root: Path) -> tuple[Path, np.ndarray, str]:
    """Convert ``array`` one way; the dataset, numpy's view of the source, and the key of its field."""
    out = root / "out"
    if route == "writer":
        with Writer(out) as w:
            w.append({KEY: array})
        return out, array, KEY
    path = write_source(route, array, root / "src")
    convert([path], out, workers=1)
    return out, load_source(path), "arr_0" if route == "npy" else KEY


def check_opens_and_reads_back(out: Path, source: np.ndarray, key: str) -> None:
    """Every reader opens the dataset, and its one sample holds exactly ``expected_bytes(source)``."""
    from npz2mmap.dataset import MmapDataset

    little = source.dtype.newbyteorder("<")
    reader = DatasetReader(out)
    view = reader.view(key, 0)
    assert (view.dtype, view.shape) == (little, source.shape)
    assert np.ascontiguousarray(view).tobytes() == expected_bytes(source)
    sample = MmapDataset(out, fields=key)[0]
    assert np.ascontiguousarray(sample).tobytes() == expected_bytes(source)
    for args in (
        ["inspect", str(out)],
        ["inspect", "--json", str(out)],
        ["inspect", "--sample", "0", str(out)],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
    report = verify(out, sources=True)
    assert report.ok, report.problems


def round_trip(route: str, array: np.ndarray, root: Path) -> str:
    """'accepted' when ``array`` converts and reads back exactly, 'refused' when conversion refuses it
    with a one-line error naming the source and key."""
    try:
        out, source, key = build(route, array, root)
    except Npz2mmapError as exc:
        message = str(exc)
        assert "\n" not in message
        assert ("sample 0" if route == "writer" else "s.np") in message
        assert key_named(message, route)
        assert not (root / "out").exists()
        return "refused"
    check_opens_and_reads_back(out, source, key)
    return "accepted"


def key_named(message: str, route: str) -> bool:
    return f"[{'arr_0' if route == 'npy' else KEY}]" in message or route == "npy"


@pytest.mark.parametrize("route", ROUTES)
def test_numpy_format_arrays_are_refused_clearly_or_read_back_exactly(tmp_path: Path, route: str) -> None:
    outcomes: Counter[str] = Counter()
    refused = []
    for n, (label, array) in enumerate(numpy_arrays()):
        outcome = round_trip(route, zero_padded(array), tmp_path / str(n))
        outcomes[outcome] += 1
        if outcome == "refused":
            refused.append(label)
    # Only arrays of Python objects are refused: npz2mmap never unpickles.
    assert all("|O" in label or ">O" in label or "<O" in label for label in refused), refused
    assert outcomes["refused"] == sum(a.dtype.hasobject for _, a in numpy_arrays())
    assert outcomes["accepted"] > 100


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=nested_dtypes(), route=st.sampled_from(ROUTES), data=st.data())
def test_any_dtype_is_refused_clearly_or_read_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, dtype: np.dtype, route: str, data: st.DataObject
) -> None:
    shape = data.draw(st.sampled_from([(), (0,), (3,), (2, 2)]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    array = zero_padded(raw.view(dtype).reshape(shape)) if raw.size else np.zeros(shape, dtype)
    assert round_trip(route, array, tmp_path_factory.mktemp("dtype")) == "accepted"


@settings(max_examples=200, deadline=None)
@given(dtype=nested_dtypes(depth=4))
def test_any_stored_dtype_survives_its_json_descr(dtype: np.dtype) -> None:
    """What the converter would store, the index parser reads back as the same dtype, or refuses
    at conversion for the reason it gives at reading."""
    little = dtype.newbyteorder("<")
    problem = dtype_nesting_problem(little)
    text = json.loads(json.dumps(dtype_to_json(little)))
    if problem is None:
        assert dtype_from_json(text, "test") == little
    else:
        with pytest.raises(FormatError, match=f"^test: dtype {problem}$"):
            dtype_from_json(text, "test")
