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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import nested_dtypes

from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError, Npz2mmapError
from npz2mmap.format.dtypes import dtype_from_json, dtype_nesting_problem, dtype_to_json
from npz2mmap.ingest.npy_header import MAX_HEADER_SIZE_LIMIT
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert
from npz2mmap.write.writer import Writer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)  # its marks are numpy's own
    test_format = importlib.import_module("numpy.lib.tests.test_format")

NPY_KEY = "arr_0"  # the one field of a plain .npy file
LARGE_HEADER = "large header: "  # labels the arrays whose .npy header exceeds np.load's default limit
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
    # The arrays numpy's other tests build in their bodies, built as they build them.
    yield "test_long_str", np.ones(1, dtype=np.dtype((str, test_format.format.BUFFER_SIZE + 1)))
    yield (
        "test_unicode_field_names",
        np.ones(4, dtype=[("int", int), ("\N{CJK UNIFIED IDEOGRAPH-6574}", int)]),
    )
    yield "test_header_growth_axis", np.ones((3, 2), dtype=[(" " * 23, int)])
    yield LARGE_HEADER + "test_version_2_0", np.ones(1000, dtype=[(f"{i}" * 100, float) for i in range(500)])
    yield LARGE_HEADER + "test_huge_header", np.array(1, dtype="i," * 10000 + "i")


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


def save_all(route: str, arrays: dict[str, np.ndarray], src_dir: Path) -> Path:
    """One source holding every array under its key: an NPZ file, or a directory of KEY.npy files
    (one sample, ``--sample-dirs``), or for one array under "arr_0" a plain .npy file."""
    src_dir.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # np.save warns of metadata it drops and of format 2.0 and 3.0
        if route == "npz":
            np.savez(src_dir / "s.npz", **arrays)
            return src_dir / "s.npz"
        if list(arrays) == [NPY_KEY]:
            np.save(src_dir / "s.npy", arrays[NPY_KEY])
            return src_dir / "s.npy"
        (src_dir / "s").mkdir()
        for key, array in arrays.items():
            np.save(src_dir / "s" / f"{key}.npy", array)
        return src_dir / "s"


def load_all(path: Path) -> dict[str, np.ndarray]:
    """Every source array as np.load reads it, by key."""
    limit = MAX_HEADER_SIZE_LIMIT
    if path.is_dir():
        return {p.stem: np.load(p, max_header_size=limit) for p in sorted(path.glob("*.npy"))}
    if path.suffix == ".npy":
        return {NPY_KEY: np.load(path, max_header_size=limit)}
    with np.load(path, max_header_size=limit) as npz:
        return {key: npz[key] for key in npz.files}


def build(
    route: str, arrays: dict[str, np.ndarray], root: Path, max_header_size: int | None = None
) -> tuple[Path, dict[str, np.ndarray]]:
    """Convert ``arrays`` (one sample) one way; the dataset and numpy's view of the sources, by key."""
    out = root / "out"
    if route == "writer":
        with Writer(out) as w:
            w.append(arrays)
        return out, arrays
    path = save_all(route, arrays, root / "src")
    convert([path], out, workers=1, max_header_size=max_header_size, sample_dirs=path.is_dir())
    return out, load_all(path)


def check_opens_and_reads_back(
    out: Path, sources: dict[str, np.ndarray], max_header_size: int | None
) -> None:
    """Every reader opens the dataset, and its sample holds exactly ``expected_bytes`` of each source."""
    from npz2mmap.pytorch.dataset import MmapDataset

    reader = DatasetReader(out)
    sample = MmapDataset(out)[0]
    assert sorted(sample) == sorted(sources)
    for key, source in sources.items():
        view = reader.view(key, 0)
        assert (view.dtype, view.shape) == (source.dtype.newbyteorder("<"), source.shape), key
        assert np.ascontiguousarray(view).tobytes() == expected_bytes(source), key
        assert np.ascontiguousarray(sample[key]).tobytes() == expected_bytes(source), key
    for args in (["inspect"], ["inspect", "--json"], ["inspect", "--sample", "0"]):
        result = CliRunner().invoke(cli, [*args, str(out)])
        assert result.exit_code == 0, result.output
    report = verify(out, sources=True, max_header_size=max_header_size)
    assert report.ok, report.problems


def round_trip(
    route: str, arrays: dict[str, np.ndarray], root: Path, max_header_size: int | None = None
) -> str:
    """'accepted' when ``arrays`` convert and read back exactly; when conversion refuses them, the
    one-line error, which names the source and the key."""
    try:
        out, sources = build(route, arrays, root, max_header_size)
    except Npz2mmapError as exc:
        message = str(exc)
        assert "\n" not in message
        assert ("sample 0" if route == "writer" else str(root / "src")) in message
        assert any(f"[{key}]" in message for key in arrays) or route == "npy"
        assert not (root / "out").exists()
        return message
    check_opens_and_reads_back(out, sources, max_header_size)
    return "accepted"


def expected_refusal(label: str, array: np.ndarray, route: str) -> str | None:
    """Why conversion refuses one of numpy's arrays (by default), or None."""
    if array.dtype.hasobject:
        return "holds pickled Python objects" if route != "writer" else "holds Python objects"
    if label.startswith(LARGE_HEADER) and route != "writer":
        return "exceeds the limit of 10,000 (np.load's default); pass max_header_size="
    return None


@pytest.mark.parametrize("route", ROUTES)
def test_numpy_format_arrays_are_refused_clearly_or_read_back_exactly(tmp_path: Path, route: str) -> None:
    """Refused are only arrays of Python objects (npz2mmap never unpickles) and, by default, headers
    longer than np.load reads by default, which convert with max_header_size as with np.load.

    The arrays that convert go together, each under its own key of one sample; each refused
    one is converted alone (a plain .npy file on the npy route), so its own message is seen.
    """
    arrays = {f"a{n:03d}": (label, zero_padded(a)) for n, (label, a) in enumerate(numpy_arrays())}
    together = {k: a for k, (label, a) in arrays.items() if expected_refusal(label, a, route) is None}
    assert round_trip(route, together, tmp_path / "together") == "accepted"
    refused = 0
    for k, (label, array) in arrays.items():
        reason = expected_refusal(label, array, route)
        if reason is None:
            continue
        alone = {NPY_KEY if route == "npy" else k: array}
        assert reason in round_trip(route, alone, tmp_path / k), label
        if label.startswith(LARGE_HEADER):
            assert round_trip(route, alone, tmp_path / f"{k}-raised", MAX_HEADER_SIZE_LIMIT) == "accepted"
        refused += 1
    # Counted: 176 + 5 arrays; 12 of objects refused, and 2 large headers unless raised (not by Writer).
    assert (len(together), refused) == ((169, 12) if route == "writer" else (167, 14))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=nested_dtypes(), route=st.sampled_from(ROUTES), data=st.data())
def test_any_dtype_is_refused_clearly_or_read_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, dtype: np.dtype, route: str, data: st.DataObject
) -> None:
    shape = data.draw(st.sampled_from([(), (0,), (3,), (2, 2)]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    array = zero_padded(raw.view(dtype).reshape(shape)) if raw.size else np.zeros(shape, dtype)
    arrays = {NPY_KEY if route == "npy" else "arr": array}
    assert round_trip(route, arrays, tmp_path_factory.mktemp("dtype"), MAX_HEADER_SIZE_LIMIT) == "accepted"


@settings(max_examples=100, deadline=None)
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
