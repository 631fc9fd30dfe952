"""verify as a user reads it: repeated problems capped, labels not taken for missing files, --json."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz

import npz2mmap
from npz2mmap.cli.commands import cli


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("merged", [None, "manifest", "copy"])
def test_labels_a_writer_was_given_as_source_are_not_compared_not_problems(tmp_path, merged) -> None:
    """The README's Writer example (source=f"generated/{i}") gave one "No such file" line per sample;
    merged into a manifest, its labels went uncounted, and the summary said sources were compared."""
    out = tmp_path / "ds"
    with npz2mmap.Writer(out) as writer:
        for i in range(30):
            writer.append({"x": np.arange(3)}, source=f"generated/{i}")
        writer.append({"x": np.arange(3)})
    if merged is not None:
        npz2mmap.merge([out], tmp_path / "merged", copy=merged == "copy")
        out = tmp_path / "merged"
    result = run("verify", out, "--sources")
    assert (result.exit_code, result.output) == (
        0,
        f"OK: {out}: 31 samples verified (checksums, tables, padding); 1 sample of 31 names no source "
        "(appended by npz2mmap.Writer without source=) and was not compared; 30 samples of 31 name as "
        "source a label, a file of no sample or one other samples share (npz2mmap.Writer's source=), and "
        "were not compared\n",
    )
    report = json.loads(run("verify", out, "--sources", "--json").output)
    assert report == {
        "path": str(out), "ok": True, "num_samples": 31, "problems": [], "sources_checked": True,
        "samples_without_source": 1, "samples_with_a_label_as_source": 30,
    }


def test_a_writer_source_of_no_sample_of_its_own_is_not_compared_and_a_gone_npz_is_a_problem(
    tmp_path, monkeypatch
) -> None:
    """Every row of a shard given source='shard.npz', a .jpg, '.' and an absolute label each
    failed verify --sources once sources naming files were recorded absolute."""
    monkeypatch.chdir(tmp_path)
    np.savez("shard.npz", x=np.arange(12).reshape(4, 3))
    (tmp_path / "img.jpg").write_bytes(b"\xff\xd8 not a sample")
    with np.load("shard.npz") as shard:
        rows = shard["x"]
    with npz2mmap.Writer(tmp_path / "ds") as writer:
        for row in rows:
            writer.append({"x": row}, source="shard.npz")  # the rows of one file
        writer.append({"x": rows[0]}, source="img.jpg")
        writer.append({"x": rows[0]}, source=".")
        writer.append({"x": rows[0]}, source="/data/raw/img_0001.jpg")  # named nothing here
        writer.append({"x": rows[0]}, source=str(tmp_path / "gone.npz"))  # named nothing: compared
    report = json.loads(run("verify", tmp_path / "ds", "--sources", "--json").output.split("\nError: ")[0])
    assert report["samples_with_a_label_as_source"] == 7
    assert report["problems"] == [f"sample 7 ({tmp_path / 'gone.npz'}): {tmp_path / 'gone.npz'}: No such file or directory"]


def test_many_problems_are_capped_with_a_count_and_listed_whole_in_json(tmp_path) -> None:
    for i in range(15):
        write_npz(tmp_path / "src" / f"{i:02d}.npz", x=np.arange(3) + i)
    npz2mmap.convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    for i in range(15):  # every source changed since: one problem per sample
        write_npz(tmp_path / "src" / f"{i:02d}.npz", x=np.arange(3) - i - 1)
    result = run("verify", tmp_path / "ds", "--sources", "-q")
    lines = result.output.splitlines()
    assert result.exit_code == 1
    assert len(lines) == 12 and all(line.startswith("sample ") for line in lines[:10])
    assert lines[10:] == [
        "... and 5 more problems (--json lists them all)",
        f"Error: {tmp_path / 'ds'}: 15 problems found",
    ]
    result = run("verify", tmp_path / "ds", "--sources", "--json")
    report = json.loads(result.output.split("\nError: ")[0])
    assert result.exit_code == 1 and not report["ok"] and len(report["problems"]) == 15


def test_convert_json_is_the_summary_a_script_reads(tmp_path) -> None:
    for i in range(3):
        write_npz(tmp_path / "src" / f"{i}.npz", x=np.arange(i + 1, dtype=np.int64))
    (tmp_path / "src" / "bad.npz").write_bytes(b"")
    result = CliRunner().invoke(  # click keeps stdout apart: the warning goes to stderr
        cli, ["convert", str(tmp_path / "src"), "-o", str(tmp_path / "ds"), "--skip-bad", "--json"]
    )
    assert result.exit_code == 0
    summary = json.loads(result.stdout)
    assert summary["out_dir"] == str(tmp_path / "ds") and summary["num_samples"] == 3
    assert summary["fields"] == ["x"] and summary["data_nbytes"] == 48
    assert [item["path"] for item in summary["skipped"]] == [str(tmp_path / "src" / "bad.npz")]
    assert summary["nearly_fixed"] == [] and set(summary) == {
        "out_dir", "num_samples", "fields", "data_nbytes", "sources_nbytes", "seconds", "skipped", "nearly_fixed"
    }


def test_shell_completion_is_clicks_and_completes_the_commands(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "_NPZ2MMAP_COMPLETE": "bash_source"}
    script = subprocess.run([sys.executable, "-m", "npz2mmap"], env=env, capture_output=True, text=True)
    assert script.returncode == 0 and "_npz2mmap_completion" in script.stdout
    env.update(_NPZ2MMAP_COMPLETE="bash_complete", COMP_WORDS="npz2mmap co", COMP_CWORD="1")
    words = subprocess.run([sys.executable, "-m", "npz2mmap"], env=env, capture_output=True, text=True)
    assert "plain,convert" in words.stdout.splitlines()


def test_inspect_names_the_files_left_out_and_a_samples_source(tmp_path) -> None:
    for i in range(3):
        write_npz(tmp_path / "src" / f"{i}.npz", x=np.arange(i + 1))
    (tmp_path / "src" / "bad.npz").write_bytes(b"")
    npz2mmap.convert([tmp_path / "src"], tmp_path / "ds", workers=1, skip_bad=True)
    shown = run("inspect", tmp_path / "ds").output.splitlines()
    assert shown[4] == (
        "skipped  1 file left out by --skip-bad (skipped.jsonl); the first: "
        f"{tmp_path / 'src' / 'bad.npz'}: not a valid zip/npz file (File is not a zip file)"
    )
    summary = json.loads(run("inspect", tmp_path / "ds", "--json").output)
    assert summary["skipped"] == {
        "count": 1,
        "first": [{"path": str(tmp_path / "src" / "bad.npz"),
                   "reason": f"{tmp_path / 'src' / 'bad.npz'}: not a valid zip/npz file (File is not a zip file)"}],
    }
    assert run("inspect", tmp_path / "ds", "--sample", "2").output.splitlines()[0] == (
        f"sample 2 (from {tmp_path / 'src' / '2.npz'})"
    )
    assert json.loads(run("inspect", tmp_path / "ds", "--sample", "-1", "--json").output)["source"] == str(
        tmp_path / "src" / "2.npz"
    )
    np.save(tmp_path / "rows.npy", np.arange(12).reshape(4, 3))
    npz2mmap.convert([tmp_path / "rows.npy"], tmp_path / "rows", workers=1, rows=True)
    assert run("inspect", tmp_path / "rows", "--sample", "2").output.splitlines()[0] == (
        f"sample 2 (from {tmp_path / 'rows.npy'}, row 2)"
    )


def test_a_writers_source_naming_a_file_is_recorded_absolute_and_missed_once_gone(tmp_path, monkeypatch) -> None:
    """A relative source= naming a real file passed as a "label" once that file was gone, and a label
    naming something in the working directory made verify fail: the verdict hung on the cwd."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "s1.npz", x=np.arange(3))
    with npz2mmap.Writer("ds") as writer:
        writer.append({"x": np.arange(3)}, source="s1.npz")  # a file: recorded absolute
        writer.append({"x": np.arange(3)}, source="clip.mp4")  # no file: a label
    assert (tmp_path / "ds" / "sources.jsonl").read_text().splitlines() == [
        json.dumps(str(tmp_path / "s1.npz")), '"clip.mp4"'
    ]
    (tmp_path / "clip.mp4").write_text("a file that happens to bear the label's name")
    assert run("verify", "ds", "--sources", "-q").exit_code == 0
    (tmp_path / "s1.npz").unlink()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = run("verify", tmp_path / "ds", "--sources", "--json")
    report = json.loads(result.output.split("\nError: ")[0])
    assert result.exit_code == 1 and not report["ok"] and report["samples_with_a_label_as_source"] == 1
    assert len(report["problems"]) == 1 and str(tmp_path / "s1.npz") in report["problems"][0]


def test_a_multi_part_reports_counts_are_its_parts_counts_summed(tmp_path) -> None:
    """Every count of the report, those added later included: the labels' count went missing."""
    import dataclasses

    from npz2mmap.check.verify import VerifyReport, verify

    parts = []
    for p, (labelled, unsourced) in enumerate([(2, 1), (0, 3), (4, 0)]):
        parts.append(tmp_path / f"p{p}")
        with npz2mmap.Writer(parts[-1]) as writer:
            for i in range(labelled):
                writer.append({"x": np.arange(3)}, source=f"made/{i}")
            for _ in range(unsourced):
                writer.append({"x": np.arange(3)})
    npz2mmap.merge(parts, tmp_path / "all")
    whole, each = verify(tmp_path / "all", sources=True), [verify(part, sources=True) for part in parts]
    counts = [f.name for f in dataclasses.fields(VerifyReport) if f.type in ("int", int)]
    assert {"num_samples", "unsourced", "labelled"} <= set(counts)
    assert {name: getattr(whole, name) for name in counts} == {
        name: sum(getattr(one, name) for one in each) for name in counts
    }
