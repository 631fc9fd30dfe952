"""npz2mmap.Writer: a dataset written from Python is byte for byte the dataset convert writes.

The main oracle appends, for each NPZ file of a random corpus, its arrays
(read raw, so record padding survives; np.load drops it) with ``source`` set
to the file, and compares every file of the result with ``convert`` of the
same files. The rest pins refusals, atomicity, the lock, kill -9, memory and
parts.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import inspect
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT, SKIP_BAD_HINT, TESTS_DIR, RunSize, sized, write_npz, write_samples
from corpus import Corpus, Options, corpora, load_raw, options_for, write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from interrupts import Interrupt, left_beside, lock_is_free, moments, sigint_blocked

import npz2mmap
from npz2mmap import fsutil, parallel
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import OutputError, SourceError
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import spools, writer
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge
from npz2mmap.write.options import part_from_environment

ROOT = REPO_ROOT


def run_script(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``script`` run by a new Python with ``args``, this checkout importable; its output captured."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=600,
    )


def dataset_files(path: Path) -> dict[str, bytes]:
    return {entry.name: entry.read_bytes() for entry in sorted(path.iterdir())}


def keys_of(path: Path) -> list[str]:
    """The keys of a corpus source: an NPZ file's members, a sample directory's files, a .npy file's arr_0."""
    if path.is_dir():
        return sorted(entry.name.removesuffix(".npy") for entry in path.iterdir())
    if path.suffix == ".npy":
        return ["arr_0"]
    with zipfile.ZipFile(path) as zf:
        return sorted(name.removesuffix(".npy") for name in zf.namelist())


def write_from_files(out: Path, paths: list[Path], keys: list[str] | None = None, **options) -> Path:
    """Append every file's arrays, read raw, with the file as its source."""
    with npz2mmap.Writer(out, **options) as w:
        for path in paths:
            w.append({key: load_raw(path, key) for key in keys or keys_of(path)}, source=str(path))
    return Path(w.out_dir)


# --- the oracle: byte-identical to convert -------------------------------------------


@st.composite
def file_cases(draw: st.DrawFn) -> tuple[Corpus, Options]:
    """Corpora of one sample per file, every file good (the Writer has no --rows or --skip-bad)."""
    corpus = draw(corpora().filter(lambda c: not c.rows))
    corpus.scan_bad, corpus.copy_bad = [], []
    return corpus, draw(options_for(corpus))


def test_writer_writes_the_bytes_convert_writes_for_any_corpus(tmp_path_factory, run_size) -> None:
    """150 cases drawn the same way each run; 1,500 drawn anew in the long run."""

    @sized(run_size, 150, 1500)
    @given(case=file_cases())
    def check(case: tuple[Corpus, Options]) -> None:
        writer_matches_convert(tmp_path_factory, case)

    check()


def writer_matches_convert(tmp_path_factory: pytest.TempPathFactory, case: tuple[Corpus, Options]) -> None:
    corpus, options = case
    root = tmp_path_factory.mktemp("writer-oracle")
    paths = [path for path, _ in write_corpus(corpus, root / "src").files]
    convert(
        paths,
        root / "converted",
        keys=options.keys,
        casts=options.casts,
        align=options.align,
        workers=1,
        sample_dirs=corpus.layout == "sample-dirs",
    )
    written = write_from_files(
        root / "written", paths, options.keys, casts=options.casts, align=options.align
    )
    assert dataset_files(written) == dataset_files(root / "converted")


def test_writer_matches_convert_on_every_layout_np_load_reads_back(tmp_path) -> None:
    """The brief's own oracle, with np.load: big-endian, Fortran order, 0-d, empty, ragged, cast, align."""
    rng = np.random.default_rng(3)
    samples = [
        {
            "image": np.asfortranarray(rng.random((3, 4)).astype(">f4")),
            "tokens": np.arange(i % 3 * 2, dtype=">i8"),  # ragged, the first one empty
            "label": np.int16(i),
            "name": np.array(f"s{i}", dtype=">U3"),
            "empty": np.zeros((0, 2), dtype=np.uint8),
            "wide": np.float64(i / 4),
        }
        for i in range(5)
    ]
    paths = write_samples(tmp_path / "src", samples, compressed=True)
    casts = {"label": "int32", "wide": "float32"}
    convert(paths, tmp_path / "converted", casts=casts, align=4096, workers=1)
    with npz2mmap.Writer(tmp_path / "written", casts=casts, align=4096) as w:
        for path in paths:
            with np.load(path) as npz:
                w.append({key: npz[key] for key in npz.files}, source=str(path))
    assert dataset_files(tmp_path / "written") == dataset_files(tmp_path / "converted")
    assert verify(tmp_path / "written", sources=True).ok


def test_record_padding_is_stored_as_it_is_in_memory(tmp_path) -> None:
    dtype = np.dtype({"names": ["a", "b"], "formats": ["u1", ">i4"], "offsets": [0, 4], "itemsize": 12})
    records = np.frombuffer(bytes(range(1, 25)), dtype=dtype)
    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"r": records})
        w.append({"r": records[::-1]})  # not contiguous: copied item by item
    reader = DatasetReader(tmp_path / "out")
    stored = [reader.view("r", i).tobytes() for i in range(2)]
    swapped = [
        bytes([*b[:4], b[7], b[6], b[5], b[4], *b[8:]]) for b in (bytes(range(1, 13)), bytes(range(13, 25)))
    ]
    assert stored == [swapped[0] + swapped[1], swapped[1] + swapped[0]]


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype("f4", metadata={"unit": "m"}),  # np.save drops metadata, with a warning
        np.dtype([(("a title", "a"), "<i4"), ("b", ">f8")]),
        np.dtype([("a", "u1"), ("b", "<i8")], align=True),
        np.dtype([("a", "<i2", (2, 3)), ("b", [("x", ">u2"), ("y", ">c8")])]),
    ],
)
def test_dtypes_np_save_rewrites_are_stored_as_convert_stores_them(tmp_path, dtype) -> None:
    value = np.frombuffer(np.random.default_rng(1).bytes(3 * dtype.itemsize), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = write_npz(tmp_path / "a.npz", x=value)
    convert([path], tmp_path / "converted", workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the writer says nothing
        with npz2mmap.Writer(tmp_path / "written") as w:
            w.append({"x": value}, source=str(path))
    assert dataset_files(tmp_path / "written") == dataset_files(tmp_path / "converted")


def test_python_scalars_and_lists_go_through_np_asarray(tmp_path) -> None:
    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"x": [1.5, 2.5], "n": 3, "s": "ab"})
    reader = DatasetReader(tmp_path / "out")
    for key, value in {"x": [1.5, 2.5], "n": 3, "s": "ab"}.items():
        expected = np.asarray(value)
        assert reader.view(key, 0).dtype == expected.dtype.newbyteorder("<")
        assert reader.view(key, 0).tobytes() == expected.tobytes()


# --- refusals: one line, naming the sample, the writer unchanged -------------------


