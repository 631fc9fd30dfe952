"""Worker processes carry no state from one task, attempt or conversion to the next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hostile
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_samples

from npz2mmap.cli.commands import cli
from npz2mmap.read.reader import DatasetReader


@pytest.fixture(scope="module")
def sources_with_a_late_corruption(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("late") / "src"
    rng = np.random.default_rng(11)
    write_samples(src, [{"x": rng.random(20_000), "id": np.int64(i)} for i in range(12)])
    hostile.corrupt_far_past_the_header(src / "s00005.npz", "x")
    return src


def convert_skipping_bad(src: Path, out: Path, workers: int) -> None:
    result = CliRunner().invoke(
        cli, ["convert", str(src), "-o", str(out), "--skip-bad", "--workers", str(workers), "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad file" in result.output and "Bad CRC-32 for file 'x.npy'" in result.output


@pytest.mark.parametrize("workers", [2, 3])
def test_skip_bad_found_while_copying_keeps_every_sample_with_a_pool(
    tmp_path, sources_with_a_late_corruption, workers
) -> None:
    src = sources_with_a_late_corruption
    convert_skipping_bad(src, tmp_path / "one", 1)
    convert_skipping_bad(src, tmp_path / "many", workers)
    reader = DatasetReader(tmp_path / "many")
    kept = [src / f"s{i:05d}.npz" for i in range(12) if i != 5]
    assert len(reader) == len(kept)
    for i, path in enumerate(kept):
        with np.load(path) as source:
            for key in ("x", "id"):
                assert reader.view(key, i).tobytes() == source[key].tobytes(), (path.name, key)
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (tmp_path / "many" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


SLOW_WORKER_START = """
import os, sys, time
from pathlib import Path
from npz2mmap.parallel import worker_map

def slow_start_in_child():
    Path(sys.argv[1], str(os.getpid())).touch()
    time.sleep(1)

os.register_at_fork(after_in_child=slow_start_in_child)
with worker_map(2, 8) as imap:
    print(sum(imap(abs, range(-8, 0))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork on Linux only")
def test_ctrl_c_while_a_worker_starts_prints_nothing_from_it(tmp_path) -> None:
    """A worker interrupted before its initializer ignores SIGINT must not print a traceback."""
    (tmp_path / "started").mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WORKER_START, str(tmp_path / "started")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any((tmp_path / "started").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.005)
        worker = int(next((tmp_path / "started").iterdir()).name)
        os.kill(worker, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, stdout, stderr) == (0, "36\n", "")


def test_no_more_workers_start_than_there_are_tasks(monkeypatch) -> None:
    """--workers 1000 on 5 files started 999 processes, each doing nothing but cost."""
    import npz2mmap.parallel as parallel

    started = []

    class Recorded(parallel.ProcessPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            started.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(parallel, "ProcessPoolExecutor", Recorded)
    with parallel.worker_map(1000, 5) as imap:
        assert list(imap(abs, [-1, -2, -3, -4, -5])) == [1, 2, 3, 4, 5]
    with parallel.worker_map(1000, 1) as imap:  # one task: no process at all
        assert list(imap(abs, [-7])) == [7]
    assert started == [5]
