"""Killed and interrupted conversions: never a half dataset at OUT; a re-run succeeds."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_samples

from npz2mmap.check.verify import verify
from npz2mmap.errors import Npz2mmapError, OutputError
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import blob_writer, publish
from npz2mmap.write.conversion import convert

SCRIPT = str(Path(sys.executable).parent / "npz2mmap")
MAIN_PID = os.getpid()
_real_write_batch = blob_writer.write_batch


def _die_in_worker_on_sample_five(
    blob_path: str, task: blob_writer.BatchTask, skip_bad: bool
) -> blob_writer.BatchResult:
    """Stands in for blob_writer.write_batch: a worker process is killed as the OOM killer would."""
    if os.getpid() != MAIN_PID and task.first_file <= 5 < task.first_file + len(task.paths):
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_write_batch(blob_path, task, skip_bad)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("crash") / "src"
    rng = np.random.default_rng(0)
    write_samples(src, [{"x": rng.random(50_000), "n": np.arange(i % 50)} for i in range(400)])
    return src


@pytest.fixture(scope="module")
def duration(sources, tmp_path_factory) -> float:
    """Seconds an uninterrupted conversion takes here, start-up included."""
    started = time.perf_counter()
    process = start_convert(sources, tmp_path_factory.mktemp("timed") / "out")
    assert process.wait() == 0
    return time.perf_counter() - started


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def start_convert(sources: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [SCRIPT, "convert", str(sources), "-o", str(out), "--workers", "2", "-q", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def assert_complete_or_absent(out: Path) -> str:
    if not out.exists():
        return "absent"
    report = verify(out)
    assert report.ok, report.problems
    return "complete"


@pytest.mark.parametrize("fraction", [0.2, 0.4, 0.55, 0.7, 0.85, 1.0])
def test_kill_9_never_leaves_a_half_dataset_and_a_rerun_succeeds(
    tmp_path, sources, duration, fraction
) -> None:
    out = tmp_path / "out"
    process = start_convert(sources, out)
    time.sleep(fraction * duration)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert_complete_or_absent(out)
    rerun = subprocess.run(
        [SCRIPT, "convert", str(sources), "-o", str(out), "--overwrite", "-q"], capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert verify(out).ok
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.8, 0.95])
def test_kill_9_during_overwrite_leaves_the_old_or_the_new_dataset(
    tmp_path, sources, duration, fraction
) -> None:
    out = tmp_path / "out"
    write_samples(tmp_path / "old", [{"old": np.arange(3)}])
    convert([tmp_path / "old"], out, workers=1)
    process = start_convert(sources, out, "--overwrite")
    time.sleep(fraction * duration)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert assert_complete_or_absent(out) == "complete"
    assert DatasetReader(out).field_names in {("old",), ("n", "x")}


def wait_for_staging(parent: Path, process: subprocess.Popen, seconds: float = 60) -> None:
    """Until the conversion has begun to write (its staging directory exists), however loaded the machine."""
    deadline = time.monotonic() + seconds
    while not any(p.name.startswith(".out.npz2mmap-tmp-") for p in parent.iterdir()):
        assert process.poll() is None and time.monotonic() < deadline, "the conversion never began to write"
        time.sleep(0.01)


ENDING_SIGNALS = ["SIGINT"] + [name for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]


@pytest.mark.parametrize("signal_name", ENDING_SIGNALS)
def test_ctrl_c_cleans_up_and_exits_non_zero(tmp_path, sources, duration, signal_name) -> None:
    """SIGTERM (a job's time limit) and SIGHUP (a closed terminal) left the staging directory and
    its lock behind; they end a conversion as Ctrl-C does, then the process dies by the signal."""
    out = tmp_path / "out"
    process = start_convert(sources, out)
    wait_for_staging(tmp_path, process)
    time.sleep(0.2 * duration)
    number = getattr(signal, signal_name)
    os.killpg(process.pid, number)
    _, stderr = process.communicate(timeout=60)
    if process.returncode == 0:
        pytest.skip("the conversion finished before the interrupt arrived")
    assert process.returncode == (1 if number == signal.SIGINT else -number)
    assert stderr.strip().splitlines()[-1] == "Aborted!"
    assert "Traceback" not in stderr
    # Interrupted after the atomic rename, the dataset is complete; before it, there is none.
    assert not out.exists() or verify(out, sources=True).ok
    assert leftovers(tmp_path) == []


def killed_writer_leftovers(parent: Path, name: str = "out") -> list[str]:
    """What a writer of parent/name killed with -9 leaves beside it: its lock file and staging."""
    (parent / f".{name}{publish.LOCK_SUFFIX}").write_text("dead")
    (parent / f".{name}{publish.STAGING_MARK}dead1").mkdir()
    (parent / f".{name}{publish.STAGING_MARK}dead1" / "data.npy").write_bytes(b"half")
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}"))


@pytest.mark.parametrize("writes", ["convert --part", "Writer(part=)", "merge (manifest)"])
def test_leftovers_of_a_killed_writer_of_out_are_removed_by_a_part_or_manifest_written_in_it(
    tmp_path, sources, writes
) -> None:
    """Only a plain conversion removed them: a part or a manifest at OUT left gigabytes behind."""
    from npz2mmap import Writer
    from npz2mmap.write.merge import merge

    convert([sources], tmp_path / "whole", workers=1)
    out = tmp_path / "out"

    def write() -> None:
        if writes == "convert --part":
            convert([sources], out, part=(0, 2), workers=1)
        elif writes == "Writer(part=)":
            with Writer(out, part=(0, 2)) as writer:
                writer.append({"x": np.arange(3)})
        else:
            merge([tmp_path / "whole"], out)

    with publish.output_lock(str(out)):  # a live writer of OUT: its staging is kept
        live = publish.make_staging_dir(str(out))
        if writes != "merge (manifest)":
            write()
            shutil.rmtree(out)
        assert len(leftovers(tmp_path)) == 2 and os.path.isdir(live)
    assert len(killed_writer_leftovers(tmp_path)) == 2
    write()
    assert leftovers(tmp_path) == []


def test_a_second_concurrent_conversion_to_the_same_output_is_refused(tmp_path, sources) -> None:
    out = tmp_path / "out"
    with publish.output_lock(str(out)):
        with pytest.raises(OutputError, match="another npz2mmap conversion or Writer is writing it"):
            convert([sources], out, workers=1)
        assert not out.exists()
    convert([sources], out, workers=1)
    assert verify(out).ok


def test_leftovers_of_a_killed_conversion_are_removed_by_the_next(tmp_path, sources) -> None:
    out = tmp_path / "out"
    (tmp_path / f".out{publish.STAGING_MARK}dead1").mkdir()
    (tmp_path / f".out{publish.STAGING_MARK}dead1" / "data.npy").write_bytes(b"half")
    (tmp_path / f".out{publish.RETIRED_MARK}dead2").mkdir()
    (tmp_path / f".other{publish.STAGING_MARK}keep").mkdir()
    convert([sources], out, workers=1)
    assert leftovers(tmp_path) == [f".other{publish.STAGING_MARK}keep"]


def test_a_worker_killed_mid_conversion_is_an_error_not_a_hang(tmp_path, sources, monkeypatch) -> None:
    monkeypatch.setattr(blob_writer, "write_batch", _die_in_worker_on_sample_five)
    with pytest.raises(Npz2mmapError, match="a worker process died \\(killed, or out of memory\\?\\)"):
        convert([sources], tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def _phase_reached(phase: str, out: Path) -> bool:
    """Whether a conversion to ``out`` has reached ``phase``, judged from the files it writes."""
    parent = out.parent
    staging = list(parent.glob(f".{out.name}{publish.STAGING_MARK}*"))
    if phase == "scan":  # the lock is taken just before the workers start scanning
        return (parent / f".{out.name}{publish.LOCK_SUFFIX}").exists()
    if phase == "copy":
        return any((s / "data.npy").exists() for s in staging)
    if phase == "publish":
        return out.exists() or any((s / "index.json").exists() for s in staging)
    return True  # start-up: at once


def _kill_main_when(process: subprocess.Popen, phase: str, out: Path, rng: random.Random) -> bool:
    """SIGKILL only the main process, a random moment into ``phase``; False if it ended first."""
    deadline = time.monotonic() + 60
    while not _phase_reached(phase, out):
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    time.sleep(rng.uniform(0, 0.3 if phase == "start-up" else 0.05))
    if process.poll() is not None:
        return False
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return True


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group ``pgid`` (the workers of a killed main) exits within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("phase", ["start-up", "scan", "copy", "publish"])
def test_kill_9_of_the_main_process_alone_takes_its_workers_and_a_rerun_succeeds(
    tmp_path, sources, phase, run_size
) -> None:
    """The main pid alone is killed (not its group): its workers must follow and free the lock.
    One kill per phase, at a random moment; six in the long run."""
    rng = random.Random(f"{phase}-{os.getpid()}-{time.time_ns()}")
    for attempt in range(run_size.of(1, 6)):
        out = tmp_path / f"out{attempt}"
        process = start_convert(sources, out, "--overwrite")
        survivors_gone = False
        try:
            killed = _kill_main_when(process, phase, out, rng)
            survivors_gone = _group_gone(process.pid, timeout=10)
        finally:
            if not survivors_gone:  # the group still exists, so its id is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        assert survivors_gone, f"workers of the main process killed in {phase} outlived it"
        if killed:
            assert_complete_or_absent(out)
        rerun = subprocess.run(
            [SCRIPT, "convert", str(sources), "-o", str(out), "--workers", "2", "-q", "--overwrite"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rerun.returncode == 0, rerun.stderr
        assert verify(out).ok
        assert leftovers(tmp_path) == []


def _children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid``, from /proc (Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) == pid:
                    children.append(int(entry))
    return children


def _holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has a descriptor open on the file at ``path`` (Linux /proc)."""
    target = path.stat()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held = fd.stat()
            if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; workers fork on Linux only")
def test_workers_hold_no_descriptor_of_the_output_lock(tmp_path, sources) -> None:
    """flock is shared across fork: a worker keeping the descriptor would keep the lock after the main dies."""
    out = tmp_path / "out"
    lock_path = tmp_path / f".out{publish.LOCK_SUFFIX}"
    process = start_convert(sources, out)
    try:
        deadline = time.monotonic() + 60
        while not _phase_reached("copy", out) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)  # copying: the workers have started and scanned
        os.kill(process.pid, signal.SIGSTOP)  # hold everything still while looking
        workers = _children_of(process.pid)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        if process.poll() is not None or not lock_path.exists():
            pytest.skip("the conversion finished before its workers were seen")
        assert len(workers) == 2, workers
        assert _holds_open(process.pid, lock_path)
        assert [pid for pid in workers if _holds_open(pid, lock_path)] == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGCONT)
        process.wait(timeout=120)
    assert process.returncode == 0