@pytest.fixture
def opened(tmp_path):
    w = npz2mmap.Writer(tmp_path / "out", casts={"y": "float32"})
    w.append({"x": np.zeros(3, np.float32), "y": np.float64(1)}, source="a.npz")
    yield w
    w.abort()


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        (
            {"x": np.zeros(3), "y": 1.0},
            "sample 1 (b.npz)[x]: dtype float64 differs from float32 in sample 0 (a.npz); "
            "pass casts={'x': 'float64'} to store one dtype",
        ),
        (
            {"x": np.zeros((3, 1), np.float32), "y": 1.0},
            "sample 1 (b.npz)[x]: 2-d array (3, 1) differs from the 1-d arrays in sample 0 (a.npz)",
        ),
        (
            {"x": np.zeros(3, np.float32), "y": 1.0, "z": 1},
            "sample 1 (b.npz): keys differ from sample 0 (a.npz) (extra 'z')",
        ),
        (
            {"x": np.zeros(3, np.float32), "y": 0.1},
            "sample 1 (b.npz)[y]: value 0.1 does not survive the cast to float32: it would be stored as "
            "0.10000000149011612 (casts= keeps only values that float32 represents exactly)",
        ),
        (
            {"x": np.array([1, "a"], dtype=object), "y": 1.0},
            "sample 1 (b.npz)[x]: dtype object holds Python objects, which a dataset cannot store; "
            "make it a numeric or fixed-width string array",
        ),
        (
            {"x": np.zeros(3, np.float32), "y": np.zeros(0, "V0")},
            "sample 1 (b.npz)[y]: dtype |V0 has no size",
        ),
    ],
)
def test_a_refused_sample_is_named_in_one_line(opened, sample, message) -> None:
    with pytest.raises(SourceError) as raised:
        opened.append(sample, source="b.npz")
    assert str(raised.value) == message


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=8), seed=st.integers(0, 7))
def test_a_cast_refused_by_the_writer_speaks_of_casts_not_of_the_cli(tmp_path_factory, values, seed) -> None:
    """Whatever value a cast loses, the Writer's message names its own argument, never a CLI option."""
    x = np.array(values, np.float64)
    with np.errstate(over="ignore"):
        exact = np.array_equal(x.astype(np.float32).astype(np.float64), x)
    if exact:
        x[seed % len(x)] = 0.1  # one value float32 cannot hold
    with npz2mmap.Writer(tmp_path_factory.mktemp("cast") / "out", casts={"x": "float32"}) as w:
        w.append({"x": np.zeros(1, np.float32)})
        with pytest.raises(SourceError) as raised:
            w.append({"x": x}, source="b.npz")
        assert w.num_samples == 1
    message = str(raised.value)
    assert message.startswith("sample 1 (b.npz)[x]: ")
    assert message.endswith("(casts= keeps only values that float32 represents exactly)")
    assert "--" not in message and "\n" not in message


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_tensor_that_requires_grad_is_refused_naming_the_field_and_detach(tmp_path, requires_grad) -> None:
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_(requires_grad)
    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"x": np.zeros((2, 3), np.float32)})
        if requires_grad:
            with pytest.raises(SourceError) as raised:
                w.append({"x": x}, source="b.pt")
            assert str(raised.value) == (
                "sample 1 (b.pt)[x]: a tensor that requires grad; append tensor.detach() to store its values"
            )
            assert w.num_samples == 1
            x = x.detach()
        w.append({"x": x})
    assert DatasetReader(tmp_path / "out").view("x", 1).tobytes() == x.numpy().tobytes()


def test_a_first_sample_without_arrays_is_refused(tmp_path) -> None:
    w = npz2mmap.Writer(tmp_path / "out")
    with pytest.raises(SourceError, match=r"^sample 0: holds no arrays$"):
        w.append({})
    w.append({"x": 1})
    w.close()
    assert len(DatasetReader(tmp_path / "out")) == 1


def test_what_is_not_a_sample_is_a_type_error(opened) -> None:
    with pytest.raises(TypeError, match="^a sample is a dict of field name to array, not list$"):
        opened.append([np.zeros(3, np.float32), 1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^field names are str, not int \(1\)$"):
        opened.append({1: np.zeros(3)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="^source must be a str or a path, not bytes$"):
        opened.append({"x": np.zeros(3, np.float32), "y": 1.0}, source=b"a")  # type: ignore[arg-type]


def test_a_field_name_that_is_not_text_is_refused(opened) -> None:
    with pytest.raises(
        SourceError, match=r"^sample 1: field name '\\udc80' is not valid text \(it holds a lone surrogate\)$"
    ):
        opened.append({"\udc80": 1})


def test_a_source_name_too_long_for_sources_jsonl_is_refused(opened) -> None:
    with pytest.raises(
        SourceError,
        match=r"^sample 1: its source name takes 70,003 bytes in sources.jsonl, more than the 65,536 a line may hold$",
    ):
        opened.append({"x": np.zeros(3, np.float32), "y": 1.0}, source="x" * 70_000)


def test_a_sample_refused_halfway_leaves_the_writer_as_it_was(tmp_path) -> None:
    """Field "a" is spooled before "b" fails its cast: "a"'s bytes must go, nothing else changes."""
    good = [{"a": np.arange(4, dtype=np.int16) * i, "b": np.float64(i)} for i in range(3)]
    paths = write_samples(tmp_path / "src", good)
    with npz2mmap.Writer(tmp_path / "written", casts={"b": "float32"}) as w:
        w.append(good[0], source=str(paths[0]))
        big = np.arange(3_000_000, dtype=np.int16)  # more than a spool buffer: part of it reaches the file
        for bad in ({"a": big, "b": np.float64(0.1)}, {"a": big}, {"a": big.astype(np.int64), "b": 1.0}):
            with pytest.raises(SourceError):
                w.append(bad, source="bad.npz")
        assert w.num_samples == 1
        for path, sample in zip(paths[1:], good[1:], strict=True):
            w.append(sample, source=str(path))
    convert(paths, tmp_path / "converted", casts={"b": "float32"}, workers=1)
    assert dataset_files(tmp_path / "written") == dataset_files(tmp_path / "converted")


def test_a_full_disk_while_appending_is_an_output_error_and_the_writer_stays_usable(
    tmp_path, monkeypatch
) -> None:
    real_write_all_at = fsutil.write_all_at

    def full_disk(fd: int, data: object, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"x": np.arange(3)})
        monkeypatch.setattr(fsutil, "write_all_at", full_disk)
        with pytest.raises(
            OutputError, match=r": cannot write the samples beside it \(No space left on device\)$"
        ):
            w.append({"x": np.arange(1 << 20)})  # more than a spool buffer: written at once
        monkeypatch.setattr(fsutil, "write_all_at", real_write_all_at)
        w.append({"x": np.arange(4)})
    assert [DatasetReader(tmp_path / "out").view("x", i).tolist() for i in range(2)] == [
        [0, 1, 2],
        [0, 1, 2, 3],
    ]


def test_an_empty_writer_writes_nothing_and_says_so(tmp_path) -> None:
    out = tmp_path / "out"
    w = npz2mmap.Writer(out)
    with pytest.raises(SourceError, match=f"^{out}: no sample was appended; a dataset needs at least one$"):
        w.close()
    assert os.listdir(tmp_path) == []


def test_append_after_close_raises(tmp_path) -> None:
    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"x": 1})
    with pytest.raises(ValueError, match="the Writer is closed"):
        w.append({"x": 2})
    w.close()  # closing again does nothing
    assert len(DatasetReader(tmp_path / "out")) == 1


def test_bad_options_are_refused_before_anything_is_made(tmp_path) -> None:
    with pytest.raises(ValueError, match="align must be a power of two"):
        npz2mmap.Writer(tmp_path / "out", align=100)
    with pytest.raises(ValueError, match="part 3/3 does not exist"):
        npz2mmap.Writer(tmp_path / "out", part=(3, 3))
    with pytest.raises(ValueError, match="is not a numpy dtype"):
        npz2mmap.Writer(tmp_path / "out", casts={"x": "nonsense"})
    with pytest.raises(SourceError, match=r"^sample 0: casts= names key\(s\) 'y' that are not converted$"):
        with npz2mmap.Writer(tmp_path / "out", casts={"y": "f4"}) as w:
            w.append({"x": 1})
    assert os.listdir(tmp_path) == []


# --- atomicity and the lock -------------------------------------------------------------


def test_an_exception_in_the_with_block_leaves_the_old_dataset_untouched(tmp_path) -> None:
    out = tmp_path / "out"
    with npz2mmap.Writer(out) as w:
        w.append({"x": np.arange(3)})
    before = dataset_files(out)
    with pytest.raises(KeyError), npz2mmap.Writer(out, overwrite=True) as w:
        w.append({"x": np.arange(5)})
        raise KeyError("user code fails")
    assert dataset_files(out) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_nothing_is_at_out_before_close_and_abort_removes_everything(tmp_path) -> None:
    out = tmp_path / "out"
    w = npz2mmap.Writer(out)
    w.append({"x": np.arange(3)})
    assert not out.exists()
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="the Writer is closed"):
        w.append({"x": np.arange(3)})


def test_a_writer_dropped_unclosed_is_discarded_but_not_by_a_forked_child(tmp_path) -> None:
    w = npz2mmap.Writer(tmp_path / "forked")
    w.append({"x": np.arange(3)})
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say, that lets its copy of the writer go
        del w
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    w.append({"x": np.arange(3)})
    w.close()
    assert len(DatasetReader(tmp_path / "forked")) == 2
    dropped = npz2mmap.Writer(tmp_path / "dropped")
    dropped.append({"x": np.arange(3)})
    del dropped
    gc.collect()
    assert sorted(os.listdir(tmp_path)) == ["forked"]


def test_overwrite_replaces_only_at_close_and_existing_out_needs_it(tmp_path) -> None:
    out = tmp_path / "out"
    with npz2mmap.Writer(out) as w:
        w.append({"x": np.arange(3)})
    with pytest.raises(OutputError, match="already exists; pass --overwrite to replace it"):
        npz2mmap.Writer(out)
    with npz2mmap.Writer(out, overwrite=True) as w:
        w.append({"x": np.arange(4)})
        assert DatasetReader(out).view("x", 0).tolist() == [0, 1, 2]
    assert DatasetReader(out).view("x", 0).tolist() == [0, 1, 2, 3]


def test_the_lock_keeps_a_conversion_and_a_second_writer_out_until_close(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    out = tmp_path / "out"
    with npz2mmap.Writer(out) as w:
        w.append({"x": np.arange(3)})
        with pytest.raises(OutputError, match="another npz2mmap conversion or Writer is writing it"):
            convert([tmp_path / "src"], out, workers=1)
        with pytest.raises(OutputError, match="another npz2mmap conversion or Writer is writing it"):
            npz2mmap.Writer(out)
    convert([tmp_path / "src"], out, workers=1, overwrite=True)


KILLED_WRITER = """
import sys, time
import numpy as np
import npz2mmap
from npz2mmap import fsutil
from npz2mmap.write import publish

def pause(name, real):
    def paused(*args, **kwargs):
        print(name, flush=True)
        time.sleep(600)
        return real(*args, **kwargs)
    return paused

moment = sys.argv[2]
if moment == "copying":
    fsutil.copy_range = pause("copying", fsutil.copy_range)
if moment == "publishing":
    publish.publish = pause("publishing", publish.publish)
with npz2mmap.Writer(sys.argv[1], overwrite=True) as w:
    for i in range(50):
        w.append({"x": np.full(10_000, i), "t": np.arange(i)}, source=f"s{i}")
        if i == 30 and moment == "appending":
            print("appending", flush=True)
            time.sleep(600)
"""


@pytest.mark.parametrize("moment", ["appending", "copying", "publishing"])
@pytest.mark.parametrize("existing", [False, True])
def test_kill_9_leaves_no_dataset_and_the_next_writer_succeeds(tmp_path, moment, existing) -> None:
    out = tmp_path / "out"
    if existing:
        with npz2mmap.Writer(out) as w:
            w.append({"old": np.arange(2)})
    before = dataset_files(out) if existing else None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(out), moment], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == f"{moment}\n"
        assert any(p.name.startswith(".out.npz2mmap-tmp-") for p in tmp_path.iterdir())
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    if existing:
        assert dataset_files(out) == before
    else:
        assert not out.exists()
    with npz2mmap.Writer(out, overwrite=True) as w:
        w.append({"x": np.arange(3)})
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert verify(out).ok


# --- bounded memory ------------------------------------------------------------------------

MEMORY_PROBE = """
import resource, sys
import numpy as np
import npz2mmap

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sample = np.empty((1024, 1024), dtype=np.float32)  # 4 MiB, refilled for each sample
with npz2mmap.Writer(sys.argv[1]) as w:
    for i in range(int(sys.argv[2])):
        sample.fill(i)
        w.append({"x": np.asfortranarray(sample) if i % 2 else sample, "n": np.arange(i % 100)})
print(before * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.parametrize("without", ["", "copy_file_range,pwrite,pread"])
def test_memory_stays_flat_however_much_is_appended(tmp_path, without) -> None:
    num_samples = 96  # 384 MiB of data
    result = run_script(
        MEMORY_PROBE, str(tmp_path / "out"), str(num_samples), env={fsutil.WITHOUT_ENV: without}
    )
    assert result.returncode == 0, result.stderr
    before, peak = map(int, result.stdout.split())
    data_nbytes = num_samples * (4 << 20)
    assert peak - before < 64 << 20, (
        f"peak RSS grew by {(peak - before) >> 20} MiB writing {data_nbytes >> 20} MiB"
    )
    reader = DatasetReader(tmp_path / "out")
    assert len(reader) == num_samples
    assert reader.view("x", 95)[3, 5] == 95 and reader.view("n", 95).tolist() == list(range(95))


def test_the_copy_without_copy_file_range_gives_the_same_bytes(tmp_path, monkeypatch) -> None:
    samples = [{"x": np.arange(i * 1000, dtype=np.float32), "y": np.int8(i)} for i in range(6)]

    def write(out: Path) -> dict[str, bytes]:
        with npz2mmap.Writer(out) as w:
            for sample in samples:
                w.append(sample)
        return dataset_files(out)

    expected = write(tmp_path / "kernel")
    monkeypatch.setattr(fsutil, "copy_file_range", None)
    assert write(tmp_path / "no-copy-file-range") == expected

    def unsupported(*args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(fsutil, "copy_file_range", unsupported)
    assert write(tmp_path / "refused") == expected


# --- parts -------------------------------------------------------------------------------------


@pytest.fixture
def sample_files(tmp_path) -> list[Path]:
    rng = np.random.default_rng(9)
    samples = [
        {"x": rng.random((2, 3), dtype=np.float32), "tokens": np.arange(i % 5, dtype=np.int16)}
        for i in range(11)
    ]
    return write_samples(tmp_path / "src", samples)


def test_parts_go_where_convert_part_puts_them_and_merge_into_one_writer_bytes(
    tmp_path, sample_files
) -> None:
    parts = tmp_path / "parts"
    for i in range(3):
        chunk = sample_files[len(sample_files) * i // 3 : len(sample_files) * (i + 1) // 3]
        written = write_from_files(parts, chunk, part=(i, 3))
        assert written == parts / f"part-{i:05d}"
    assert json.loads((parts / "part-00001" / "index.json").read_text())["provenance"]["part"] == [1, 3]
    converted = convert(sample_files, tmp_path / "converted", part=(1, 3), workers=1).out_dir
    assert converted == str(tmp_path / "converted" / "part-00001")
    assert dataset_files(parts / "part-00001") == dataset_files(Path(converted))
    merge(sorted(parts.iterdir()), tmp_path / "merged", copy=True)
    write_from_files(tmp_path / "single", sample_files)
    assert dataset_files(tmp_path / "merged") == dataset_files(tmp_path / "single")


def test_an_empty_part_is_the_empty_part_convert_writes(tmp_path, sample_files) -> None:
    npz2mmap.Writer(tmp_path / "parts" / "{part}-of-2", part=(0, 2)).close()
    convert(sample_files[:1], tmp_path / "converted-{part}", part=(0, 2), workers=1)
    assert dataset_files(tmp_path / "parts" / "00000-of-2") == dataset_files(tmp_path / "converted-00000")
    assert len(DatasetReader(tmp_path / "parts" / "00000-of-2")) == 0


RANK_WRITER = """
import os, sys
import numpy as np
import npz2mmap
from corpus import load_raw

paths = sys.argv[2:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with npz2mmap.Writer(sys.argv[1], part="auto") as w:
    for path in paths[len(paths) * rank // world : len(paths) * (rank + 1) // world]:
        w.append({key: load_raw(path, key) for key in ("tokens", "x")}, source=path)
"""


def test_two_processes_writing_parts_merge_into_the_bytes_of_one_writer(tmp_path, sample_files) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS_DIR)]), "WORLD_SIZE": "2"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_WRITER, str(tmp_path / "parts"), *map(str, sample_files)],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    parts = sorted((tmp_path / "parts").iterdir())
    assert [p.name for p in parts] == ["part-00000", "part-00001"]
    result = CliRunner().invoke(
        cli, ["merge", *map(str, parts), "-o", str(tmp_path / "merged"), "--copy", "-q"]
    )
    assert result.exit_code == 0, result.output
    write_from_files(tmp_path / "single", sample_files)
    assert dataset_files(tmp_path / "merged") == dataset_files(tmp_path / "single")
    convert(sample_files, tmp_path / "converted", workers=1)
    assert dataset_files(tmp_path / "merged") == dataset_files(tmp_path / "converted")


def test_part_auto_without_a_launcher_says_what_it_needs(tmp_path, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="--part auto needs RANK and WORLD_SIZE"):
        npz2mmap.Writer(tmp_path / "out", part="auto")


# --- the planner it shares with convert ---------------------------------------------------------


def test_convert_names_a_first_file_without_arrays(tmp_path) -> None:
    empty = tmp_path / "src" / "a.npz"
    empty.parent.mkdir()
    np.savez(empty)
    write_npz(tmp_path / "src" / "b.npz", x=np.arange(3))
    with pytest.raises(SourceError, match=f"^{empty}: holds no arrays{re.escape(SKIP_BAD_HINT)}$"):
        convert([tmp_path / "src"], tmp_path / "out", workers=1)


def test_the_writer_is_exported_without_importing_torch(tmp_path) -> None:
    code = "import sys\nsys.modules['torch'] = None\nimport npz2mmap\nprint(npz2mmap.Writer.__module__)"
    result = run_script(code)
    assert result.stdout == "npz2mmap.write.writer\n", result.stderr


def test_close_refuses_a_dataset_larger_than_the_free_space_and_writes_nothing(tmp_path, monkeypatch) -> None:
    """Every file counts: here sources.jsonl (long source names) is larger than the blob."""
    import re
    import shutil

    def write(out: Path) -> npz2mmap.Writer:
        w = npz2mmap.Writer(out)
        for i in range(50):
            w.append({"x": np.float32(i)}, source=f"{i:04d}" + "s" * 2000)
        return w

    write(tmp_path / "ref").close()
    files_nbytes = sum(entry.stat().st_size for entry in (tmp_path / "ref").iterdir())
    blob_nbytes = (tmp_path / "ref" / "data.npy").stat().st_size
    assert files_nbytes > 20 * blob_nbytes
    real_disk_usage = shutil.disk_usage
    w = write(tmp_path / "out")
    free = files_nbytes - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=free))
    with pytest.raises(OutputError) as raised:
        w.close()
    found = re.fullmatch(
        rf"{re.escape(str(tmp_path / 'out'))}: the dataset needs ([\d,]+) bytes \(.*\), "
        rf"{free:,} bytes \(.*\) free on its file system",
        str(raised.value),
    )
    assert found and files_nbytes <= int(found[1].replace(",", "")) <= files_nbytes + 4096
    assert sorted(os.listdir(tmp_path)) == ["ref"]  # no dataset, no staging or spool directory


def test_verify_sources_compares_named_sources_and_counts_samples_without_one(tmp_path) -> None:
    npz = write_npz(tmp_path / "a.npz", x=np.arange(3))
    with npz2mmap.Writer(tmp_path / "out") as w:
        w.append({"x": np.arange(3)}, source=npz)
        w.append({"x": np.arange(4)})
        w.append({"x": np.arange(5)})
    result = CliRunner().invoke(cli, ["verify", "-q", str(tmp_path / "out"), "--sources"])
    assert result.exit_code == 0 and result.output == ""
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--sources"])
    assert result.exit_code == 0
    assert result.output == (
        f"OK: {tmp_path / 'out'}: 3 samples verified (checksums, tables, padding and sources); "
        "2 samples of 3 name no source (appended by npz2mmap.Writer without source=) and were not compared\n"
    )
    write_npz(tmp_path / "a.npz", x=np.arange(3) + 1)  # the named source changed
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--sources"])
    assert result.exit_code == 1
    assert f"sample 0 ({npz}): field 'x': values differ from the source" in result.output


# --- write errors, interrupts, forks (issue 11) -------------------------------------


def three_field_samples(count: int) -> list[dict[str, np.ndarray]]:
    return [
        {"a": np.arange(5 + i, dtype=np.int16), "b": np.full((2, 3), i, ">f8"), "c": np.array(f"s{i}")}
        for i in range(count)
    ]


def writer_bytes(
    out: Path, samples: list[dict[str, np.ndarray]], sources: list[str], casts: dict[str, str] | None = None
) -> dict[str, bytes]:
    """The files a writer given just these samples writes: the reference for one that refused others."""
    with npz2mmap.Writer(out, casts=casts) as w:
        for sample, source in zip(samples, sources, strict=True):
            w.append(sample, source=source)
    return dataset_files(out)


def test_a_write_error_in_any_spool_is_undone_in_every_spool(tmp_path, monkeypatch) -> None:
    """The failing write keeps a view of the spool's buffer alive in its traceback, as a real one does."""
    monkeypatch.setattr(spools, "SPOOL_BUFFER_NBYTES", 1)  # every piece is written at once
    samples = three_field_samples(3)
    real_write_all_at = fsutil.write_all_at
    calls = []
    monkeypatch.setattr(fsutil, "write_all_at", lambda *args: calls.append(args) or real_write_all_at(*args))
    with npz2mmap.Writer(tmp_path / "count") as w:
        w.append(samples[0])
        calls.clear()
        w.append(samples[1])
        writes_per_append = len(calls)
    assert writes_per_append == 4  # three fields and the source name

    def failing_at(k: int):
        count = iter(range(writes_per_append))

        def write_all_at(fd: int, data: bytearray, offset: int) -> None:
            view = memoryview(data)
            if next(count) == k:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write_all_at(fd, view, offset)

        return write_all_at

    expected = writer_bytes(tmp_path / "expected", [samples[0], samples[2]], ["s0", "s2"])
    for k in range(writes_per_append):
        out = tmp_path / f"failed-{k}"
        with npz2mmap.Writer(out) as w:
            monkeypatch.setattr(fsutil, "write_all_at", real_write_all_at)
            w.append(samples[0], source="s0")
            monkeypatch.setattr(fsutil, "write_all_at", failing_at(k))
            with pytest.raises(
                OutputError, match=r": cannot write the samples beside it \(No space left on device\)$"
            ):
                w.append(samples[1], source="s1")
            monkeypatch.setattr(fsutil, "write_all_at", real_write_all_at)
            assert w.num_samples == 1
            w.append(samples[2], source="s2")
        assert dataset_files(out) == expected, f"write {k} failed"


FILE_TOO_LARGE = """
import resource, signal, sys
import numpy as np
import npz2mmap
from npz2mmap.errors import OutputError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
samples = [{"x": np.full(600_000, i, np.float32), "t": np.arange(i + 1)} for i in range(4)]
w = npz2mmap.Writer(sys.argv[1])
w.append(samples[0], source="s0")
w.append(samples[1], source="s1")
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, hard))
try:
    w.append(samples[2], source="s2")
except OutputError as exc:
    print(exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
w.append(samples[3], source="s3")
w.close()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_real_write_error_while_appending_is_undone_and_the_writer_goes_on(tmp_path) -> None:
    out = tmp_path / "out"
    done = run_script(FILE_TOO_LARGE, str(out))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{out}: cannot write the samples beside it (File too large)\n"
    samples = [{"x": np.full(600_000, i, np.float32), "t": np.arange(i + 1)} for i in (0, 1, 3)]
    assert dataset_files(out) == writer_bytes(tmp_path / "expected", samples, ["s0", "s1", "s3"])
    assert verify(out).ok


@pytest.mark.parametrize("raised", [TimeoutError("alarm"), InterruptedError("alarm"), OSError("alarm")])
def test_an_oserror_a_signal_handler_raises_in_a_write_comes_out_unchanged(
    tmp_path, monkeypatch, raised
) -> None:
    """A handler raising while os.write waits (the signal.alarm timeout idiom) makes the
    write raise its exception, which has no errno: append and close let it through as it
    is, after the undo, where a disk error (with an errno) becomes OutputError."""
    monkeypatch.setattr(spools, "SPOOL_BUFFER_NBYTES", 1)  # every piece is written at once
    real_write_all_at = fsutil.write_all_at
    samples = three_field_samples(3)

    def interrupted_write(fd: int, data: bytearray, offset: int) -> None:
        raise raised

    out = tmp_path / "out"
    with npz2mmap.Writer(out) as w:
        w.append(samples[0], source="s0")
        monkeypatch.setattr(fsutil, "write_all_at", interrupted_write)
        with pytest.raises(type(raised)) as caught:
            w.append(samples[1], source="s1")
        assert caught.value is raised and w.num_samples == 1
        with pytest.raises(type(raised)) as caught:
            w.close()
        assert caught.value is raised
    monkeypatch.setattr(fsutil, "write_all_at", real_write_all_at)
    assert sorted(os.listdir(tmp_path)) == []
    with npz2mmap.Writer(out) as w:
        w.append(samples[0], source="s0")
        w.append(samples[2], source="s2")
    assert dataset_files(out) == writer_bytes(tmp_path / "expected", [samples[0], samples[2]], ["s0", "s2"])


def cast_samples(count: int) -> list[dict[str, np.ndarray]]:
    """Samples of three fields, "c" stored as float32 (casts=), "a" spooled before it."""
    return [
        {"a": np.arange(5 + i, dtype=np.int16), "b": np.full((2, 3), i, ">f8"), "c": np.float64(i)}
        for i in range(count)
    ]


class AlarmRaised(Exception):
    """An exception of the caller's own, raised by its signal handler."""


REFUSED = {"a": np.arange(9, dtype=np.int16), "b": np.zeros((1, 3), ">f8"), "c": np.float64(0.1)}


# How an interrupt comes: a real SIGINT; one another thread took (raised whatever this
# thread's mask); an alarm handler raising TimeoutError (an OSError) or an exception of its own.
INTERRUPTS = {
    "SIGINT": ({}, KeyboardInterrupt),
    "SIGINT taken by another thread": ({"other_thread": True}, KeyboardInterrupt),
    "TimeoutError from an alarm": ({"raises": TimeoutError}, TimeoutError),
    "an alarm's own exception": ({"raises": AlarmRaised}, AlarmRaised),
}


def interrupted_appends(
    w: npz2mmap.Writer,
    sample: dict[str, np.ndarray],
    refused: bool,
    replace: Callable[[npz2mmap.Writer], npz2mmap.Writer],
    run_size: RunSize,
    interrupt_kind: str = "SIGINT",
    step: int = 1,
) -> tuple[list[str], npz2mmap.Writer]:
    """Append ``sample`` with an interrupt at the k-th event, for k = 0, step, ... until one gets through.

    After each: the exception is the interrupt's own (no OutputError), SIGINT is
    not blocked, and the sample is in exactly when append returned, or when the
    interrupt came after it was recorded, as append returned (that writer is
    then handed to ``replace``, which finishes it and gives the next). Returns
    each try's outcome and the last writer.
    """
    how, caught = INTERRUPTS[interrupt_kind]
    refusal = SourceError if refused else ()
    outcomes = []
    for k in moments(step, run_size):
        before = w.num_samples
        with Interrupt(k, on_fire=lambda: w.num_samples, **how) as interrupt:  # noqa: B023 (called at once)
            try:
                w.append(sample, source="s1")
                outcome = "returned"
            except caught:
                outcome = "interrupted"
            except refusal:
                outcome = "refused"
        recorded = w.num_samples == before + 1
        where = f"{interrupt_kind} at event {k}, {interrupt.where}"
        assert not sigint_blocked(), where
        if not interrupt.fired:
            assert outcome == ("refused" if refused else "returned"), where
            return [*outcomes, "through"], w
        if outcome == "returned":
            assert recorded, where
        elif recorded:  # an interrupt after the recording: it surfaces in the caller, the sample in
            # Only at the last opcodes of append and of the wrapper's return, after the last
            # statement, which only a tracer reaches (a real signal is raised at the caller's
            # next call); never in work done after the sample is in.
            tail = (":append:", f":with_mask_restored:{WRAPPER_RETURN_LINE} ")
            assert any(name in interrupt.where for name in tail) and interrupt.noted == before + 1, where
            outcome = "after"
            w = replace(w)
        assert not (refused and recorded), where
        outcomes.append(outcome)
    raise AssertionError("unreachable")


WRAPPER_RETURN_LINE = next(
    number
    for number, line in enumerate(Path(parallel.__file__).read_text().splitlines(), 1)
    if line.strip() == "return fn(*args, **kwargs)"
)


@pytest.mark.parametrize(
    ("phase", "interrupt_kind", "step"),
    [
        *((phase, "SIGINT", 1) for phase in ("first sample", "later sample", "refused sample")),
        # Every 7th event: the other kinds differ where SIGINT is held back, or at I/O calls.
        *((phase, kind, 7) for phase in ("later sample", "refused sample") for kind in list(INTERRUPTS)[1:]),
    ],
)
def test_a_ctrl_c_anywhere_in_append_leaves_the_sample_out_and_the_writer_usable(
    tmp_path, monkeypatch, phase, interrupt_kind, step, run_size
) -> None:
    """A Ctrl-C (or an alarm's exception) at every line and bytecode of append, and of
    its undoing of a refused sample: the exception out of append is the interrupt's, and
    leaves the writer as before and SIGINT unblocked, so the same writer takes the next
    try; the dataset at the end is byte for byte what a fresh writer given only the
    samples that got in writes."""
    monkeypatch.setattr(spools, "SPOOL_BUFFER_NBYTES", 8)  # flushes inside append
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test: speed
    samples = cast_samples(3)
    head = [] if phase == "first sample" else [samples[0]]
    sample = REFUSED if phase == "refused sample" else samples[1]
    casts = {"c": "float32"}
    writers = itertools.count()

    def finish(w: npz2mmap.Writer, got_in: bool) -> None:
        """Go on appending, close, and compare with a fresh writer and with the arrays."""
        w.append(samples[2], source="s2")
        w.close()
        kept = [*head, *([sample] if got_in else []), samples[2]]
        names = [*(["s0"] if head else []), *(["s1"] if got_in else []), "s2"]
        oracle = writer_bytes(Path(f"{w.out_dir}-oracle"), kept, names, casts)
        assert dataset_files(Path(w.out_dir)) == oracle
        check_samples(Path(w.out_dir), kept)

    def new_writer() -> npz2mmap.Writer:
        w = npz2mmap.Writer(tmp_path / f"out-{next(writers)}", casts=casts)
        for kept in head:
            w.append(kept, source="s0")
        return w

    def replace(w: npz2mmap.Writer) -> npz2mmap.Writer:
        finish(w, got_in=True)
        return new_writer()

    outcomes, w = interrupted_appends(
        new_writer(), sample, phase == "refused sample", replace, run_size, interrupt_kind, step
    )
    finish(w, got_in=phase != "refused sample")
    assert outcomes.count("interrupted") > 1000 // step  # every event of append was reached
    assert outcomes.count("after") < 10  # the tail is a few bytecodes


def test_a_first_sample_a_held_back_ctrl_c_undid_leaves_no_trace_for_another_first_sample(
    tmp_path, monkeypatch
) -> None:
    """A Ctrl-C where append holds it back: once it is raised and the first sample
    undone, a first sample with other fields is the dataset's first. (Held back, it is
    raised at the same point wherever it came: every 25th of those bytecodes will do.)"""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    other = {"z": np.arange(3, dtype=np.uint8)}
    expected = writer_bytes(tmp_path / "expected", [other], ["z"])
    for k in itertools.count(0, 25):
        w = npz2mmap.Writer(tmp_path / f"out-{k}")
        with Interrupt(k, blocked_only=True) as interrupt:
            try:
                w.append(cast_samples(1)[0], source="s0")
            except KeyboardInterrupt:
                pass
        if not interrupt.fired:
            w.abort()
            assert k > 10  # the recording was reached
            break
        assert w.num_samples == 0, interrupt.where
        w.append(other, source="z")
        w.close()
        assert dataset_files(tmp_path / f"out-{k}") == expected, interrupt.where


@pytest.mark.parametrize(
    ("interrupt_kind", "step"),
    [("SIGINT", 3), ("SIGINT taken by another thread", 5), ("TimeoutError from an alarm", 11)],
)
def test_a_ctrl_c_anywhere_in_close_publishes_the_whole_dataset_or_leaves_the_old_one(
    tmp_path, monkeypatch, interrupt_kind, step, run_size
) -> None:
    """At every third line of close (and of everything it calls; each scenario writes two
    datasets, so all ~1,000 lines would take minutes): OUT is then the old dataset,
    untouched, or the new one, complete; SIGINT is not blocked; once the interrupt is out
    of close the lock is free and nothing is beside OUT, unless it came before close did
    anything, when abort() or the garbage collector does it all. The other kinds of
    interrupt at every few lines: the exception is theirs, never an OutputError."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test: speed
    how, caught = INTERRUPTS[interrupt_kind]
    samples = cast_samples(3)
    old = writer_bytes(tmp_path / "old", [samples[2]], ["old"])
    new = writer_bytes(tmp_path / "new", samples[:2], ["s0", "s1"])
    parent = tmp_path / "parent"
    parent.mkdir()
    leftovers = set()
    outcomes = []
    for k in moments(step, run_size):
        out = parent / f"out-{k}"
        shutil.copytree(tmp_path / "old", out)
        baseline = set(os.listdir(parent))
        w = npz2mmap.Writer(out, overwrite=True)
        for i, sample in enumerate(samples[:2]):
            w.append(sample, source=f"s{i}")
        with Interrupt(k, opcodes=False, **how) as interrupt:
            try:
                w.close()
            except caught:
                outcomes.append("old" if dataset_files(out) == old else "new")
        where = f"{interrupt_kind} at line {k}, {interrupt.where}"
        if not interrupt.fired:
            assert dataset_files(out) == new
            break
        assert not sigint_blocked(), where
        if not lock_is_free(out):  # it came before close did anything: the writer is still open
            assert outcomes[-1] == "old" and left_beside(out) != [], where
            if k % 2:
                w.abort()  # as the with block does
            else:
                del w
                gc.collect()
        assert lock_is_free(out) and left_beside(out) == [], where
        assert dataset_files(out) in (old, new), where
        leftovers |= set(os.listdir(parent)) - baseline
    assert leftovers == set()
    assert outcomes.count("old") > 300 // step and outcomes.count("new") >= 1


@pytest.mark.parametrize("interrupt_kind", ["SIGINT", "SIGINT taken by another thread"])
def test_a_ctrl_c_anywhere_in_abort_removes_everything_or_leaves_the_writer_open(
    tmp_path, interrupt_kind
) -> None:
    """At every bytecode of abort: it did all (nothing of the writer left, OUT free, SIGINT
    not blocked) or nothing (the writer goes on), and a second abort finishes the job."""
    how, _ = INTERRUPTS[interrupt_kind]
    samples = cast_samples(3)
    for k in itertools.count():
        out = tmp_path / f"out-{k}"
        baseline = set(os.listdir(tmp_path))
        w = npz2mmap.Writer(out)
        w.append(samples[0], source="s0")
        with Interrupt(k, **how) as interrupt:
            try:
                w.abort()
            except KeyboardInterrupt:
                pass
        if not interrupt.fired:
            break
        where = f"{interrupt_kind} at event {k}, {interrupt.where}"
        assert not sigint_blocked(), where
        left = set(os.listdir(tmp_path)) - baseline
        if left:  # nothing was done: the writer is whole
            assert not lock_is_free(out), where
            w.append(samples[1], source="s1")
            assert w.num_samples == 2
            w.abort()
        assert set(os.listdir(tmp_path)) - baseline == set(), where
        assert lock_is_free(out), where
        npz2mmap.Writer(out).abort()
        assert not out.exists()


SIGINT_SENDER = """
import os, sys, time
for line in sys.stdin:  # a delay in seconds: wait that long (busy, for precision), then Ctrl-C the parent
    deadline = time.perf_counter() + float(line)
    while time.perf_counter() < deadline:
        pass
    os.kill(os.getppid(), 2)
"""


def wait_for_the_interrupt(seconds: float) -> bool:
    """Sleep until the SIGINT sent raises its KeyboardInterrupt; False if none came in time.

    pthread_sigmask runs pending handlers: a SIGINT another thread (one of BLAS's, say)
    took waits for that."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            time.sleep(0.001)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
        except KeyboardInterrupt:
            return True
    return False


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signals")
def test_real_ctrl_c_at_random_moments_in_small_appends_loses_nothing(tmp_path, monkeypatch) -> None:
    """150 real SIGINTs from another process, each at a random moment of a small append,
    caught: the writer always closes, with exactly the samples num_samples counted; a
    KeyboardInterrupt out of append left its sample out (but for one that came as append
    returned, a few bytecodes: rare). (Now and then a SIGINT taken by another thread of
    this process never raises at all; those trials count as uninterrupted.)"""
    monkeypatch.setattr(spools, "SPOOL_BUFFER_NBYTES", 64)
    rng = np.random.default_rng(10)
    samples = [
        {"a": np.arange(k % 50 + 1, dtype=np.int16), "b": np.full((2, 3), k, ">f8"), "c": np.float64(k)}
        for k in range(150)
    ]
    w = npz2mmap.Writer(tmp_path / "out", casts={"c": "float32"})
    started = time.perf_counter()
    for sample in samples[:10]:
        w.append(sample)
    append_seconds = (time.perf_counter() - started) / 10
    w.abort()
    w = npz2mmap.Writer(tmp_path / "out", casts={"c": "float32"})
    kept, late, lost = [], 0, 0
    with subprocess.Popen([sys.executable, "-c", SIGINT_SENDER], stdin=subprocess.PIPE, text=True) as sender:
        assert sender.stdin is not None
        for k, sample in enumerate(samples):
            before = w.num_samples
            returned = False
            try:  # one try for all: a SIGINT that came as append returned is raised anywhere after it
                sender.stdin.write(f"{rng.uniform(0, 1.5 * append_seconds)}\n")
                sender.stdin.flush()
                w.append(sample, source=f"s{k}")
                returned = True
                lost += not wait_for_the_interrupt(0.5)  # sent as append returned, or later
            except KeyboardInterrupt:
                pass
            recorded = w.num_samples == before + 1
            if recorded:
                kept.append(k)
            late += recorded and not returned
            assert recorded or not returned
        sender.stdin.close()
    w.close()
    expected = writer_bytes(
        tmp_path / "expected", [samples[k] for k in kept], [f"s{k}" for k in kept], {"c": "float32"}
    )
    assert dataset_files(tmp_path / "out") == expected
    assert late <= 3 and lost <= 15
    assert 0 < len(kept) < len(samples)  # some got in, some were interrupted


def check_samples(out: Path, samples: list[dict[str, np.ndarray]]) -> None:
    """Every sample read back equals the array appended (as stored: casts applied)."""
    reader = DatasetReader(out)
    assert len(reader) == len(samples)
    for i, sample in enumerate(samples):
        for key, value in sample.items():
            stored = reader.view(key, i)
            np.testing.assert_array_equal(stored, value.astype(stored.dtype), strict=False)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_a_forked_copy_of_a_writer_refuses_everything_and_leaves_it_intact(tmp_path) -> None:
    samples = three_field_samples(3)
    w = npz2mmap.Writer(tmp_path / "out")
    w.append(samples[0], source="s0")
    message = (
        f"{tmp_path / 'out'}: this Writer belongs to process {os.getpid()}; "
        "use one Writer per process, e.g. part=(rank, world)"
    )
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say, that was given the writer
        refused = 0
        for call in (lambda: w.append(samples[1], source="child"), w.abort, w.close):
            try:
                call()
            except ValueError as exc:
                refused += str(exc) == message
        os._exit(refused)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3
    for i in (1, 2):
        w.append(samples[i], source=f"s{i}")
    w.close()
    expected = writer_bytes(tmp_path / "expected", samples, ["s0", "s1", "s2"])
    assert dataset_files(tmp_path / "out") == expected


WRITER_WITH_A_FORKED_CHILD = """
import os, sys, time
import npz2mmap
w = npz2mmap.Writer(sys.argv[1])
w.append({"x": 1})
if os.fork() == 0:  # lives on, as a DataLoader worker may
    print(os.getpid(), flush=True)  # only now: the fork hooks have run in this child
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_a_forked_child_does_not_keep_the_lock_of_a_writer_killed_with_9(tmp_path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER_WITH_A_FORKED_CHILD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    child = int(process.stdout.readline())
    try:
        process.send_signal(signal.SIGKILL)
        process.wait()
        with npz2mmap.Writer(out) as w:  # while the child still lives
            w.append({"x": 2})
        assert os.path.exists(f"/proc/{child}") or sys.platform != "linux"
    finally:
        os.kill(child, signal.SIGKILL)
    assert DatasetReader(out).view("x", 0).tolist() == 2
    assert sorted(os.listdir(tmp_path)) == ["out"]


# --- part= and field names: checked alike by convert and the Writer ------------------


@pytest.mark.parametrize(
    ("part", "error", "message"),
    [
        ((1.7, 3), TypeError, r"^part must be a pair \(i, n\) of integers, not \(1\.7, 3\)$"),
        ((0,), TypeError, r"^part must be a pair \(i, n\) of integers, not \(0,\)$"),
        (5, TypeError, r"^part must be a pair \(i, n\) of integers, not 5$"),
        ((True, 2), TypeError, r"^part must be a pair \(i, n\) of integers, not \(True, 2\)$"),
        ((0, 1, 2), TypeError, r"^part must be a pair \(i, n\) of integers, not \(0, 1, 2\)$"),
        ((3, 3), ValueError, r"^part 3/3 does not exist: i must be from 0 to 2$"),
        ((0, 0), ValueError, r"^part 0/0 does not exist: n, the number of parts, must be at least 1$"),
        (
            (2**70, 2**71),
            ValueError,
            r"^part \d+/\d+: at most 100,000 parts, so that part names sort in order$",
        ),
    ],
)
def test_a_bad_part_is_refused_alike_by_convert_and_the_writer(tmp_path, part, error, message) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    with pytest.raises(error, match=message):
        npz2mmap.Writer(tmp_path / "out", part=part)
    with pytest.raises(error, match=message):
        convert([tmp_path / "src"], tmp_path / "out", part=part, workers=1)
    assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize(
    "environ",
    [
        {"RANK": " 1", "WORLD_SIZE": "2"},
        {"RANK": "1", "WORLD_SIZE": "2\n"},
        {"RANK": "1_0", "WORLD_SIZE": "20"},
        {"RANK": "\u0663", "WORLD_SIZE": "4"},  # ARABIC-INDIC DIGIT THREE
        {"SLURM_PROCID": "+1", "SLURM_NTASKS": "2"},
        {"RANK": "", "WORLD_SIZE": "2"},
    ],
)
def test_part_auto_takes_only_plain_ascii_digits(environ) -> None:
    (rank, rank_value), (size, size_value) = environ.items()
    with pytest.raises(ValueError) as raised:
        part_from_environment(environ)
    assert str(raised.value) == f"{rank}={rank_value!r} and {size}={size_value!r} are not integers"


def test_aborting_a_part_writer_or_conversion_leaves_nothing_behind(tmp_path) -> None:
    w = npz2mmap.Writer(tmp_path / "out", part=(1, 4))
    w.append({"x": 1})
    assert os.listdir(tmp_path) == ["out"]
    w.abort()
    assert os.listdir(tmp_path) == []
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SourceError, match="bad.npz: not a valid zip/npz file"):
        convert([tmp_path / "bad.npz"], tmp_path / "out", part=(0, 1), workers=1)
    assert os.listdir(tmp_path) == ["bad.npz"]
    with npz2mmap.Writer(tmp_path / "kept", part=(0, 2)):
        pass
    assert os.listdir(tmp_path / "kept") == ["part-00000"]


@pytest.mark.parametrize(
    ("name", "shown", "problem"),
    [
        ("", "''", "is empty"),
        ("a\nb", r"'a\\nb'", "holds a control character"),
        ("a\x00", r"'a\\x00'", "holds a control character"),
        ("\x1b[31mred", r"'\\x1b\[31mred'", "holds a control character"),
        ("a\u2028b", r"'a\\u2028b'", "holds a control character"),
        (
            "x" * 256,
            "'" + "x" * 239 + r"\.\.\.",
            "has 256 characters, more than the 255 a field name may have",
        ),
    ],
)
def test_a_field_name_a_dataset_may_not_hold_is_refused_by_convert_and_the_writer(
    tmp_path, name, shown, problem
) -> None:
    w = npz2mmap.Writer(tmp_path / "written")
    with pytest.raises(SourceError, match=f"^sample 0 \\(a.npz\\): field name {shown} {problem}$"):
        w.append({name: np.arange(3)}, source="a.npz")
    w.append({"x" * 255: np.arange(3)})  # the longest name allowed
    w.close()
    if "\x00" in name:  # zipfile ends a member's name at NUL: np.load and convert read key 'a'
        return
    src = tmp_path / "src" / "a.npz"
    src.parent.mkdir()
    np.savez(src, **{name: np.arange(3)})
    way_out = re.escape(SKIP_BAD_HINT) if name == "" else ""  # a member named .npy: a bad file, left out
    with pytest.raises(SourceError, match=f"^{src}: field name {shown} {problem}{way_out}$"):
        convert([src], tmp_path / "converted", workers=1)
    assert sorted(os.listdir(tmp_path)) == ["src", "written"]


def test_a_source_name_with_control_characters_is_stored_as_given_and_shown_escaped(opened) -> None:
    with pytest.raises(SourceError) as raised:
        opened.append({"x": np.zeros(3), "y": 1.0}, source="b\n\x1b[2J.npz")
    assert str(raised.value).startswith(r"sample 1 (b\n\x1b[2J.npz)[x]: dtype float64 differs from float32")
    opened.append({"x": np.zeros(3, np.float32), "y": 1.0}, source="c\n.npz")
    opened.close()
    lines = (Path(opened.out_dir) / "sources.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == ["a.npz", "c\n.npz"]


WRITER_WITH_A_CHILD_THAT_EXITS = """
import os, sys
import numpy as np
import npz2mmap
w = npz2mmap.Writer(sys.argv[1])
w.append({"x": np.arange(3)}, source="parent")
if os.fork() == 0:
    sys.exit(0)  # a normal exit: the child's copies of the writer's objects are collected
os.wait()
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))), flush=True)
try:
    npz2mmap.Writer(sys.argv[1])
