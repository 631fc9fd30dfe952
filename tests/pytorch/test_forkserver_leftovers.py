"""What a trainer using forkserver workers leaves in the temporary directory, however it ends."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, write_samples
from hypothesis import given, settings
from hypothesis import strategies as st

from npz2mmap.pytorch.forkserver_socket import ForkserverSocket, remove_stale_dirs, start_time
from npz2mmap.write.conversion import convert

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; forkserver")

# Prints its pids (trainer, forkserver, workers) with a batch in hand, then waits: a line on stdin
# ends it normally. ``listener``: it also listens itself at a default address (in the same pymp-*
# directory); ``file``: it keeps a file of its own there.
TRAINER = """
import os, sys
from multiprocessing import connection, forkserver, util
from npz2mmap import MmapDataset, MmapLoader

if __name__ == "__main__":
    loader = MmapLoader(MmapDataset(sys.argv[1]), 4, num_workers=2, multiprocessing_context="forkserver")
    for batch in loader:
        if sys.argv[2] == "listener":
            own = connection.Listener()
        elif sys.argv[2] == "file":
            open(os.path.join(util.get_temp_dir(), "notes.txt"), "w").close()
        workers = [p.pid for p in loader._workers.pool.processes]
        print(os.getpid(), forkserver._forkserver._forkserver_pid, *workers, flush=True)
        sys.stdin.readline()
        break
    loader.close()
"""


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("forkserver")
    samples = [{"label": np.int64(i)} for i in range(8)]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "dataset", workers=1)
    return root / "dataset"


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """A temporary directory of its own (short: a socket's path must fit in 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="fs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_trainer(dataset: Path, temp: Path, extra: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO_ROOT)}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(dataset), extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, which "group" kills whole
    )
    assert trainer.stdout is not None
    pids = [int(pid) for pid in trainer.stdout.readline().split()]
    assert len(pids) == 4, trainer.communicate()[1]
    return trainer, pids


def end_trainer(trainer: subprocess.Popen[str], how: str) -> str:
    """End the trainer as ``how`` says; its stderr."""
    if how == "kill":
        trainer.kill()
    elif how == "group":
        os.killpg(trainer.pid, signal.SIGKILL)
    _, stderr = trainer.communicate("\n" if how == "exit" else None, timeout=60)
    return stderr


def wait_gone(pids: list[int], timeout_s: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if (start_time(pid) is not None and not is_zombie(pid))]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def left_in(temp: Path) -> dict[str, str]:
    """What is in ``temp``, random names and pids starred: {'pymp-*': 'dir', 'pymp-*/listener-*': 'socket'}."""
    found = {}
    for path in sorted(temp.rglob("*")):
        mode = path.lstat().st_mode
        kind = "socket" if stat.S_ISSOCK(mode) else "dir" if stat.S_ISDIR(mode) else "file"
        name = "/".join(starred(part) for part in path.relative_to(temp).parts)
        found[name] = kind if name not in found else found[name] + "+" + kind
    return found


def starred(name: str) -> str:
    """'pymp-*' for 'pymp-k2j4_x9a', and so on for the names multiprocessing and the trainer make up."""
    for prefix in ("pymp-", "listener-", "npz2mmap-trainer-"):
        if name.startswith(prefix):
            return prefix + "*"
    return name


def expected_left(how: str, extra: str) -> dict[str, str]:
    """The rule README states: nothing after a normal exit; after a kill -9 of the trainer alone, only
    what it kept there itself; after the whole process group is killed, the forkserver socket and the
    trainer's mark too."""
    if how == "exit":
        return {}
    own = {"listener": {"pymp-*/listener-*": "socket"}, "file": {"pymp-*/notes.txt": "file"}, "none": {}}[
        extra
    ]
    if how == "kill":
        return {"pymp-*": "dir", **own} if own else {}
    both_sockets = {"pymp-*/listener-*": "socket+socket"} if extra == "listener" else {}
    return {"pymp-*": "dir", "pymp-*/listener-*": "socket", **MARKED, **own, **both_sockets}


MARKED = {"pymp-*/npz2mmap-trainer-*": "file"}


def test_a_trainer_killed_by_sigkill_leaves_no_forkserver_directory(dataset_path, temp_dir) -> None:
    trainer, pids = run_trainer(dataset_path, temp_dir, "none")
    assert left_in(temp_dir) == {"pymp-*": "dir", "pymp-*/listener-*": "socket", **MARKED}
    stderr = end_trainer(trainer, "kill")
    assert wait_gone(pids) == []
    assert left_in(temp_dir) == {}
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    "how,extra", list(itertools.product(["exit", "kill", "group"], ["none", "listener", "file"]))
)
def test_what_each_ending_leaves_is_what_readme_says(dataset_path, temp_dir, how, extra) -> None:
    """Every way a trainer ends, with or without things of its own in its pymp-* directory."""
    trainer, pids = run_trainer(dataset_path, temp_dir, extra)
    end_trainer(trainer, how)
    assert wait_gone(pids) == []
    assert left_in(temp_dir) == expected_left(how, extra)


def make_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


def trainer_states(kind: str) -> tuple[int, str | None, subprocess.Popen[bytes] | None]:
    """A pid and start time whose process is: ``alive`` (this one), ``dead`` (reaped), ``zombie``
    (exited, not reaped) or ``reused`` (a live pid of another start time); and the child to reap."""
    if kind in ("alive", "reused"):
        return os.getpid(), start_time(os.getpid()) if kind == "alive" else "1", None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_time(child.pid)
    if kind == "dead":
        child.wait()
        return child.pid, started, None
    while not is_zombie(child.pid):
        time.sleep(0.01)
    return child.pid, started, child


