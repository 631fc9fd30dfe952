"""scripts/setup.sh: says what it installs, and skips the install when nothing changed.

Runs the script on a copy of the project root with a stand-in virtualenv whose
``python`` records every call, answers ``-m pip`` without installing anything
and runs everything else with this interpreter, so no real environment changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

ROOT = REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="setup.sh is a bash script")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    for script in ["setup.sh", "convert.sh"]:
        shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    stub = bin_dir / "python"
    stub.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path / "calls.log"}"\n'
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    stub.chmod(0o755)
    command = bin_dir / "npz2mmap"  # the console script: records its arguments, fails on "bad"
    command.write_text(f'#!/bin/sh\necho "npz2mmap $*" >> "{tmp_path / "calls.log"}"\n[ "$2" != bad ]\n')
    command.chmod(0o755)
    return root


def run_setup(project: Path, extras: str) -> tuple[str, list[str]]:
    """Source setup.sh as the other scripts do; return its stderr and the pip calls it made."""
    log = project.parent / "calls.log"
    log.write_text("")
    env = {**os.environ, "NPZ2MMAP_VENV": str(project.parent / "venv"), "EXTRAS": extras}
    result = subprocess.run(
        ["bash", "-c", f'source "{project}/scripts/setup.sh"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    pip_calls = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    return result.stderr, pip_calls


def test_setup_says_what_it_installs_then_skips_it_until_something_changes(project: Path) -> None:
    venv = project.parent / "venv"
    stderr, pip_calls = run_setup(project, "torch")
    assert pip_calls == [f"-m pip install --quiet -e {project}[torch]"]
    assert f"setup: installing npz2mmap[torch] into {venv}, editable" in stderr

    stderr, pip_calls = run_setup(project, "torch")
    assert pip_calls == []
    assert stderr == f"setup: {venv} is up to date (pyproject.toml unchanged; extras [torch] installed)\n"

    _, pip_calls = run_setup(project, "test")  # other extras: install them beside the first
    assert pip_calls == [f"-m pip install --quiet -e {project}[test,torch]"]

    with open(project / "pyproject.toml", "a") as fp:  # a changed project: install again
        fp.write("\n# changed\n")
    _, pip_calls = run_setup(project, "test")
    assert pip_calls == [f"-m pip install --quiet -e {project}[test]"]
    assert run_setup(project, "test")[1] == []


def test_switching_between_the_scripts_extras_installs_nothing_once_both_are_in(project: Path) -> None:
    assert run_setup(project, "test")[1] == [f"-m pip install --quiet -e {project}[test]"]
    # test requires all that torch requires: convert.sh's extras are in already
    for extras in ["torch", "test", "torch", "test"]:
        stderr, pip_calls = run_setup(project, extras)
        assert pip_calls == [], (extras, stderr)
    assert run_setup(project, "docs")[1] == []  # mkdocs is among test's too
    assert run_setup(project, "torch,nosuch")[1] == [f"-m pip install --quiet -e {project}[torch,nosuch,test]"]


def test_convert_sh_runs_the_conversion_then_says_how_to_activate_the_environment(project: Path) -> None:
    venv = project.parent / "venv"
    env = {**os.environ, "NPZ2MMAP_VENV": str(venv)}
    script = str(project / "scripts" / "convert.sh")
    done = subprocess.run(["bash", script, "data/", "-o", "data.mmap"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "npz2mmap convert data/ -o data.mmap" in (project.parent / "calls.log").read_text().splitlines()
    assert done.stdout.splitlines()[-1] == (
        f"npz2mmap is installed in {venv}; to have the npz2mmap command in your shell: source {venv}/bin/activate"
    )
    failed = subprocess.run(["bash", script, "bad", "-o", "x"], env=env, capture_output=True, text=True)
    assert (failed.returncode, failed.stdout) == (1, "")  # the conversion's exit code, and no hint after it
