"""Progress: bars on a terminal, timed log lines elsewhere, each command counting its own units."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SKIP_BAD_HINT, convert_part_at, write_npz, write_samples

from npz2mmap import progress as progress_module
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.progress import LogProgress
from npz2mmap.write.conversion import convert

SIZES = (3, 5, 8)


class RecordingProgress:
    """Every stage with the totals it was given and what was advanced in it."""

    def __init__(self) -> None:
        self.stages: list[dict[str, object]] = []

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        self.stages.append(
            {
                "name": name,
                "unit": unit,
                "total": total_files,
                "total_nbytes": total_nbytes,
                "done": 0,
                "nbytes": 0,
            }
        )

    def advance(self, files: int, nbytes: int) -> None:
        self.stages[-1]["done"] += files  # type: ignore[operator]
        self.stages[-1]["nbytes"] += nbytes  # type: ignore[operator]


def ticking(step: float) -> Iterator[float]:
    return (float(t) for t in itertools.count(0, step))


@pytest.fixture
def ticking_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Log lines as if every clock reading were 10 s after the last: each advance prints one."""
    ticks = ticking(10)
    monkeypatch.setattr(
        progress_module, "LogProgress", functools.partial(LogProgress, clock=lambda: next(ticks))
    )


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    # x: 12, 20, 32 bytes; y: 8 bytes each: 20, 28, 40 bytes per sample, 88 in all.
    write_samples(tmp_path / "src", [{"x": np.arange(n, dtype=np.int32), "y": np.float64(n)} for n in SIZES])
    return tmp_path / "src"


def source_nbytes(src: Path) -> list[int]:
    """Bytes per source file's arrays, from numpy itself."""
    result = []
    for path in sorted(src.glob("*.npz")):
        with np.load(path) as npz:
            result.append(sum(npz[key].nbytes for key in npz.files))
    return result


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))  # stderr is not a terminal here: auto means log
    assert result.exit_code == 0, result.output
    return result.output


def test_log_lines_say_done_total_rate_and_eta_then_done_in() -> None:
    ticks = iter([0.0, 4.0, 10.0, 15.0, 25.0, 26.0])
    lines: list[str] = []
    progress = LogProgress(clock=lambda: next(ticks), emit=lines.append)
    progress.stage("copy", 4, 4_000_000)
    for _ in range(4):
        progress.advance(1, 1_000_000)  # at 4 s (too soon), 10 s, 15 s (too soon), 25 s
    progress.close()  # at 26 s
    assert lines == [
        "copy: 2/4 files (50%), 2.0 MB/4.0 MB, 200.0 kB/s, 0:00:10 elapsed, ETA 0:00:10",
        "copy: 4/4 files (100%), 4.0 MB/4.0 MB, 160.0 kB/s, 0:00:25 elapsed, ETA 0:00:00",
        "copy: 4/4 files (100%), 4.0 MB/4.0 MB, 153.8 kB/s, done in 0:00:26",
    ]


def test_a_stage_shorter_than_the_interval_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = ticking(1)
    progress = LogProgress(clock=lambda: next(ticks))
    progress.stage("scan", 5, 0)
    for _ in range(5):
        progress.advance(1, 0)
    progress.close()
    assert capsys.readouterr().err == ""


def test_a_stage_stopped_by_an_error_gets_no_done_line(ticking_logs: None, tmp_path: Path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    (tmp_path / "src" / "b.npz").write_bytes(b"not a zip")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "scan: 1/2 files (50%), 0.1 files/s, 0:00:10 elapsed, ETA 0:00:10",
        f"Error: {tmp_path / 'src' / 'b.npz'}: not a valid zip/npz file (File is not a zip file){SKIP_BAD_HINT}",
    ]


def test_forced_bars_count_each_commands_units(sources: Path) -> None:
    out = str(sources.parent / "out")
    converted = run("convert", str(sources), "-o", out, "--progress", "bar")
    verified = run("verify", out, "--progress", "bar")
    assert "scan: 100%" in converted and "3/3 [" in converted and "3/3 files]" in converted
    assert "verify: 100%" in verified and "88.0/88.0 [" in verified and "3/3 samples]" in verified


def test_convert_logs_files_and_bytes_when_stderr_is_not_a_terminal(
    ticking_logs: None, sources: Path
) -> None:
    first, second, third = itertools.accumulate(source_nbytes(sources))
    output = run("convert", str(sources), "-o", str(sources.parent / "out"), "--workers", "1")
    assert output.splitlines()[:6] == [
        "scan: 1/3 files (33%), 0.1 files/s, 0:00:10 elapsed, ETA 0:00:20",
        "scan: 2/3 files (66%), 0.1 files/s, 0:00:20 elapsed, ETA 0:00:10",
        "scan: 3/3 files (100%), 0.1 files/s, 0:00:30 elapsed, ETA 0:00:00",
        "scan: 3/3 files (100%), 0.1 files/s, done in 0:00:40",
        # The copy advances by batches of consecutive files: here one batch of all three.
        f"copy: 3/3 files (100%), {third} B/{third} B, 9 B/s, 0:00:10 elapsed, ETA 0:00:00",
        f"copy: 3/3 files (100%), {third} B/{third} B, 4 B/s, done in 0:00:20",
    ]
    assert output.splitlines()[6].startswith("Converted 3 samples, 2 fields, 88 B into ")