except npz2mmap.errors.OutputError as exc:
    print(exc, flush=True)
w.append({"x": np.arange(4)}, source="parent")
w.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_a_forked_child_that_exits_leaves_the_lock_and_the_writer_to_its_parent(tmp_path) -> None:
    out = tmp_path / "out"
    result = run_script(WRITER_WITH_A_CHILD_THAT_EXITS, str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing 'ignored' while the child exited
    entries, refusal = result.stdout.splitlines()
    assert ".out.npz2mmap-lock" in entries
    assert refusal == f"{out}: another npz2mmap conversion or Writer is writing it"
    assert (out / "sources.jsonl").read_text() == '"parent"\n"parent"\n'
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs signal masks (POSIX)")
def test_a_ctrl_c_raised_as_interrupts_are_blocked_leaves_them_unblocked(monkeypatch) -> None:
    """pthread_sigmask runs the handlers of signals that came before, once the new mask is
    set: the KeyboardInterrupt it raises then must not leave SIGINT blocked for good
    (later Ctrl-Cs would never be raised)."""
    real_sigmask = signal.pthread_sigmask

    def sigmask_then_pending_ctrl_c(how: int, mask: object) -> set[int]:
        previous = real_sigmask(how, mask)  # type: ignore[arg-type]
        if how == signal.SIG_BLOCK and signal.SIGINT in mask:  # type: ignore[operator]
            raise KeyboardInterrupt  # as CPython's handler run by this very call would
        return previous

    monkeypatch.setattr(signal, "pthread_sigmask", sigmask_then_pending_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            with parallel.interrupts_blocked():
                pass
        assert signal.SIGINT not in real_sigmask(signal.SIG_BLOCK, [])
    finally:
        real_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@contextlib.contextmanager
def exit_cut_short() -> Iterator[None]:
    """interrupts_blocked as a Ctrl-C another thread took leaves it: raised as its exit
    begins, before it restores the mask (in contextlib's __exit__, say)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    yield
    raise KeyboardInterrupt


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs signal masks (POSIX)")
@pytest.mark.parametrize("call", ["append", "refused append", "close", "abort"])
def test_a_ctrl_c_raised_before_the_mask_is_restored_leaves_sigint_unblocked(
    tmp_path, monkeypatch, call
) -> None:
    """Each Writer call gives the caller back its own signal mask, even when a held-back
    Ctrl-C cuts interrupts_blocked short before it restores SIGINT (a child started
    afterwards would be deaf to Ctrl-C); the writer then goes on, and an abort frees OUT."""
    samples = cast_samples(2)
    w = npz2mmap.Writer(tmp_path / "out", casts={"c": "float32"})
    w.append(samples[0])
    monkeypatch.setattr(writer, "interrupts_blocked", exit_cut_short)
    try:
        with pytest.raises(KeyboardInterrupt):
            if call == "append":
                w.append(samples[1])
            elif call == "refused append":
                w.append(REFUSED)
            else:
                getattr(w, call)()
        assert not sigint_blocked()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    monkeypatch.undo()
    w.abort()
    assert lock_is_free(tmp_path / "out") and os.listdir(tmp_path) == []


@pytest.mark.parametrize("interrupt_kind", ["SIGINT", "SIGINT taken by another thread"])
def test_a_ctrl_c_anywhere_in_creating_a_writer_leaves_out_free(tmp_path, interrupt_kind) -> None:
    """At every bytecode of Writer(OUT): a KeyboardInterrupt out of it leaves the lock
    free, nothing beside OUT and SIGINT unblocked, so the next Writer(OUT) works, even
    while the exception (whose traceback holds the writer half made) is still kept; but
    for a Ctrl-C at the return itself, once the writer is made (here, where a trace
    function runs at every bytecode, it is raised in the returning frame; without one,
    in the caller, which then holds the writer), which lets go once the exception does."""
    how, _ = INTERRUPTS[interrupt_kind]
    at_the_return = []
    for k in itertools.count():
        out = tmp_path / f"out-{k}"
        w = None
        kept = None
        with Interrupt(k, **how) as interrupt:
            try:
                w = npz2mmap.Writer(out)
            except KeyboardInterrupt as exc:
                kept = exc  # as sys.last_value, or a caller's log, keeps it
        where = f"{interrupt_kind} at event {k}, {interrupt.where}"
        assert not sigint_blocked(), where
        if w is not None:
            if not interrupt.fired:
                w.abort()
                break
            w.abort()  # the Ctrl-C came as the writer was made: the caller has it
        left = [e for e in os.listdir(tmp_path) if e.startswith(f".{out.name}.")]
        if left:
            at_the_return.append(interrupt.where)
            del kept  # the exception, and the writer half made its traceback holds
            gc.collect()
            left = [e for e in os.listdir(tmp_path) if e.startswith(f".{out.name}.")]
        assert left == [], where
        assert lock_is_free(out), where
        npz2mmap.Writer(out).abort()
    assert k > 100
    init = inspect.unwrap(npz2mmap.Writer.__init__)
    lines, first = inspect.getsourcelines(init)
    last_statement = first + next(k for k, line in enumerate(lines) if "except BaseException" in line) - 1
    tail = (f"write/writer.py:__init__:{last_statement} ", "parallel.py:with_mask_restored:")
    assert len(at_the_return) <= 3 and all(w.startswith(tail) for w in at_the_return), at_the_return


def test_closing_again_after_a_close_that_raised_says_nothing_was_written(tmp_path, monkeypatch) -> None:
    """A retried close() must not pass for a written dataset: the first one discarded the samples."""
    w = npz2mmap.Writer(tmp_path / "out")
    w.append({"x": np.arange(3)})

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.blob_writer, "finish_dataset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.close()
    monkeypatch.undo()
    with pytest.raises(OutputError) as refused:
        w.close()
    assert str(refused.value) == (
        f"{tmp_path / 'out'}: not written: the earlier close() raised, and its samples were discarded; "
        "append them to a new Writer"
    )
    assert os.listdir(tmp_path) == [] and lock_is_free(tmp_path / "out")
    done = npz2mmap.Writer(tmp_path / "done")
    done.append({"x": np.arange(3)})
    done.close()
    done.close()  # closing a written dataset again is nothing
    aborted = npz2mmap.Writer(tmp_path / "aborted")
    aborted.abort()
    aborted.close()  # nor after an abort, which asked for nothing to be written
    assert sorted(os.listdir(tmp_path)) == ["done"]


def test_a_writer_never_closed_warns_that_nothing_was_written(tmp_path) -> None:
    """It wrote nothing, silently: a Writer without close() or a with block lost every sample."""
    code = f"""
import gc, numpy as np, npz2mmap
w = npz2mmap.Writer({str(tmp_path / 'dropped')!r})
w.append({{"x": np.zeros(2)}})
del w
gc.collect()
print("collected")
with npz2mmap.Writer({str(tmp_path / 'closed')!r}) as w:
    w.append({{"x": np.zeros(2)}})
npz2mmap.Writer({str(tmp_path / 'aborted')!r}).abort()
try:
    with npz2mmap.Writer({str(tmp_path / 'failed')!r}) as w:
        raise KeyError("in the block")
except KeyError:
    pass
left_open = npz2mmap.Writer({str(tmp_path / 'at-exit')!r})
"""
    result = run_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "collected\n"
    message = (
        "npz2mmap.Writer:0: UnclosedWriterWarning: a Writer of {} was never closed, so nothing was written "
        "there and its samples are discarded: call close() (or write in a `with Writer(...) as w:` block)"
    )
    assert result.stderr.splitlines() == [
        message.format(tmp_path / "dropped"),
        message.format(tmp_path / "at-exit"),
    ]
    assert sorted(os.listdir(tmp_path)) == ["closed"]


@pytest.mark.parametrize("interrupts", [1, 2, 3, 10])
def test_a_discard_cut_short_again_and_again_is_finished_before_the_interrupt_goes_on(
    tmp_path, monkeypatch, interrupts
) -> None:
    """The same as a burst, made certain: every removal of the staging directory interrupted,
    ``interrupts`` times over. Two cut close's two discards short and left the lock held."""
    from npz2mmap import fsutil

    remove_tree = fsutil.remove_tree
    left = [interrupts]

    def interrupted_removal(path: str) -> None:
        if left[0]:
            left[0] -= 1
            raise KeyboardInterrupt
        remove_tree(path)

    samples = cast_samples(2)
    for way in ("close", "abort"):
        out = tmp_path / way
        w = npz2mmap.Writer(out)
        w.append(samples[0], source="s0")
        left[0] = interrupts
        monkeypatch.setattr(fsutil, "remove_tree", interrupted_removal)
        with pytest.raises(KeyboardInterrupt):
            getattr(w, way)()
        monkeypatch.setattr(fsutil, "remove_tree", remove_tree)
        assert lock_is_free(out) and left_beside(out) == [], way
        assert not sigint_blocked()
        npz2mmap.Writer(out, overwrite=True).abort()
