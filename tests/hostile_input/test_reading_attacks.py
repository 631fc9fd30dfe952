"""What an outside attack on the reading side found: each is a FormatError, TypeError or ValueError
with a clear message, never a traceback from deeper down."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import rewrite_index, write_samples

from npz2mmap import MmapDataset, PaddedCollate
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.write.conversion import convert


@pytest.fixture
def dataset(tmp_path):
    samples = [{"x": np.arange(n, dtype=np.int32), "y": np.int64(n)} for n in (1, 3, 2)]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    return tmp_path / "ds"


@pytest.mark.parametrize("bad_part", ["x\u0000y", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_manifest_naming_a_path_no_system_can_take_is_a_format_error(tmp_path, dataset, bad_part) -> None:
    manifest = tmp_path / "m" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"format": "npz2mmap-parts", "version": 1, "parts": ["../ds", bad_part]}))
    with pytest.raises(FormatError, match="is not a valid file name"):
        MmapDataset(manifest.parent)
    for command in (["inspect"], ["verify"], ["warm"], ["merge", "-o", str(tmp_path / "out"), "--copy"]):
        result = CliRunner().invoke(cli, [command[0], str(manifest.parent), *command[1:]])
        lines = result.output.splitlines()
        assert result.exit_code == 1 and lines[-1].startswith("Error: "), (command, result.output)
        assert "is not a valid file name" in result.output and "Traceback" not in result.output
        assert len(lines) == (2 if command == ["verify"] else 1)  # verify: the problem, then its verdict
    with pytest.raises(FormatError, match="is not a valid file name"):
        MmapDataset([dataset, "x\0"])


def test_a_field_name_that_is_not_text_is_refused_at_open(dataset) -> None:
    rewrite_index(dataset, lambda d: d["fields"][0].update(name="\ud800"))
    with pytest.raises(FormatError, match="field name .* is not valid text"):
        MmapDataset(dataset)
    result = CliRunner().invoke(cli, ["inspect", str(dataset)])
    assert result.exit_code == 1 and result.output.count("\n") == 1


@pytest.mark.parametrize("nbytes", [3, 4])
def test_ragged_data_of_no_samples_holds_no_bytes(tmp_path, nbytes) -> None:
    write_samples(tmp_path / "src", [{"x": np.zeros((0, 2), np.int32)}])
    convert([tmp_path / "src"], tmp_path / "ds", rows=True, workers=1)
    rewrite_index(tmp_path / "ds", lambda d: d["fields"][0]["data"].update(nbytes=nbytes))
    with pytest.raises(
        FormatError, match=f"data holds {nbytes} bytes, not whole 4-byte elements of 0 samples"
    ):
        MmapDataset(tmp_path / "ds")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ds"), "--stats"])
    assert result.exit_code == 1 and result.output.count("\n") == 1


def test_bool_tensors_and_two_dimensional_index_arrays_are_not_indices(dataset) -> None:
    ds = MmapDataset(dataset)
    with pytest.raises(TypeError, match="not an integer"):
        ds[torch.tensor(True)]
    with pytest.raises(TypeError, match="not an integer"):
        ds.__getitems__(list(torch.tensor([True, False])))
    with pytest.raises(TypeError, match=r"one-dimensional, not of shape \(2, 1\)"):
        ds.__getitems__(np.array([[0], [1]]))
    assert ds[torch.tensor(2)]["y"] == 2


def test_nested_collation_of_samples_ragged_beyond_the_first_dimension_says_what_to_do(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"p": np.zeros(s, np.float32)} for s in ((0, 5), (3, 0), (2, 2))])
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    batch = MmapDataset(tmp_path / "ds").__getitems__([0, 1, 2])
    with pytest.raises(ValueError, match="'p' differs beyond its first dimension; .* \\(nested=False\\)"):
        PaddedCollate(nested=True)(batch)
    assert PaddedCollate()(batch)["p"].shape == (3, 3, 5)


def test_padding_to_a_batch_numpy_cannot_make_is_a_value_error() -> None:
    arrays = [np.zeros((2**60, 0), np.float32), np.zeros((0, 2**60), np.float32)]
    with pytest.raises(
        ValueError, match=r"field 'p': a batch padded to \(2, 1152921504606846976, 1152921504606846976\)"
    ):
        PaddedCollate(ragged=["p"])([{"p": a} for a in arrays])


@pytest.mark.parametrize("descr", ["9" * 5000, [["a", "9" * 5000]], "i4," * 30])
def test_a_type_string_numpy_would_parse_as_a_huge_number_is_a_format_error(dataset, descr) -> None:
    rewrite_index(dataset, lambda d: d["fields"][0].update(dtype=descr))
    with pytest.raises(FormatError, match="is not a valid numpy descr"):
        MmapDataset(dataset)