def test_verify_logs_samples(ticking_logs: None, sources: Path) -> None:
    convert([sources], sources.parent / "out", workers=1)
    output = run("verify", str(sources.parent / "out"))
    assert output.splitlines()[:4] == [
        "verify: 1/3 samples (33%), 20 B/88 B, 2 B/s, 0:00:10 elapsed, ETA 0:00:34",
        "verify: 2/3 samples (66%), 48 B/88 B, 2 B/s, 0:00:20 elapsed, ETA 0:00:16",
        "verify: 3/3 samples (100%), 88 B/88 B, 3 B/s, 0:00:30 elapsed, ETA 0:00:00",
        "verify: 3/3 samples (100%), 88 B/88 B, 2 B/s, done in 0:00:40",
    ]


def test_merge_copy_logs_parts(ticking_logs: None, sources: Path) -> None:
    parts = [
        str(convert_part_at([sources], sources.parent / f"part{i}", (i, 2), workers=1)) for i in range(2)
    ]
    output = run("merge", *parts, "-o", str(sources.parent / "out"), "--copy")
    lines = [line.split(", ")[:2] for line in output.splitlines() if line.startswith("merge: ")]
    # part 0 holds file 0 (x 12 B, y 8 B), part 1 files 1 and 2 (x 20 + 32 B, y 16 B); the last line ends the stage
    assert lines == [
        ["merge: 0/2 parts (0%)", "12 B/88 B"],
        ["merge: 0/2 parts (0%)", "20 B/88 B"],
        ["merge: 1/2 parts (50%)", "20 B/88 B"],
        ["merge: 1/2 parts (50%)", "72 B/88 B"],
        ["merge: 1/2 parts (50%)", "88 B/88 B"],
        ["merge: 2/2 parts (100%)", "88 B/88 B"],
        ["merge: 2/2 parts (100%)", "88 B/88 B"],
    ]


def test_warm_logs_bytes(ticking_logs: None, sources: Path) -> None:
    convert([sources], sources.parent / "out", workers=1)
    blob_nbytes = (sources.parent / "out" / "data.npy").stat().st_size
    output = run("warm", str(sources.parent / "out"))
    assert output.splitlines()[-2] == (
        f"warm: 1/1 part (100%), {blob_nbytes} B/{blob_nbytes} B, {blob_nbytes // 30} B/s, done in 0:00:30"
    )


@pytest.mark.parametrize("flag", [["--progress", "none"], ["-q"]])
@pytest.mark.parametrize("command", ["convert", "verify", "warm"])
def test_progress_none_and_quiet_print_no_progress(
    ticking_logs: None, sources: Path, command: str, flag: list[str]
) -> None:
    out = str(sources.parent / "out")
    if command == "convert":
        output = run("convert", str(sources), "-o", out, *flag)
    else:
        convert([sources], out, workers=1)
        output = run(command, out, *flag)
    assert not any(line.startswith(("scan:", "copy:", "verify:", "warm:")) for line in output.splitlines())


def test_convert_rows_counts_files_not_rows(sources: Path, tmp_path: Path) -> None:
    write_samples(tmp_path / "shards", [{"x": np.zeros((n, 2), dtype=np.int16)} for n in SIZES])
    progress = RecordingProgress()
    convert([tmp_path / "shards"], tmp_path / "out", rows=True, workers=1, progress=progress)
    copy = progress.stages[-1]
    assert copy == {"name": "copy", "unit": "files", "total": 3, "total_nbytes": 64, "done": 3, "nbytes": 64}


def test_verify_counts_every_sample_and_every_byte(sources: Path) -> None:
    convert([sources], sources.parent / "out", workers=1)
    progress = RecordingProgress()
    assert verify(sources.parent / "out", progress=progress).ok
    total = sum(source_nbytes(sources))
    assert progress.stages == [
        {"name": "verify", "unit": "samples", "total": 3, "total_nbytes": total, "done": 3, "nbytes": total}
    ]


@pytest.mark.parametrize("mode", ["none", "log", "bar", "auto"])
def test_convert_from_python_takes_the_cli_progress_modes(
    mode: str, ticking_logs: None, sources: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = convert([sources], tmp_path / "out", progress=mode, workers=1)
    assert result.index.num_samples == len(SIZES)
    err = capsys.readouterr().err
    if mode in ("log", "auto"):  # auto: stderr is not a terminal under pytest
        assert "copy: 3/3 files (100%)" in err
    elif mode == "none":
        assert err == ""


def test_convert_from_python_takes_a_progress_object(sources: Path, tmp_path: Path) -> None:
    recording = RecordingProgress()
    convert([sources], tmp_path / "out", progress=recording, workers=1)
    assert [stage["name"] for stage in recording.stages] == ["scan", "copy"]


@pytest.mark.parametrize("wrong", [True, "loud", 3])
def test_convert_refuses_another_progress_naming_what_it_takes(
    wrong: object, sources: Path, tmp_path: Path
) -> None:
    with pytest.raises(TypeError) as caught:
        convert([sources], tmp_path / "out", progress=wrong)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "progress must be None, one of 'auto', 'bar', 'log', 'none' or an object with stage() and "
        f"advance() methods, got {wrong!r}"
    )
    assert not (tmp_path / "out").exists()


def test_importing_npz2mmap_leaves_tqdms_own_settings_as_they_were() -> None:
    code = (
        "import tqdm; before = tqdm.tqdm.monitor_interval\n"
        "import npz2mmap.progress, npz2mmap.write.conversion\n"
        "assert tqdm.tqdm.monitor_interval == before != 0, tqdm.tqdm.monitor_interval\n"
        "assert npz2mmap.progress._Bar.monitor_interval == 0\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
