"""The package's layers (pyproject.toml, [tool.importlinter]) hold, and an import back up breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

ROOT = REPO_ROOT
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed")


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports with the project's contracts, over the package found in ``package_parent``."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=package_parent,
        env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "npz2mmap", tmp_path / "npz2mmap", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "npz2mmap"


def test_the_package_keeps_its_layers(tmp_path) -> None:
    copy_of_the_package(tmp_path)
    result = lint_imports(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    "module, back_import, broken",
    [
        ("format/index.py", "from ..cli import render", "npz2mmap.format.index -> npz2mmap.cli.render"),
        ("read/reader.py", "from ..write import plan", "npz2mmap.read.reader -> npz2mmap.write.plan"),
        ("check/verify.py", "from ..pytorch import ragged_names", None),
        ("ingest/npz.py", "import torch", "npz2mmap.ingest.npz -> torch"),
    ],
)
def test_an_import_back_up_the_layers_breaks_a_contract(tmp_path, module, back_import, broken) -> None:
    package = copy_of_the_package(tmp_path)
    if broken is None:  # siblings: check may not import pytorch either
        (package / "pytorch" / "ragged_names.py").write_text('"""A stand-in."""\n')
        broken = "npz2mmap.check.verify -> npz2mmap.pytorch.ragged_names"
    path = package / module
    path.write_text(path.read_text() + f"\n{back_import}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 broken" in result.stdout
    assert broken in result.stdout