LATE_CTRL_C = """
import atexit, os, subprocess, sys, threading, time
import npz2mmap.cli.main

# A thread that can take a signal sent to the process, as numpy's BLAS threads can.
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
# Once the command has ended: Ctrl-C after Ctrl-C until this process is gone.
atexit.register(lambda: subprocess.Popen(
    ["sh", "-c", "while kill -INT %d 2>/dev/null; do :; done" % os.getpid()],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
))
sys.argv = ["npz2mmap", "--version"]
npz2mmap.cli.main.main()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="sh and kill")
def test_ctrl_c_after_the_command_ended_leaves_its_exit_code_and_output_as_they_were() -> None:
    """Python restores SIGINT's default action while it shuts down: a late Ctrl-C would kill with -2."""
    ended = subprocess.run([sys.executable, "-c", LATE_CTRL_C], capture_output=True, text=True, timeout=60)
    assert (ended.returncode, ended.stderr) == (0, "")
    assert ended.stdout.startswith("npz2mmap, version ")


def test_ctrl_c_at_any_point_of_the_entry_point_exits_0_or_1_never_by_the_signal(monkeypatch) -> None:
    """A Ctrl-C at each line and opcode of ``main``, around a command that succeeded or was interrupted."""
    from interrupts import Interrupt

    import npz2mmap.cli.commands
    import npz2mmap.cli.main

    calls = []

    def succeeds(**_: object) -> None:
        calls.append("succeeds")
        sys.stdout.write("done\n")
        raise SystemExit(0)

    def interrupted(**_: object) -> None:
        calls.append("interrupted")
        raise KeyboardInterrupt

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    for command, expected in [(succeeds, {0, 1}), (interrupted, {1})]:
        monkeypatch.setattr(npz2mmap.cli.commands, "cli", command)
        k = 0
        while True:
            calls.clear()
            try:
                with Interrupt(k) as interrupt:
                    npz2mmap.cli.main.main()
            except SystemExit as ended:
                assert ended.code in expected, interrupt.where
            except KeyboardInterrupt:  # only at main's very first steps, before its first try takes hold
                assert calls == [] and interrupt.count < 4, interrupt.where
            finally:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for number in npz2mmap.cli.main.ENDING_SIGNALS:  # main made them end the command
                    signal.signal(number, signal.SIG_DFL)
                if mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            assert len(calls) <= 1, "the command ran twice"
            if not interrupt.fired:
                break
            k += 1
        assert k > 10
