"""The independent oracle: random corpora (NPZ, .npy files, sample directories) and options,
checked against np.load of the sources.

Every sample's raw bytes are compared with what the oracle (tests/corpus.py)
computes from ``np.load`` alone; the output must be byte-identical for any
number of workers, for parts merged with ``merge --copy``, and ``verify
--sources`` must agree. The test command runs 150 cases, the same each run; the
long run (``-m long``) 1,500 drawn anew.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import sized
from corpus import Corpus, FieldSpec, Options, corpora, expected_samples, options_for, write_corpus
from hypothesis import event, given
from hypothesis import strategies as st

from npz2mmap.check.verify import verify
from npz2mmap.format.index import DATASET_FILES
from npz2mmap.read.parts import Parts, PartsReader
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


@st.composite
def cases(draw: st.DrawFn) -> tuple[Corpus, Options]:
    corpus = draw(corpora())
    return corpus, draw(options_for(corpus))


def test_converted_bytes_match_numpy_for_any_corpus_and_options(tmp_path_factory, run_size) -> None:
    @sized(run_size, 150, 1500)
    @given(case=cases())
    def check(case: tuple[Corpus, Options]) -> None:
        matches_numpy(tmp_path_factory, case)

    check()


def matches_numpy(tmp_path_factory: pytest.TempPathFactory, case: tuple[Corpus, Options]) -> None:
    corpus, options = case
    record_coverage(corpus, options)
    root = tmp_path_factory.mktemp("oracle")
    written = write_corpus(corpus, root / "src")
    keys = options.keys or [f.name for f in corpus.fields]
    good = written.good(keys)
    kwargs = dict(keys=options.keys, casts=options.casts, skip_bad=written.any_bad(keys), rows=corpus.rows)
    kwargs["sample_dirs"] = corpus.layout == "sample-dirs"
    kwargs["align"] = options.align
    out = root / "out"
    convert([root / "src"], out, workers=options.workers, **kwargs)
    check_against_numpy(out, corpus, options, good)
    assert verify(out, sources=True).ok, verify(out, sources=True).problems
    reference = root / "one-worker"
    convert([root / "src"], reference, workers=1, **kwargs)
    assert_same_files(out, reference)
    if options.parts > 1:
        check_parts(root, options, kwargs, out)


def record_coverage(corpus: Corpus, options: Options) -> None:
    """What each case exercises, shown by pytest --hypothesis-show-statistics."""
    event(f"workers={options.workers}, parts={options.parts}")
    event(f"layout={corpus.layout}")
    features = {
        "rows": corpus.rows,
        "scan-bad": bool(corpus.scan_bad),
        "copy-bad": bool(corpus.copy_bad),
        "cast": bool(options.casts),
        "keys": options.keys is not None,
        "records": any(f.dtype.fields for f in corpus.fields),
        "big-endian": any(f.dtype.byteorder == ">" for f in corpus.fields),
        "fortran": any(any(f.fortran) and len(f.sample_shapes[0]) > 1 for f in corpus.fields),
        "compressed": any(corpus.compressed),
    }
    for name, present in features.items():
        if present:
            event(name)


def check_against_numpy(out: Path, corpus: Corpus, options: Options, good: list[Path]) -> None:
    reader = DatasetReader(out)
    names = options.keys or [f.name for f in corpus.fields]
    assert reader.field_names == tuple(sorted(names))
    for name in names:
        expected = [
            sample
            for path in good
            for sample in expected_samples(path, name, corpus.rows, options.casts.get(name))
        ]
        assert len(reader) == len(expected)
        for i, sample in enumerate(expected):
            assert reader.view(name, i).tobytes() == sample, (name, i)


def check_parts(root: Path, options: Options, kwargs: dict, single: Path) -> None:
    parts = root / "parts"
    for i in range(options.parts):
        convert([root / "src"], parts, part=(i, options.parts), workers=options.workers, **kwargs)
    merge(sorted(parts.iterdir()), root / "merged", copy=True)
    assert_same_files(root / "merged", single)
    merge(sorted(parts.iterdir()), root / "manifest")
    whole, joined = DatasetReader(single), PartsReader(Parts(root / "manifest"))
    for name in whole.field_names:
        for i in range(len(whole)):
            assert joined.view(name, i).tobytes() == whole.view(name, i).tobytes()
    shutil.rmtree(parts)


def assert_same_files(a: Path, b: Path) -> None:
    for name in DATASET_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("workers", [1, 2])
def test_the_oracle_catches_a_wrong_byte(tmp_path, workers) -> None:
    """The oracle is not vacuous: a single flipped stored byte is caught by it."""
    corpus = Corpus([FieldSpec("x", np.dtype(">i4"), [(3,)], [False])], [False], rows=False, num_files=1)
    good = write_corpus(corpus, tmp_path / "src").good(["x"])
    convert([tmp_path / "src"], tmp_path / "out", workers=workers)
    options = Options(workers=workers, keys=None, casts={}, align=64, parts=1)
    check_against_numpy(tmp_path / "out", corpus, options, good)
    reader = DatasetReader(tmp_path / "out")
    offset = 128 + reader.index.fields[0].data.offset
    del reader
    blob = bytearray((tmp_path / "out" / "data.npy").read_bytes())
    blob[offset] ^= 1
    (tmp_path / "out" / "data.npy").write_bytes(bytes(blob))
    with pytest.raises(AssertionError):
        check_against_numpy(tmp_path / "out", corpus, options, good)
