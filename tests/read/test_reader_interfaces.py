"""DatasetReader as Python code meets it: a repr that says what it is, a schema, and pickling."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT

import npz2mmap
from npz2mmap import DatasetReader


def written(tmp_path) -> str:
    out = str(tmp_path / "ds")
    with npz2mmap.Writer(out) as writer:
        for k in range(3):
            writer.append({"image": np.full((2, 3), k, np.uint8), "boxes": np.zeros((k, 4), np.float32)})
    return out


def test_a_reader_shows_its_path_size_and_fields_and_its_schema(tmp_path) -> None:
    reader = DatasetReader(written(tmp_path))
    assert repr(reader) == f"DatasetReader({str(tmp_path / 'ds')!r}, samples=3, fields=['boxes', 'image'])"
    features = reader.features
    assert list(features) == ["boxes", "image"]
    assert (features["image"].dtype, features["image"].shape, features["image"].ragged) == (
        np.dtype(np.uint8), (2, 3), False
    )
    assert (features["boxes"].dtype, features["boxes"].shape, features["boxes"].ragged) == (
        np.dtype(np.float32), (None, 4), True
    )
    assert features["boxes"].ndim == 2
    assert repr(features["boxes"]) == "Feature(dtype=float32, shape=(None, 4))"
    assert repr(features["image"]) == "Feature(dtype=uint8, shape=(2, 3))"


def test_a_reader_pickles_as_its_recipe_and_maps_the_blob_again_where_loaded(tmp_path) -> None:
    """It raised "cannot pickle 'mmap.mmap' object", which broke datasets.Dataset.from_generator."""
    reader = DatasetReader(written(tmp_path))
    pickled = pickle.dumps(reader)
    assert len(pickled) < 4096  # the recipe, not the data
    again = pickle.loads(pickled)
    assert [again.view("image", k).tolist() for k in range(3)] == [reader.view("image", k).tolist() for k in range(3)]
    code = "import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); print(r.view('image', 2).sum())"
    result = subprocess.run(
        [sys.executable, "-c", code], input=pickled, capture_output=True, env={"PYTHONPATH": str(REPO_ROOT)}
    )
    assert (result.returncode, result.stdout) == (0, b"12\n"), result.stderr


def test_opening_a_dataset_a_writer_is_writing_says_so(tmp_path) -> None:
    """It said "no such dataset", as for a typo."""
    import pytest
    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli
    from npz2mmap.errors import FormatError

    out = str(tmp_path / "ds")
    message = (
        f"{out}: no such dataset yet: a conversion, Writer or merge is writing it (or one was stopped: its "
        "hidden files are beside it); open it once that has finished"
    )
    with npz2mmap.Writer(out) as writer:
        writer.append({"x": np.zeros(2)})
        with pytest.raises(FormatError) as refused:
            DatasetReader(out)
        assert str(refused.value) == message
        result = CliRunner().invoke(cli, ["inspect", out])
        assert (result.exit_code, result.output) == (1, f"Error: {message}\n")
    assert len(DatasetReader(out)) == 1
    with pytest.raises(FormatError) as refused:
        DatasetReader(str(tmp_path / "typo"))
    assert str(refused.value) == f"{tmp_path / 'typo'}: no such dataset"


def test_a_reader_loaded_from_its_pickle_refuses_a_dataset_written_again_since(tmp_path) -> None:
    """It pickled as its path alone: a copy loaded after the dataset was written again read the
    new data (and Hugging Face's cache, keyed by that pickle, kept the old rows for it)."""
    out = written(tmp_path)
    pickled = pickle.dumps(DatasetReader(out))
    assert pickle.loads(pickled).view("image", 2).tolist() == [[2] * 3] * 2
    with npz2mmap.Writer(out, overwrite=True) as writer:
        writer.append({"image": np.full((2, 3), 9, np.uint8), "boxes": np.zeros((1, 4), np.float32)})
    with pytest.raises(npz2mmap.errors.FormatError, match="does not belong to the index read"):
        pickle.loads(pickled)
    assert pickled != pickle.dumps(DatasetReader(out))
