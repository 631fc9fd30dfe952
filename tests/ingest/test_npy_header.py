""".npy headers: ours accepts exactly what np.load accepts (numpy is the oracle), never evaluating code.

The one deliberate difference: a dtype of no size ('V0', 'S0'), which np.load
reads but a dataset cannot store, is refused.
"""

from __future__ import annotations

import io
import math
import re
import tempfile
import warnings
from pathlib import Path

import hostile
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SKIP_BAD_HINT, write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap.cli.commands import cli
from npz2mmap.errors import SourceError
from npz2mmap.ingest.npy_header import MemberHeader
from npz2mmap.ingest.sources import read_headers
from npz2mmap.read.reader import DatasetReader

SUPPLY_MAX_NBYTES = 1 << 20
DATA_SIZE_REFUSAL = "header declares"


def numpy_probe(npy: bytes) -> tuple[tuple, np.dtype] | None:
    """Shape and dtype as numpy's public header reader sees them (no size checks), or None.

    There is no public reader for version 3.0; the 2.0 one reads its text
    (as latin-1, and forgiving Python 2 longs, which 3.0 is not).
    """
    stream = io.BytesIO(npy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            version = np.lib.format.read_magic(stream)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(stream)
    except Exception:  # whatever numpy's reader raises, it refused
        return None
    return shape, dtype


def numpy_verdict(header: bytes, directory: Path) -> tuple[str, np.ndarray | None]:
    """What numpy says of a .npy file with this header followed by the data it declares.

    'accepts' (with the array np.load returned) or 'refuses'; for data too
    large to supply, 'representable' if numpy's own constructor accepts the
    shape, or 'unknown' for a subarray dtype or a version 3.0 header, whose
    fate only np.load knows.
    """
    probe = numpy_probe(header)
    data = b""
    if probe is not None:
        shape, dtype = probe
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > SUPPLY_MAX_NBYTES:
            if dtype.hasobject:  # np.load(allow_pickle=False) refuses these before any data
                return "refuses", None
            try:
                np.ndarray(shape, dtype, buffer=bytearray(max(dtype.itemsize, 1)), strides=(0,) * len(shape))
            except Exception:
                return "refuses", None
            known = dtype.subdtype is None and header[6:8] != b"\x03\x00"
            return ("representable" if known else "unknown"), None
        data = bytes(max(nbytes, 0))
    path = directory / "oracle.npy"
    path.write_bytes(header + data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            array = np.load(path, allow_pickle=False)
    except Exception:  # np.load raises many types; any of them is a refusal
        return "refuses", None
    if probe is not None and min(probe[0], default=0) < 0:
        return "refuses", None  # numpy 2.1 reads shape (-1,) as "whatever follows": no array it declares
    return "accepts", array


def our_verdict(header: bytes, data_nbytes: int, directory: Path) -> MemberHeader | SourceError:
    path = hostile.zip_with(directory / "ours.npz", {"x.npy": header + bytes(data_nbytes)})
    try:
        return read_headers(str(path))["x"]
    except SourceError as exc:
        return exc


def assert_agrees_with_numpy(header: bytes, directory: Path) -> None:
    verdict, array = numpy_verdict(header, directory)
    supplied = array.nbytes if array is not None else 0
    ours = our_verdict(header, supplied, directory)
    if verdict == "accepts":
        assert array is not None
        if array.dtype.itemsize == 0:
            assert isinstance(ours, SourceError) and "has no size" in str(ours)
            return
        assert isinstance(ours, MemberHeader), f"numpy accepts, we refuse: {ours}"
        assert (ours.dtype, ours.shape, ours.nbytes) == (array.dtype, array.shape, array.nbytes)
    elif verdict == "refuses":
        assert isinstance(ours, SourceError), f"numpy refuses, we accept: {ours}"
        assert DATA_SIZE_REFUSAL not in str(ours), f"numpy refuses the header, we refuse the data: {ours}"
    elif verdict == "representable":
        assert isinstance(ours, SourceError) and DATA_SIZE_REFUSAL in str(ours), ours
    else:
        assert isinstance(ours, SourceError)


def npy(text: str, version: tuple[int, int] = (1, 0)) -> bytes:
    return hostile.npy_with_header(text, version=version)


def header_dict(descr: str = "'<f8'", shape: str = "(3,)", fortran: str = "False") -> str:
    return f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}"


HEADERS = {
    "valid": npy(header_dict()),
    "valid-2.0": npy(header_dict(), (2, 0)),
    "valid-3.0": npy(header_dict(), (3, 0)),
    "unicode-field-3.0": npy(header_dict("[('größe', '<i4')]"), (3, 0)),
    "py2-longs": npy(header_dict("'<i8'", "(3L, 4L)")),
    "py2-longs-2.0": npy(header_dict("'<i8'", "(3L, 4L)"), (2, 0)),
    "py2-longs-3.0": npy(header_dict("'<i8'", "(3L, 4L)"), (3, 0)),
    "py2-long-spaced": npy(header_dict("'<i8'", "(3 L,)")),
    "py2-long-lowercase": npy(header_dict("'<i8'", "(3l,)")),
    "py2-long-after-dict": npy(header_dict() + "L"),
    "py2-long-in-subarray": npy(header_dict("('<f8', (1L,))")),
    "py2-name-l": npy(header_dict("'<f8'", "(3, L)")),
    "subarray": npy(header_dict("('<f8', (2,))")),
    "subarray-of-one": npy(header_dict("('<f8', (1,))")),
    "subarray-of-one-2d": npy(header_dict("('<f8', (1, 1))", "(2, 2)")),
    "subarray-empty-shape": npy(header_dict("('<f8', ())")),
    "subarray-no-items": npy(header_dict("('<f8', (2,))", "(0, 5)")),
    "subarray-64d-no-items": npy(header_dict(f"('<f8', {(1,) * 64})", "(0,)")),
    "subarray-of-zero": npy(header_dict("('<f8', (0,))")),
    "subarray-of-zero-no-items": npy(header_dict("('<f8', (0,))", "(0,)")),
    "nested-subarray": npy(header_dict("(('<f8', (1,)), (1,))")),
    "nested-subarray-of-two": npy(header_dict("(('<f8', (2,)), (1,))")),
    "nested-subarray-no-items": npy(header_dict("(('<f8', (1,)), (0,))", "(0,)")),
    "record-with-subarray": npy(header_dict("[('a', '<f8', (2,))]")),
    "record-with-padding": npy(header_dict("[('a', '<f8'), ('', '|V4')]")),
    "odd-spacing": npy("{ 'descr' :'<f8' ,'fortran_order':False,\t'shape':( 3 , ) }   "),
    "no-spaces": npy("{'descr':'<f8','fortran_order':False,'shape':(3,)}"),
    "comment": npy(header_dict() + " # saved by hand"),
    "trailing-garbage": npy(header_dict() + " junk"),
    "duplicate-key": npy("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), 'descr': '<i4'}"),
    "missing-key": npy("{'descr': '<f8', 'shape': (3,)}"),
    "extra-key": npy("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), 'x': 1}"),
    "not-a-dict": npy("['<f8', False, (3,)]"),
    "fortran-int": npy(header_dict(fortran="0")),
    "fortran-true-2d": npy(header_dict(shape="(2, 3)", fortran="True")),
    "shape-list": npy(header_dict(shape="[3]")),
    "shape-bool": npy(header_dict(shape="(True, 3)")),
    "shape-negative": npy(header_dict(shape="(-1,)")),
    "shape-float": npy(header_dict(shape="(3.0,)")),
    "shape-hex": npy(header_dict(shape="(0x10,)")),
    "shape-underscore": npy(header_dict(shape="(1_0,)")),
    "shape-unary-plus": npy(header_dict(shape="(+3,)")),
    "shape-expression": npy(header_dict(shape="(2**63,)")),
    "shape-2**63": npy(header_dict(shape=f"(0, {2**63})")),
    "shape-2**63-1": npy(header_dict(shape=f"(0, {2**63 - 1})")),
    "shape-2**64": npy(header_dict(shape=f"({2**64}, 0)")),
    "shape-2**62-squared": npy(header_dict(shape=f"({2**62}, {2**62}, 0)")),
    "shape-2**31-squared": npy(header_dict(shape=f"({2**31}, {2**31}, 0)")),
    "shape-largest-zero-size": npy(header_dict(shape=f"({(2**63 - 1) // 8}, 0)")),
    "shape-one-past-largest": npy(header_dict(shape=f"({(2**63 - 1) // 8 + 1}, 0)")),
    "shape-wraps-int64": npy(header_dict("'|u1'", f"({2**62}, 2)")),
    "shape-huge-int": npy(header_dict(shape="(" + "9" * 4000 + ",)")),
    "shape-too-many-digits": npy(header_dict(shape="(" + "9" * 5000 + ",)")),
    "shape-1-TiB": npy(header_dict("'|u1'", f"({1 << 40},)")),
    "64-dims": npy(header_dict(shape=repr((1,) * 64))),
    "65-dims": npy(header_dict(shape=repr((1,) * 65))),
    "deep-parens": npy(header_dict(shape="(" * 150 + ")" * 150)),
    "deeper-parens": npy(header_dict(shape="(" * 300 + ")" * 300)),
    "deep-descr": npy(header_dict("[" * 150 + "]" * 150)),
    "deep-unary": npy(header_dict(shape="(" + "-" * 3000 + "3,)")),
    "code": npy(header_dict("__import__('os').system('touch pwned')")),
    "code-py2": npy(header_dict("__import__('os').system('touch pwned')", "(3L,)")),
    "lambda": npy(header_dict("(lambda: 1)()")),
    "object": npy(header_dict("'O'")),
    "stringdtype": npy(header_dict("'T'")),
    "record-of-objects": npy(header_dict("[('a', 'O')]")),
    "deprecated-alias": npy(header_dict("'a5'")),
    "bad-descr": npy(header_dict("'xyz'")),
    "descr-int": npy(header_dict("5")),
    "descr-dict": npy(header_dict("{'ab': 1}")),
    "descr-huge-subarray": npy(header_dict(f"('<f8', ({2**40},))")),
    "zero-size-void": npy(header_dict("'|V0'")),
    "zero-size-bytes": npy(header_dict("'|S0'")),
    "big-endian": npy(header_dict("'>i4'", "(2, 2)")),
    "datetime": npy(header_dict("'<M8[D]'")),
    "too-long": npy(header_dict() + " " * 10_000),
    "not-latin1-in-3.0": b"\x93NUMPY\x03\x00\x04\x00\x00\x00\xff\xfe{}",
    "version-4.0": b"\x93NUMPY\x04\x00" + npy(header_dict())[8:],
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_our_header_parser_accepts_exactly_what_numpy_accepts(tmp_path, monkeypatch, case) -> None:
    monkeypatch.chdir(tmp_path)
    assert_agrees_with_numpy(HEADERS[case], tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_the_oracle_itself_accepts_py2_longs_and_refuses_subarrays(tmp_path) -> None:
    """Pin what the comparison above relies on, so a numpy change shows up here."""
    assert numpy_verdict(HEADERS["py2-longs"], tmp_path)[0] == "accepts"
    assert numpy_verdict(HEADERS["subarray"], tmp_path)[0] == "refuses"
    assert numpy_verdict(HEADERS["shape-1-TiB"], tmp_path)[0] == "representable"
    assert numpy_verdict(HEADERS["shape-2**62-squared"], tmp_path)[0] == "refuses"


# --- random headers --------------------------------------------------------------


def mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` nine times in ten, so most headers get far enough to test the size rules."""
    return st.integers(0, 9).flatmap(lambda n: rare if n == 0 else usual)


VALID_DESCRS = ["<f8", "|u1", ">i4", "<U3", "|S2", "|b1", "<M8[s]", "|V4", "f8", "a5", "<c8"]
BAD_DESCRS = ["O", "<V0", "|S0", "T", "xyz", "<f8 "]
small_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
field_names = st.sampled_from(["a", "b", ""])
descrs = mostly(
    st.recursive(
        st.sampled_from(VALID_DESCRS),
        lambda inner: st.one_of(
            st.tuples(inner, small_shapes),
            st.lists(
                st.tuples(field_names, inner) | st.tuples(field_names, inner, small_shapes),
                min_size=1,
                max_size=3,
            ),
        ),
        max_leaves=4,
    ),
    st.sampled_from(BAD_DESCRS) | st.none() | st.integers(),
)
dims = mostly(
    st.integers(0, 4),
    st.sampled_from([2**31, 2**32, 2**59, 2**60, 2**61, 2**62, 2**63 - 1, 2**63, 2**64, -1, 1 << 40])
    | st.integers(-(2**70), 2**70)
    | st.booleans(),
)
shapes = mostly(
    st.lists(dims, max_size=4).map(tuple),
    st.lists(st.just(1), min_size=62, max_size=66).map(tuple) | st.lists(dims, max_size=2),
)


@st.composite
def header_texts(draw: st.DrawFn) -> bytes:
    fortran = draw(mostly(st.booleans(), st.sampled_from([0, 1, None])))
    header = {"descr": draw(descrs), "fortran_order": fortran, "shape": draw(shapes)}
    if draw(st.integers(0, 19)) == 0:
        header.pop(draw(st.sampled_from(sorted(header))))
    text = repr(header)
    if draw(st.integers(0, 3)) == 0:
        text = re.sub(r"(?<![\w.'])(\d+)(?=[,)\]])", r"\1L", text)  # Python 2 longs
    text = text.replace(", ", draw(st.sampled_from([", ", ",", " ,  ", ",\t"])))
    text += draw(mostly(st.sampled_from(["", " ", "  \n", " #c"]), st.sampled_from([" junk", "L", ","])))
    return npy(text, draw(st.sampled_from([(1, 0), (2, 0), (3, 0)])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=header_texts())
def test_random_headers_agree_with_numpy_and_raise_only_source_error(header) -> None:
    with tempfile.TemporaryDirectory() as directory:
        assert_agrees_with_numpy(header, Path(directory))


# --- through the CLI ---------------------------------------------------------------


def test_python2_long_ints_in_a_header_convert_as_numpy_reads_them(tmp_path) -> None:
    data = np.arange(12, dtype="<i8")
    member = hostile.npy_with_header(header_dict("'<i8'", "(3L, 4L)"), data.tobytes())
    hostile.zip_with(tmp_path / "src" / "a.npz", {"x.npy": member})
    write_npz(tmp_path / "src" / "b.npz", x=np.ones((3, 4), "<i8"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = np.load(tmp_path / "src" / "a.npz")["x"]
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    stored = DatasetReader(tmp_path / "out").column("x")
    assert stored[0].dtype == expected.dtype and stored[0].tobytes() == expected.tobytes()
    assert (stored[1] == 1).all()


def test_a_subarray_descr_is_refused_as_numpy_refuses_it(tmp_path) -> None:
    member = hostile.npy_with_header(header_dict("('<f8', (2,))"), bytes(48))
    bad = hostile.zip_with(tmp_path / "src" / "bad.npz", {"x.npy": member})
    before = bad.read_bytes()
    with pytest.raises(ValueError):
        np.load(bad)["x"]
    result = CliRunner().invoke(cli, ["convert", str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"Error: {bad}[x]: .npy header descr ('<f8', (2,)) is a subarray dtype with 3 items of shape (2,), "
        "which np.load cannot read" + SKIP_BAD_HINT
    ]
    assert not (tmp_path / "out").exists() and bad.read_bytes() == before
