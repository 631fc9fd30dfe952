"""Shared fixtures: writing NPZ sources and converting them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from npz2mmap.format import index
from npz2mmap.write.conversion import convert

# Where tests find the repository, wherever in tests/ they live.
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent  # what a subprocess puts on PYTHONPATH to import this checkout
GOLDEN_DIR = TESTS_DIR / "data" / "golden"
SKIP_BAD_HINT = "; --skip-bad leaves such files out"  # the end of a conversion's error for a bad file
# What a file found bad only as its bytes are copied is told (a CRC, a file changed since the scan).
COPY_PASS_HINT = "; convert again if it was being written, or --skip-bad leaves such files out"


@dataclass(frozen=True)
class RunSize:
    """How much a sized test tries: its short run in the test command, its long run under ``-m long``."""

    long: bool

    def of(self, short: int, long: int) -> int:
        return long if self.long else short


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.long)], ids=["short", "long"])
def run_size(request: pytest.FixtureRequest) -> RunSize:
    """A test taking this runs twice: short (the test command) and long (``-m long``)."""
    return RunSize(request.param)


def sized(run_size: RunSize, short: int, long: int) -> settings:
    """Hypothesis settings for a sized test: ``short`` examples, the same each run (so CI repeats
    itself), or ``long`` examples drawn anew in the long run."""
    return settings(
        max_examples=run_size.of(short, long),
        derandomize=not run_size.long,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def write_npz(path: Path, compressed: bool = False, **arrays: Any) -> Path:
    """Write one sample file the way users do, with numpy's own savez."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def write_samples(src_dir: Path, samples: Sequence[dict[str, Any]], compressed: bool = False) -> list[Path]:
    return [write_npz(src_dir / f"s{i:05d}.npz", compressed, **arrays) for i, arrays in enumerate(samples)]


def convert_part_at(inputs: Sequence[Path], path: Path, part: tuple[int, int], **options: Any) -> Path:
    """convert() of one part, which goes to OUT/part-IIIII, then moved to ``path``: for tests
    that name their parts (a dataset directory may be moved)."""
    written = convert(inputs, path.parent / f".{path.name}.{{part}}", part=part, **options).out_dir
    os.rename(written, path)
    return path


def assert_same_array(stored: np.ndarray, source: np.ndarray) -> None:
    """Bit-identical after byte-order normalisation: dtype, shape and bytes."""
    assert stored.dtype == source.dtype.newbyteorder("<")
    assert stored.shape == source.shape
    assert (
        np.ascontiguousarray(stored).tobytes() == np.ascontiguousarray(source.astype(stored.dtype)).tobytes()
    )


def blob_bytes(dataset: Path) -> bytes:
    return (dataset / "data.npy").read_bytes()


def rewrite_index(dataset: Path, edit: Callable[[Any], Any] | bytes) -> bytes:
    """Replace ``dataset``'s index.json as a forger would: also the blob identity that names it.

    ``edit`` changes the decoded document in place (or returns a new one), or
    is the new index bytes. Returns the bytes written.
    """
    if isinstance(edit, bytes):
        text = edit
    else:
        document = json.loads((dataset / index.INDEX_NAME).read_text())
        edited = edit(document)
        text = json.dumps(document if edited is None else edited).encode()
    (dataset / index.INDEX_NAME).write_bytes(text)
    rewrite_blob(dataset, 0, index.blob_identity(index.index_digest(text)))
    return text


def rewrite_blob(dataset: Path, payload_offset: int, data: bytes) -> None:
    """Overwrite bytes of the blob's payload in place."""
    with open(dataset / index.BLOB_NAME, "r+b") as fp:
        fp.seek(index.BLOB_HEADER_NBYTES + payload_offset)
        fp.write(data)


@pytest.fixture
def convert_samples(tmp_path: Path) -> Callable[..., Path]:
    """Write samples as NPZ files under tmp_path and convert them; return the dataset dir."""
    counter = iter(range(1_000_000))

    def run(samples: Sequence[dict[str, Any]], compressed: bool = False, **options: Any) -> Path:
        n = next(counter)
        src = tmp_path / f"src{n}"
        write_samples(src, samples, compressed)
        out = tmp_path / f"out{n}"
        options.setdefault("workers", 1)
        convert([src], out, **options)
        return out

    return run


@pytest.fixture
def tiny_sources(tmp_path: Path) -> Path:
    """``tmp_path/src``: two NPZ files of one int64 field, x = [i, i+1, i+2], for tests of paths and options."""
    write_samples(tmp_path / "src", [{"x": np.arange(3) + i} for i in range(2)])
    return tmp_path / "src"


@pytest.fixture
def small_dataset(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Six samples: a fixed float image, a scalar label and ragged tokens."""
    rng = np.random.default_rng(7)
    samples = [
        {
            "input": rng.standard_normal((3, 4, 5)).astype(np.float32),
            "label": np.int64(i),
            "tokens": rng.integers(0, 100, size=i + 1).astype(np.int32),
        }
        for i in range(6)
    ]
    sources = write_samples(tmp_path / "src", samples)
    out = tmp_path / "dataset"
    convert([tmp_path / "src"], out, workers=1)
    return out, sources


def raises_from_dataloader(loader: Any, expected: type[BaseException], match: str) -> pytest.ExceptionInfo[Any]:
    """The error iterating torch's ``loader`` raises, its workers stopped at once: torch's
    iterator, kept alive by the traceback, waits 5 s a worker when it is collected later."""
    batches = iter(loader)
    try:
        with pytest.raises(expected, match=match) as raised:
            for _ in batches:
                pass
    finally:
        getattr(batches, "_shutdown_workers", lambda: None)()
    return raised


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """Fail, rather than wait forever, if something blocks (an open of a pipe without O_NONBLOCK)."""

    def interrupt(*_: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def ctrl_c_left_as_found() -> Iterator[None]:
    """Fail a test after which Ctrl-C no longer works in this process (a handler or mask left
    changed), and put it back: processes started by later tests would inherit it."""
    handler = signal.getsignal(signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else set()
    yield
    after = signal.getsignal(signal.SIGINT)
    after_mask = signal.pthread_sigmask(signal.SIG_SETMASK, mask) if mask is not None and hasattr(signal, "pthread_sigmask") else set()
    if after is not handler:
        signal.signal(signal.SIGINT, handler)
    assert (after, after_mask) == (handler, mask), "the test left Ctrl-C's handler or signal mask changed"


@pytest.fixture(autouse=True, scope="session")
def children_keep_temporary_files_in_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Processes the tests start inherit a temporary directory of the session's: what torch leaves
    there (torchrun's ``torchelastic_*``, its persistent DataLoader workers' ``pymp-*``) goes with
    the session's files, not into the machine's temporary directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield
