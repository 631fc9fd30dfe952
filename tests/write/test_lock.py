"""The output lock: held by one process at a time, on the file its path names."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import write_npz

from npz2mmap import locks
from npz2mmap.errors import OutputError
from npz2mmap.write.conversion import convert


def test_a_lock_file_removed_between_open_and_lock_is_retried_on_the_file_the_path_names(
    tmp_path, monkeypatch
) -> None:
    """Another process removed the file we opened and made a new one: our lock on the old file
    holds nothing, so the lock is taken again, on the file the path now names."""
    path = tmp_path / ".out.lock"
    real_try_lock = locks._try_lock
    calls = []

    def replaced_meanwhile(fd: int) -> bool:
        calls.append(fd)
        if len(calls) == 1:
            os.unlink(path)
            path.write_bytes(b"")
        return real_try_lock(fd)

    monkeypatch.setattr(locks, "_try_lock", replaced_meanwhile)
    with locks.exclusive_lock(str(path)) as fd:
        assert len(calls) == 2 and fd is not None
        assert os.fstat(fd).st_size > 0 and path.read_bytes() == os.pread(fd, 64, 0)
        monkeypatch.setattr(locks, "_try_lock", real_try_lock)
        with locks.exclusive_lock(str(path)) as second:
            assert second is None  # the lock really is held on the file the path names
    assert not path.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_a_fifo_in_place_of_the_lock_file_is_a_one_line_output_error(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    os.mkfifo(tmp_path / ".out.npz2mmap-lock")
    with pytest.raises(OutputError) as caught:
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert str(caught.value).startswith(f"{tmp_path / 'out'}: cannot create the output beside it (")
    assert "a pipe (FIFO), not a regular file" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_in_place_of_the_lock_file_is_refused_and_its_target_untouched(tmp_path, dangling) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    victim = tmp_path / "victim.txt"
    if not dangling:
        victim.write_bytes(b"precious data 0123456789abcdef0123456789abcdef")
    (tmp_path / ".out.npz2mmap-lock").symlink_to(victim)
    with pytest.raises(OutputError) as caught:
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert str(caught.value) == (
        f"{tmp_path / 'out'}: cannot create the output beside it "
        f"(the lock file {tmp_path / '.out.npz2mmap-lock'} is a symbolic link, not a regular file)"
    )
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_bytes() == b"precious data 0123456789abcdef0123456789abcdef"
    assert not (tmp_path / "out").exists()


def test_leaving_never_removes_a_lock_file_that_is_not_ours(tmp_path) -> None:
    path = tmp_path / ".out.lock"
    with locks.exclusive_lock(str(path)) as first:
        assert first is not None
        path.unlink()
        path.write_bytes(b"\0" + b"someone else's lock file")
    assert path.read_bytes() == b"\0" + b"someone else's lock file"
