"""The README and docs/ as a new user meets them: every Python snippet runs, and torch is optional.

Each ```python block of README.md and of the pages of docs/ runs in its own interpreter, in a temporary
directory holding the README's own example (scripts/example.py, converted) at
every path the snippets name. A snippet written for torchrun gets the
environment torchrun gives a process; an epilogue iterates the snippet's
``loader`` to the end, since a DataLoader only fails when it is iterated. The
snippets are run as written: each defines every name it uses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT

from npz2mmap import MmapDataset
from npz2mmap.write.conversion import convert

ROOT = REPO_ROOT
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [
    (document.relative_to(ROOT).as_posix(), snippet)
    for document in DOCUMENTS
    for snippet in re.findall(r"^```python\n(.*?)^```", document.read_text(), re.S | re.M)
]
DATASET_NAMES = ("data.mmap", "seq.mmap")  # the paths the snippets open

# A snippet meant for torchrun runs as rank 0 of one process, with the environment torchrun gives it.
TORCHRUN_PRELUDE = """\
import os, socket
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_s.getsockname()[1]))
"""

EPILOGUE = """
# A DataLoader fails only when iterated: run the snippet's last loader to the end.
if "loader" in globals():
    print("batches:", sum(1 for _ in loader))
"""


def run_python(code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's example (scripts/example.py make), converted at every path the snippets use."""
    work = tmp_path_factory.mktemp("readme")
    subprocess.run(
        [sys.executable, ROOT / "scripts" / "example.py", "make", work / "npz", "--count", "200"],
        check=True,
        capture_output=True,
    )
    convert([work / "npz"], work / DATASET_NAMES[0], workers=1)
    for name in DATASET_NAMES[1:]:
        shutil.copytree(work / DATASET_NAMES[0], work / name)
    return work


def test_the_readme_has_the_snippets_this_test_runs() -> None:
    assert len(SNIPPETS) >= 4
    assert SNIPPETS[0][0] == "README.md"
    assert 'DataLoader(MmapDataset("data.mmap"), batch_size=64, shuffle=True, num_workers=8)' in SNIPPETS[0][1]
    assert {document for document, _ in SNIPPETS} >= {"README.md", "docs/pytorch.md", "docs/python.md"}


@pytest.mark.parametrize("number", range(len(SNIPPETS)), ids=[f"{d}-{k}" for k, (d, _) in enumerate(SNIPPETS)])
def test_documented_snippet_runs_on_the_example(example_dir: Path, number: int) -> None:
    document, snippet = SNIPPETS[number]
    prelude = TORCHRUN_PRELUDE if "init_process_group" in snippet else ""
    result = run_python(prelude + snippet + EPILOGUE, example_dir)
    assert result.returncode == 0, f"{document}, snippet {number + 1}:\n{snippet}\n{result.stderr}"
    if "loader" in snippet:
        assert re.search(r"^batches: [1-9]", result.stdout, re.M), result.stdout


BLOCK_TORCH = "import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"


def test_mmap_dataset_without_torch_says_what_to_install(tmp_path: Path) -> None:
    result = run_python(BLOCK_TORCH + "from npz2mmap import MmapDataset", tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "ImportError: npz2mmap.MmapDataset needs PyTorch, which is not installed in this Python: "
        f"{sys.executable} -m pip install torch"
    )


def test_the_converter_and_dir_work_without_torch(tmp_path: Path) -> None:
    code = BLOCK_TORCH + "import npz2mmap\nnpz2mmap.convert\nprint(' '.join(dir(npz2mmap)))"
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    import npz2mmap

    assert set(npz2mmap.__all__) <= set(result.stdout.split())


def test_every_object_of_the_api_page_is_importable_from_npz2mmap() -> None:
    """docs/api.md says so: Feature, which ds.features holds, was only in npz2mmap.read.features."""
    import importlib
    import inspect

    import npz2mmap

    shown = re.findall(r"^::: (\S+)$", (ROOT / "docs" / "api.md").read_text(), re.M)
    objects = [getattr(importlib.import_module(module), name) for module, _, name in (s.rpartition(".") for s in shown)]
    missing = [obj.__name__ for obj in objects if not inspect.ismodule(obj) and getattr(npz2mmap, obj.__name__, None) is not obj]
    assert len(objects) > 10 and missing == []


def test_the_example_says_why_its_first_epoch_is_slower(example_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, ROOT / "scripts" / "example.py", "load", example_dir / DATASET_NAMES[0]],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 0", "epoch 1"]
    assert all(", input batch (64, 3, 64, 64) (" in line for line in epochs)  # batch_size, not the short last
    assert epochs[0].endswith(
        " (cold: starts the 2 workers, which import torch, and reads the data from disk)"
    )
    assert epochs[1].endswith(" (warm: the workers are running and the data is in the page cache)")


def the_snippet_with(document: str, text: str) -> str:
    """The one snippet of ``document`` that contains ``text``."""
    [snippet] = [code for name, code in SNIPPETS if name == document and text in code]
    return snippet


@pytest.mark.parametrize("run", range(3))
def test_the_many_process_writer_snippet_merges_every_rank_under_torchrun(tmp_path: Path, run: int) -> None:
    (tmp_path / "write.py").write_text(the_snippet_with("docs/python.md", "part=(rank, world)"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*torchrun, "write.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    ds = MmapDataset(tmp_path / "shards.mmap", fields="x")
    expected = np.repeat(np.arange(1000, dtype=np.float32)[:, None], 4, axis=1)
    np.testing.assert_array_equal(np.stack([ds[i] for i in range(len(ds))]), expected)


def test_the_activation_block_gives_the_command_and_python_m(tmp_path: Path) -> None:
    """The README's block after the quick start, run in bash where the scripts put the environment."""
    [block] = [
        code
        for code in re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
        if "activate" in code
    ]
    venv = Path(os.environ.get("NPZ2MMAP_VENV", ROOT / ".venv"))
    if not (venv / "bin" / "activate").exists():
        pytest.skip(f"no environment at {venv}: scripts/test.sh makes it")
    script = block.replace("source .venv/bin/activate", f"source '{venv}/bin/activate'")
    done = subprocess.run(["bash", "-ec", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Usage: npz2mmap [OPTIONS] COMMAND [ARGS]...") == 1  # the console script's help
    assert "python -m npz2mmap" in block
    python_m = subprocess.run(
        [venv / "bin" / "python", "-m", "npz2mmap", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert python_m.stdout == done.stdout