@settings(max_examples=40, deadline=None)
@given(
    trainer=st.sampled_from(["alive", "dead", "zombie", "reused"]),
    at_path=st.sampled_from(["socket", "file", "missing"]),
    beside=st.sets(st.sampled_from(["file", "socket", "dir"])),
)
def test_only_a_dead_trainers_own_socket_is_removed_and_its_directory_only_when_empty(
    trainer, at_path, beside
) -> None:
    temp = Path(tempfile.mkdtemp(prefix="fs", dir="/tmp"))
    try:
        pymp = temp / "pymp-abcd1234"
        pymp.mkdir()
        path = pymp / "listener-abcd1234"
        if at_path == "socket":
            make_socket(path)
        elif at_path == "file":
            path.write_bytes(b"")
        for kind in beside:
            other = pymp / f"other-{kind}"
            if kind == "socket":
                make_socket(other)
            elif kind == "dir":
                other.mkdir()
            else:
                other.write_bytes(b"")
        pid, started, child = trainer_states(trainer)
        forkserver_socket = ForkserverSocket(str(path), pid, started)
        Path(forkserver_socket.mark_path).write_bytes(b"")
        forkserver_socket.remove_if_trainer_gone(wait_s=0.05)
        if child is not None:
            child.wait()
        gone = trainer != "alive"
        path_left = at_path == "file" or (at_path == "socket" and not gone)
        expected = sorted(f"other-{kind}" for kind in beside) + (["listener-abcd1234"] if path_left else [])
        expected += [] if gone else [Path(forkserver_socket.mark_path).name]
        if gone and not expected:
            assert not pymp.exists()
        else:
            assert sorted(os.listdir(pymp)) == sorted(expected)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_ring_that_does_not_fit_in_dev_shm_is_an_unlinked_file_of_the_temporary_directory(
    dataset_path, temp_dir, monkeypatch
) -> None:
    """Not in multiprocessing's pymp-* directory, which a kill -9 would leave behind (as on macOS, where
    no /dev/shm is tried: the same fallback)."""
    from multiprocessing import heap

    from npz2mmap import MmapDataset, MmapLoader

    monkeypatch.setattr(heap.Arena, "_dir_candidates", [], raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    before = shared_mappings()  # multiprocessing's heap keeps its arenas (also pym-PID-*) mapped
    with MmapLoader(MmapDataset(dataset_path), 4, num_workers=1, multiprocessing_context="fork") as loader:
        next(iter(loader))
        ring = shared_mappings() - before
    assert len(ring) == 1
    (path,) = ring
    assert path.endswith(" (deleted)") and Path(path).parent == temp_dir
    assert left_in(temp_dir) == {}


def shared_mappings() -> set[str]:
    """The files of this process's shared memory (multiprocessing's pym-PID-* names) as mapped."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(None, 5)[-1] for line in maps if f"/pym-{os.getpid()}-" in line}


def test_the_next_forkserver_start_removes_what_a_trainer_killed_with_its_workers_left(
    dataset_path, temp_dir
) -> None:
    trainer, pids = run_trainer(dataset_path, temp_dir, "none")
    end_trainer(trainer, "group")
    assert wait_gone(pids) == []
    assert left_in(temp_dir) == {"pymp-*": "dir", "pymp-*/listener-*": "socket", **MARKED}
    (stale,) = temp_dir.iterdir()
    trainer, pids = run_trainer(dataset_path, temp_dir, "none")
    assert not stale.exists()
    end_trainer(trainer, "exit")
    assert wait_gone(pids) == []
    assert left_in(temp_dir) == {}


def mark_of(state: str, children: list[subprocess.Popen[bytes]]) -> str:
    pid, started, child = trainer_states(state)
    if child is not None:
        children.append(child)
    return f"npz2mmap-trainer-{pid}-{started or 'none'}"


DIRECTORY_ENTRIES = st.lists(
    st.sampled_from(["alive", "dead", "zombie", "reused", "listener", "socket", "file", "dir"]), max_size=4
)


@settings(max_examples=40, deadline=None)
@given(
    directories=st.lists(
        st.tuples(st.sampled_from(["pymp-", "other-", "link:pymp-", "nobody:pymp-"]), DIRECTORY_ENTRIES),
        min_size=1,
        max_size=3,
    )
)
def test_only_directories_of_dead_trainers_holding_nothing_but_their_sockets_are_removed(directories) -> None:
    """The oracle: a pymp-* directory (not a link) with a mark, every marked trainer gone, the rest
    forkserver sockets; anything else stays exactly as it was."""
    temp = Path(tempfile.mkdtemp(prefix="fs", dir="/tmp"))
    children: list[subprocess.Popen[bytes]] = []
    try:
        expected = {}
        for number, (kind, entries) in enumerate(directories):
            target = temp / f"{kind.split(':')[-1]}{number:08d}"
            if kind.startswith("link:"):
                target = temp / f"real{number}"
                (temp / f"pymp-{number:08d}").symlink_to(target)
            target.mkdir()
            if kind.startswith("nobody:"):
                if os.geteuid() != 0:
                    continue  # only root can give a directory away
                os.chown(target, 65534, 65534)  # another user's
            for position, entry in enumerate(entries):
                if entry in ("alive", "dead", "zombie", "reused"):
                    (target / mark_of(entry, children)).write_bytes(b"")
                elif entry in ("listener", "socket"):
                    make_socket(target / f"{'listener' if entry == 'listener' else 'other'}-{position}")
                elif entry == "dir":
                    (target / f"sub{position}").mkdir()
                else:
                    (target / f"file{position}").write_bytes(b"")
            marks = [entry for entry in entries if entry in ("alive", "dead", "zombie", "reused")]
            stale = (
                kind == "pymp-"
                and bool(marks)
                and "alive" not in marks
                and all(entry in ("dead", "zombie", "reused", "listener") for entry in entries)
            )
            expected[target.name] = None if stale else sorted(os.listdir(target))
        remove_stale_dirs(str(temp))
        for name, entries_left in expected.items():
            if entries_left is None:
                assert not (temp / name).exists()
            else:
                assert sorted(os.listdir(temp / name)) == entries_left
    finally:
        for child in children:
            child.wait()
        shutil.rmtree(temp, ignore_errors=True)
