"""The CLI as a user meets it: click's runner and the real console script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT, SKIP_BAD_HINT, write_npz, write_samples

from npz2mmap import DatasetReader
from npz2mmap.cli.commands import cli

SCRIPT = Path(sys.executable).parent / "npz2mmap"


def run(*args: str) -> click.testing.Result:  # noqa: F821
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def sources(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    write_samples(
        tmp_path / "src",
        [
            {"input": rng.random((2, 3), dtype=np.float32), "label": np.int64(i), "tokens": np.arange(i + 2)}
            for i in range(4)
        ],
    )
    return tmp_path / "src"


def test_convert_inspect_verify(tmp_path, sources) -> None:
    out = tmp_path / "out"
    result = run("convert", sources, "-o", out, "--workers", "2")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Converted 4 samples, 3 fields, ")
    result = run("inspect", out)
    assert result.exit_code == 0
    assert "samples  4" in result.output
    assert "tokens  ragged  int64    (2..5,)" in result.output
    assert "input   fixed   float32  (2, 3)" in result.output
    summary = json.loads(run("inspect", out, "--json").output)
    assert summary["num_samples"] == 4 and [f["name"] for f in summary["fields"]] == [
        "input",
        "label",
        "tokens",
    ]
    sample = json.loads(run("inspect", out, "--sample", "-1", "--json").output)
    assert sample["sample"] == 3 and sample["fields"][1] == {
        "name": "label",
        "shape": [],
        "dtype": "int64",
        "min": 3,
        "max": 3,
        "mean": 3.0,
        "nan": 0,
        "inf": 0,
    }
    result = run("verify", out, "--sources")
    assert result.exit_code == 0
    assert result.output == f"OK: {out}: 4 samples verified (checksums, tables, padding and sources)\n"


def test_warm_reports_the_blob_resident(tmp_path, sources) -> None:
    run("convert", sources, "-o", tmp_path / "out")
    result = run("warm", tmp_path / "out", "-q")
    assert result.exit_code == 0
    size = (tmp_path / "out" / "data.npy").stat().st_size
    assert (
        result.output
        == f"{tmp_path / 'out' / 'data.npy'}: {size} B of {size} B resident in the page cache (100%)\n"
    )


def test_quiet_convert_prints_nothing(tmp_path, sources) -> None:
    result = run("convert", sources, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0 and result.output == ""


def test_bad_data_is_one_line_and_exit_1(tmp_path, sources) -> None:
    (sources / "s00002.npz").write_bytes(b"")
    result = run("convert", sources, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    assert result.output.startswith(f"Error: {sources / 's00002.npz'}: not a valid zip/npz file")
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(tmp_path, sources) -> None:
    for args, message in [
        (("convert", sources), "Missing option '-o' / '--output'"),
        (("convert", sources, "-o", tmp_path / "o", "--align", "100"), "must be a power of two"),
        (("convert", sources, "-o", tmp_path / "o", "--workers", "0"), "0 is not in the range x>=1"),
        (("convert", sources, "-o", tmp_path / "o", "--keys", ","), "give at least one key"),
        (  # it converted input alone, the empty key dropped without a word
            ("convert", sources, "-o", tmp_path / "o", "--keys", "input,"),
            "Invalid value for '--keys': 'input,' names an empty key: give keys between commas, "
            "e.g. --keys input,label",
        ),
        (  # it converted one field ' a', the second dropped without a word
            ("convert", sources, "-o", tmp_path / "o", "--keys", " a, a"),
            "Invalid value for '--keys': ' a, a' names ' a' twice: name each key once",
        ),
        (("convert", sources, "-o", tmp_path / "o", "--cast", "input"), "'input' is not KEY=DTYPE"),
        (
            ("convert", sources, "-o", tmp_path / "o", "--cast", "input=object"),
            "not a fixed-size, pickle-free dtype",
        ),
        (
            ("convert", sources, "-o", tmp_path / "o", "--cast", "input=float33"),
            "'float33' is not a numpy dtype",
        ),
        (  # numpy's own wording for a comma-separated dtype is not shown
            ("convert", sources, "-o", tmp_path / "o", "--cast", "input=0.1=f4x"),
            "Invalid value for '--cast': '0.1=f4x' is not a numpy dtype",
        ),
        (("convert", sources, "@", "-o", tmp_path / "o"), "Invalid value for 'INPUT...': '@' names no list file"),
        (("convert", sources, "-o", tmp_path / "o", "--cast", "zz=float32"), "--cast names key(s) 'zz' that are not"),
        (  # one option for two casts: the key would be 'input=f8,label'
            ("convert", sources, "-o", tmp_path / "o", "--cast", "input=f8,label=i8"),
            "not converted (--cast takes one KEY=DTYPE: give it once for each key)",
        ),
        (
            ("convert", sources, "-o", tmp_path / "o", "--cast", "input=int64", "--cast", "input=int32"),
            "'input=int64' and 'input=int32' cast 'input' two ways; give one",
        ),
    ]:
        result = run(*args)
        assert result.exit_code == 2, args
        assert message in result.output
        assert not (tmp_path / "o").exists()
    agreeing = run("convert", sources, "-o", tmp_path / "o", "--cast", "input=f4", "--cast", "input=float32", "-q")
    assert agreeing.exit_code == 0, agreeing.output  # one cast, said twice


def test_inspect_sample_out_of_range_is_a_usage_error(tmp_path, sources) -> None:
    run("convert", sources, "-o", tmp_path / "out")
    result = run("inspect", tmp_path / "out", "--sample", "4")
    assert result.exit_code == 2
    assert "sample index 4 is out of range for 4 samples" in result.output


def test_verify_failure_lists_problems_and_exits_1(tmp_path, sources) -> None:
    out = tmp_path / "out"
    run("convert", sources, "-o", out)
    blob = bytearray((out / "data.npy").read_bytes())
    blob[128 + 64 + 2] ^= 0xFF  # a byte of sample 0, after the header and the blob identity
    (out / "data.npy").write_bytes(bytes(blob))
    result = run("verify", out)
    assert result.exit_code == 1
    assert "field 'input': 1 sample does not match its checksum: 0" in result.output
    assert f"Error: {out}: 1 problem found" in result.output


def test_real_console_script_errors_without_traceback_unless_debug(tmp_path) -> None:
    missing = tmp_path / "missing"
    for command in ("inspect", "verify", "warm"):  # verify printed a problem line and a count besides
        result = subprocess.run([SCRIPT, command, missing], capture_output=True, text=True)
        assert result.returncode == 1
        assert result.stderr == f"Error: {missing}: no such dataset\n", command
    result = subprocess.run([SCRIPT, "--debug", "inspect", missing], capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "FormatError" in result.stderr


def test_real_console_script_converts_with_a_pool(tmp_path, sources) -> None:
    result = subprocess.run(
        [SCRIPT, "convert", sources, "-o", tmp_path / "out", "--workers", "2"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "index.json").exists()


def test_the_cli_never_imports_torch(tmp_path, sources) -> None:
    code = (
        "import sys\n"
        "from npz2mmap.cli.main import main\n"
        f"sys.argv = ['npz2mmap', 'convert', {str(sources)!r}, '-o', {str(tmp_path / 'o')!r}, '-q']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"sys.argv = ['npz2mmap', 'verify', {str(tmp_path / 'o')!r}, '-q']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_every_command_and_option_is_documented_in_the_command_reference() -> None:
    readme = (REPO_ROOT / "docs" / "cli.md").read_text()
    for name, command in cli.commands.items():
        assert f"## `npz2mmap {name}" in readme, name
        for param in command.params:
            for flag in param.opts:
                if flag.startswith("-") and flag != "--help":
                    assert f"`{flag}" in readme or f", {flag}" in readme, f"{name} {flag}"


SLOW_NUMPY_IMPORT = """
import os, sys, time

class SlowNumpy:
    '''Holds the first import of numpy for a while, so that Ctrl-C lands inside start-up.'''

    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            open(os.environ["STARTUP_MARKER"], "w").close()
            time.sleep(30)
        return None

sys.meta_path.insert(0, SlowNumpy())
"""


def test_ctrl_c_during_start_up_is_aborted_without_a_traceback(tmp_path, sources) -> None:
    """The console script imports click and numpy before a command runs; Ctrl-C then is clean too."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SLOW_NUMPY_IMPORT)
    marker = tmp_path / "importing-numpy"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]),
        "STARTUP_MARKER": str(marker),
    }
    process = subprocess.Popen(
        [SCRIPT, "convert", sources, "-o", tmp_path / "out"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists(), "the console script never imported numpy"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1
    assert stderr == "\nAborted!\n"
    assert not (tmp_path / "out").exists()


def run_script(*args: object, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SCRIPT, *map(str, args)], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("two\nlines.npz", "two\\nlines.npz"),
        ("carriage\rreturn.npz", "carriage\\rreturn.npz"),
        ("colour\x1b[31m.npz", "colour\\x1b[31m.npz"),
        ("line\u2028separator.npz", "line\\u2028separator.npz"),
        (os.fsdecode(b"undecodable\xff.npz"), "undecodable\\udcff.npz"),
    ],
)
def test_errors_are_one_line_whatever_a_path_holds(tmp_path, sources, name, shown) -> None:
    (sources / name).write_bytes(b"")
    result = run_script("convert", sources, "-o", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr == (
        f"Error: {sources}/{shown}: not a valid zip/npz file (File is not a zip file){SKIP_BAD_HINT}\n"
    )
    result = run_script("convert", sources, "-o", tmp_path / "out", "--skip-bad", "-q")
    assert result.returncode == 0
    assert result.stderr == (
        f"Warning: skipped 1 bad file, listed in {tmp_path / 'out' / 'skipped.jsonl'}; the first: "
        f"{sources}/{shown}: not a valid zip/npz file (File is not a zip file)\n"
    )
    result = run_script("inspect", sources / name)  # click's own usage error quotes the path too
    assert result.returncode == 2
    usage, hint, blank, error = result.stderr.split("\n")[:-1]
    assert usage.startswith("Usage: ") and hint.startswith("Try ") and blank == ""
    assert error.startswith(f"Error: Invalid value for 'OUT': Directory '{sources}/")
    assert error.endswith(".npz' is a file.")


def test_a_symlink_loop_in_an_input_directory_is_skipped_or_named_never_a_traceback(
    tmp_path, sources
) -> None:
    os.symlink("loop", sources / "loop")
    result = run_script("convert", sources, "-o", tmp_path / "out", "-q")
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads((tmp_path / "out" / "index.json").read_text())["num_samples"] == 4
    os.symlink("loop.npz", sources / "loop.npz")
    result = run_script("convert", sources, "-o", tmp_path / "out2", "-q")
    assert result.returncode == 1
    assert result.stderr == f"Error: {sources / 'loop.npz'}: a symbolic link loop, not a regular file\n"
    assert not (tmp_path / "out2").exists()


def test_part_auto_naming_a_part_that_does_not_exist_is_a_usage_error(tmp_path, sources) -> None:
    result = run_script(
        "convert", sources, "-o", tmp_path / "out", "--part", "auto", RANK="2", WORLD_SIZE="2"
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--part': RANK=2 and WORLD_SIZE=2: RANK must be from 0 to WORLD_SIZE - 1"
    )
    assert not (tmp_path / "out").exists()


def test_verify_problems_naming_a_source_with_a_newline_are_one_line_each(tmp_path) -> None:
    np.savez(tmp_path / "two\nlines.npz", x=np.arange(3))
    assert run_script("convert", tmp_path / "two\nlines.npz", "-o", tmp_path / "out", "-q").returncode == 0
    np.savez(tmp_path / "two\nlines.npz", x=np.arange(3) + 1)  # the source changed since
    result = run_script("verify", tmp_path / "out", "--sources", "-q")
    assert result.returncode == 1
    problem, error = result.stderr.splitlines()
    assert problem.startswith(f"sample 0 ({tmp_path}/two\\nlines.npz): field 'x': ")
    assert error == f"Error: {tmp_path / 'out'}: 1 problem found"


def test_inspect_sample_prints_integers_exactly(tmp_path) -> None:
    write_samples(
        tmp_path / "src", [{"big": np.array([3_000_000_001, 7], dtype=np.int64), "f": np.float32(0.5)}]
    )
    run("convert", tmp_path / "src", "-o", tmp_path / "ds", "-q")
    rows = {
        line.split()[0]: line.split()
        for line in run("inspect", tmp_path / "ds", "--sample", "0").output.splitlines()
    }
    assert rows["big"][-5:] == ["7", "3000000001", "1.5e+09", "0", "0"]
    assert rows["f"][-5:] == ["0.5", "0.5", "0.5", "0", "0"]


def test_list_files_may_start_with_a_bom_and_a_huge_one_is_refused(tmp_path, monkeypatch) -> None:
    write_samples(tmp_path / "src", [{"x": np.int64(1)}])
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfsrc/s00000.npz\n")
    assert run("convert", f"@{tmp_path / 'bom.txt'}", "-o", tmp_path / "out", "-q").exit_code == 0
    monkeypatch.setattr("npz2mmap.ingest.discover.MAX_LIST_CHARS", 10)
    result = run("convert", f"@{tmp_path / 'bom.txt'}", "-o", tmp_path / "out2", "-q")
    assert result.exit_code == 1
    assert result.output == f"Error: {tmp_path / 'bom.txt'}: list file is longer than 10 characters\n"


def test_errors_of_huge_lines_are_cut_to_one_readable_line() -> None:
    from npz2mmap.cli.click_support import MAX_LINE_CHARS, one_line

    line = one_line("x" * 10_000_000 + "\n")
    assert len(line) < MAX_LINE_CHARS + 10 and " ... " in line and line.endswith("\\n")


def test_closed_stderr_and_a_full_stdout_are_one_line_errors_or_silence(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"x": np.int64(1)}])
    assert run("convert", tmp_path / "src", "-o", tmp_path / "ds", "-q").exit_code == 0
    closed = subprocess.run(
        f"{SCRIPT} verify {tmp_path / 'ds'} 2>&-", shell=True, capture_output=True, text=True
    )
    assert closed.returncode == 0 and closed.stdout.startswith("OK: ")
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [SCRIPT, "verify", tmp_path / "ds"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert result.returncode == 1
    assert result.stderr == "Error: cannot write the output (No space left on device)\n"


def test_counts_of_one_read_in_the_singular(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"x": np.arange(3, dtype=np.int64)}])
    (tmp_path / "src" / "zbad.npz").write_bytes(b"not a zip")
    result = run_script("convert", tmp_path / "src", "-o", tmp_path / "ds", "--skip-bad")
    assert result.returncode == 0
    assert result.stderr.startswith(
        f"Warning: skipped 1 bad file, listed in {tmp_path / 'ds' / 'skipped.jsonl'}"
    )
    assert result.stdout.startswith(f"Converted 1 sample, 1 field, 24 B into {tmp_path / 'ds'} in ")
    result = run_script("verify", tmp_path / "ds")
    assert result.stdout == f"OK: {tmp_path / 'ds'}: 1 sample verified (checksums, tables, padding)\n"
    result = run_script("merge", tmp_path / "ds", "-o", tmp_path / "merged")
    assert result.stdout == f"Merged 1 part, 1 sample, into {tmp_path / 'merged' / 'manifest.json'}\n"
    blob = bytearray((tmp_path / "ds" / "data.npy").read_bytes())
    blob[128 + 64] ^= 0xFF  # the first byte of sample 0, after the header and the blob identity
    (tmp_path / "ds" / "data.npy").write_bytes(bytes(blob))
    result = run_script("verify", tmp_path / "ds", "-q")
    assert result.returncode == 1
    assert result.stderr == (
        f"field 'x': 1 sample does not match its checksum: 0\nError: {tmp_path / 'ds'}: 1 problem found\n"
    )


def test_progress_lines_name_a_single_item_in_the_singular() -> None:
    from npz2mmap.progress import LogProgress

    ticks = iter([0.0, 5.0])
    progress = LogProgress(clock=lambda: next(ticks))
    progress.stage("copy", 1, 0, unit="files")
    progress.advance(1, 0)
    assert progress.line(12.0, finished=True) == "copy: 1/1 file (100%), 0.1 files/s, done in 0:00:12"


def test_debug_after_the_command_shows_the_traceback(tmp_path, sources) -> None:
    missing = tmp_path / "missing"
    result = run_script("inspect", missing, "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == f"npz2mmap.errors.FormatError: {missing}: no such dataset"
    (tmp_path / "bad.npz").write_bytes(b"no zip")
    result = run_script("convert", sources, tmp_path / "bad.npz", "-o", tmp_path / "out", "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("npz2mmap.errors.SourceError: ")
    assert not (tmp_path / "out").exists()
    for command in ("convert", "inspect", "verify", "merge", "warm"):
        assert "--debug" in run(command, "--help").output


def test_main_help_shows_every_command_summary_whole() -> None:
    result = run("--help")
    assert result.exit_code == 0
    commands = " ".join(result.output.split("Commands:\n", 1)[1].split("  Examples:")[0].split())
    assert commands == (
        "convert Convert INPUT... into the dataset directory OUT. "
        "inspect Show a dataset's format, samples, size and fields. "
        "merge Join datasets into one at OUT: a manifest naming them, or with --copy one blob. "
        "verify Check a dataset's checksums and tables; exit 0 only if all is well. "
        "warm Load a dataset into this node's page cache and report how much is resident."
    )


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ("inspect", "{ds}", "--sample", "0", "--stats"),
            "--stats cannot be used with --sample, which shows the sample's min, max and mean",
        ),
        (
            ("inspect", "{ds}", "--sample", "0", "--stats", "--json"),
            "--stats cannot be used with --sample, which shows the sample's min, max and mean",
        ),
        (
            ("convert", "{src}", "-o", "{tmp}/out", "-q", "--progress", "bar"),
            "-q/--quiet shows no progress; it cannot be used with --progress bar",
        ),
        (
            ("verify", "{ds}", "--progress", "log", "-q"),
            "-q/--quiet shows no progress; it cannot be used with --progress log",
        ),
        (
            ("merge", "{ds}", "-o", "{tmp}/out", "-q", "--progress", "auto"),
            "-q/--quiet shows no progress; it cannot be used with --progress auto",
        ),
        (
            ("warm", "{ds}", "-q", "--progress", "bar"),
            "-q/--quiet shows no progress; it cannot be used with --progress bar",
        ),
    ],
)
def test_options_that_contradict_each_other_are_usage_errors(tmp_path, sources, command, message) -> None:
    assert run("convert", sources, "-o", tmp_path / "ds", "-q").exit_code == 0
    paths = {"ds": tmp_path / "ds", "src": sources, "tmp": tmp_path}
    result = run(*(part.format(**paths) for part in command))
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == f"Error: {message}"
    assert not (tmp_path / "out").exists()


def test_quiet_with_progress_none_is_no_contradiction(tmp_path, sources) -> None:
    result = run("convert", sources, "-o", tmp_path / "ds", "-q", "--progress", "none")
    assert (result.exit_code, result.output) == (0, "")
    result = run("verify", tmp_path / "ds", "--progress", "none", "-q")
    assert (result.exit_code, result.output) == (0, "")


def test_merge_names_what_it_wrote(tmp_path, sources) -> None:
    parts = [tmp_path / "ds" / f"part-0000{i}" for i in range(2)]
    for i in range(2):
        assert run("convert", sources, "-o", tmp_path / "ds", "--part", f"{i}/2", "-q").exit_code == 0
    result = run("merge", *parts, "-o", tmp_path / "copied", "--copy")
    assert result.exit_code == 0
    assert result.output == f"Merged 2 parts, 4 samples, into one dataset at {tmp_path / 'copied'}\n"
    assert sorted(os.listdir(tmp_path / "copied")) == [
        "data.npy",
        "index.json",
        "skipped.jsonl",
        "sources.jsonl",
    ]
    result = run("merge", *parts, "-o", tmp_path / "ds")
    assert result.exit_code == 0
    assert result.output == f"Merged 2 parts, 4 samples, into {tmp_path / 'ds' / 'manifest.json'}\n"
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["parts"] == [
        "part-00000",
        "part-00001",
    ]


def test_convert_notes_arrays_much_larger_than_their_compressed_sources(tmp_path) -> None:
    write_samples(tmp_path / "zipped", [{"x": np.zeros((1000, 1000), dtype=np.float32)}], compressed=True)
    sources_nbytes = (tmp_path / "zipped" / "s00000.npz").stat().st_size
    result = run("convert", tmp_path / "zipped", "-o", tmp_path / "ds")
    assert result.exit_code == 0
    assert result.output.splitlines()[1] == (
        f"Note: the dataset's 4.0 MB of arrays are {4_000_000 / sources_nbytes:,.0f} times the size of "
        f"their compressed sources, {sources_nbytes / 1000:.1f} kB: the dataset stores them uncompressed, "
        "so that they can be memory-mapped"
    )
    write_samples(tmp_path / "plain", [{"x": np.zeros((1000, 1000), dtype=np.float32)}])
    result = run("convert", tmp_path / "plain", "-o", tmp_path / "ds2")
    assert result.exit_code == 0 and len(result.output.splitlines()) == 1


def test_convert_refuses_a_dataset_larger_than_the_free_space_before_writing(tmp_path, monkeypatch) -> None:
    write_samples(tmp_path / "src", [{"x": np.zeros(100_000)} for _ in range(2)], compressed=True)
    assert run("convert", tmp_path / "src", "-o", tmp_path / "ref", "-q").exit_code == 0
    blob_nbytes = (tmp_path / "ref" / "data.npy").stat().st_size
    all_nbytes = sum(path.stat().st_size for path in (tmp_path / "ref").iterdir())
    real_disk_usage = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=blob_nbytes - 1)
    )
    result = run("convert", tmp_path / "src", "-o", tmp_path / "out")
    assert result.exit_code == 1
    needed = int(result.output.split(" the dataset needs ")[1].split(" bytes")[0].replace(",", ""))
    assert all_nbytes <= needed < all_nbytes + 200  # the blob and the files beside it; index.json at most
    assert result.output == (
        f"Error: {tmp_path / 'out'}: the dataset needs {needed:,} bytes ({needed / 1e6:.1f} MB), "
        f"{blob_nbytes - 1:,} bytes ({(blob_nbytes - 1) / 1e6:.1f} MB) free on its file system\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["ref", "src"]  # nothing written, no staging directory
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=needed))
    assert run("convert", tmp_path / "src", "-o", tmp_path / "out", "-q").exit_code == 0


def test_help_speaks_of_npy_files_too() -> None:
    top = run("--help").output
    assert "Convert many .npz or .npy files into one memory-mapped dataset for PyTorch." in top
    keys_help = " ".join(run("convert", "--help").output.split())
    assert (
        "--keys A,B Convert only these keys: NPZ member names, arr_0 for a .npy file, NAME for NAME.npy "
        "with --sample-dirs (default: all)."
    ) in keys_help


def test_a_missing_path_in_a_list_file_names_the_list_and_line(tmp_path) -> None:
    write_samples(tmp_path / "data", [{"x": np.arange(3)}])
    listed = sorted((tmp_path / "data").iterdir())[0].name
    (tmp_path / "list.txt").write_text(f"# train\ndata/{listed}\n\ndata/gone.npz\n")
    result = run("convert", f"@{tmp_path / 'list.txt'}", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2  # a usage mistake, as the docs call it
    assert result.output.splitlines()[-1] == (
        f"Error: {tmp_path / 'list.txt'}, line 4: {tmp_path / 'data' / 'gone.npz'}: no such file or directory"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--keys", "input", "--keys", "label"], "--keys given twice ('input' and 'label'): give it once"),
        (["--part", "0/2", "--part=1/2"], "--part given twice ('0/2' and '1/2'): give it once"),
        (["--align", "64", "--align", "128"], "--align given twice ('64' and '128'): give it once"),
        (["-o", "{out}2"], "--output given twice ('{out}' and '{out}2'): give it once"),
        (["-o{out}2"], "--output given twice ('{out}' and '{out}2'): give it once"),
    ],
)
def test_an_option_of_one_value_given_twice_is_a_usage_error_naming_both(tmp_path, sources, args, message) -> None:
    out = tmp_path / "o"
    args = [a.format(out=out) for a in args]
    result = run("convert", sources, "-o", out, *args)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == "Error: " + message.format(out=out)
    assert not os.listdir(tmp_path) or sorted(os.listdir(tmp_path)) == ["src"]


def test_merge_and_inspect_refuse_an_option_given_twice(tmp_path, sources) -> None:
    run("convert", sources, "-o", tmp_path / "d", "-q")
    inspected = run("inspect", tmp_path / "d", "--sample", "0", "--sample", "1")
    assert (inspected.exit_code, inspected.output.splitlines()[-1]) == (
        2,
        "Error: --sample given twice ('0' and '1'): give it once",
    )
    merged = run("merge", tmp_path / "d", "-o", tmp_path / "m1", "-o", tmp_path / "m2")
    assert merged.exit_code == 2 and not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    same_cast = run("convert", sources, "-o", tmp_path / "c", "--cast", "input=float32", "--cast", "input=>f4", "-q")
    assert same_cast.exit_code == 0, same_cast.output  # both store little-endian float32


@pytest.mark.parametrize("name", [" a.npz", "a.npz ", "\ta.npz"])
def test_a_list_line_names_its_path_with_its_spaces_never_a_trimmed_other(tmp_path, name) -> None:
    with open(tmp_path / name, "wb") as named:  # the file the list names (savez would add ".npz")
        np.savez(named, x=np.array([111]))
    write_npz(tmp_path / "a.npz", x=np.array([222]))  # a file of the trimmed name
    (tmp_path / "list.txt").write_text(f"  # comment\n   \n{name}\r\n")
    assert run("convert", f"@{tmp_path / 'list.txt'}", "-o", tmp_path / "out", "-q").exit_code == 0
    assert DatasetReader(tmp_path / "out").view("x", 0).tolist() == [111]
    assert [json.loads(line) for line in (tmp_path / "out" / "sources.jsonl").read_text().splitlines()] == [
        str(tmp_path / name)
    ]


def test_a_list_line_not_found_with_spaces_around_an_existing_path_says_so(tmp_path) -> None:
    write_npz(tmp_path / "a.npz", x=np.array([222]))
    (tmp_path / "list.txt").write_text(" a.npz\n")
    result = run("convert", f"@{tmp_path / 'list.txt'}", "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        f"Error: {tmp_path / 'list.txt'}, line 1: {tmp_path / ' a.npz'}: no such file or directory "
        "(the line has white space around 'a.npz', which exists: remove the white space to name it)"
    )


def test_keys_are_named_exactly_spaces_included(tmp_path) -> None:
    write_samples(tmp_path / "src", [{" y": np.array([2]), "y": np.array([3])} for _ in range(2)])
    assert run("convert", tmp_path / "src", "-o", tmp_path / "spaced", "-q", "--keys", " y").exit_code == 0
    assert DatasetReader(tmp_path / "spaced").field_names == (" y",)
    assert DatasetReader(tmp_path / "spaced").view(" y", 0).tolist() == [2]
    write_samples(tmp_path / "plain", [{"x": np.array([1]), "y": np.array([3])}])
    result = run("convert", tmp_path / "plain", "-o", tmp_path / "out", "-q", "--keys", "x, y")
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        f"Error: --keys names ' y', which no input file holds ({tmp_path / 'plain' / 's00000.npz'} has 'x', "
        "'y'): select keys the files hold"
    )


def test_inspect_shows_names_that_would_reorder_or_hide_text_escaped(tmp_path) -> None:
    hostile = "a\u202egpj.exe\u200b"  # a right-to-left override and a zero-width space
    write_samples(tmp_path / "src", [{hostile: np.arange(i + 1), "x": np.arange(3)} for i in range(3)])
    out = tmp_path / "out\u202e"  # its path lines too
    assert run("convert", tmp_path / "src", "-o", out, "-q").exit_code == 0
    result = run("inspect", out, "--stats")
    assert result.exit_code == 0
    assert "\u202e" not in result.output and "\u200b" not in result.output
    assert result.output.splitlines()[0] == f"dataset  {tmp_path}/out\\u202e"
    assert result.output.splitlines()[3].startswith(f"blob     {tmp_path}/out\\u202e/data.npy, ")
    shown = "a\\u202egpj.exe\\u200b"
    rows = [line for line in result.output.splitlines() if line.startswith(shown)]
    assert len(rows) == 3, result.output  # the fields table, the statistics table, the lengths line
    assert rows[2].startswith(f"{shown} lengths (first dimension): min 1, p50 2")
    described = json.loads(run("inspect", out, "--json").output)
    assert {f["name"] for f in described["fields"]} == {hostile, "x"}  # exact where scripts read it


def test_a_cast_names_a_key_holding_an_equals_sign_and_a_dtype_starting_with_one(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", **{"lr=0.1": np.array([0.5]), "x": np.arange(2, dtype=np.int32)})
    write_npz(tmp_path / "src" / "b.npz", **{"lr=0.1": np.array([0.25], "f4"), "x": np.arange(2, dtype=np.int16)})
    result = run("convert", tmp_path / "src", "-o", tmp_path / "out", "--cast", "lr=0.1=float32", "--cast", "x==i4", "-q")
    assert result.exit_code == 0, result.output
    reader = DatasetReader(tmp_path / "out")
    assert reader.column("lr=0.1").dtype == np.dtype("<f4") and reader.column("x").dtype == np.dtype("<i4")
    assert reader.column("lr=0.1").tolist() == [[0.5], [0.25]]


def test_a_missing_input_is_a_usage_mistake_exit_2_and_each_command_shows_examples(tmp_path) -> None:
    result = run("convert", str(tmp_path / "nothere"), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "Usage: cli convert -o OUT [OPTIONS] INPUT...",
        "Try 'cli convert --help' for help.",
        "",
        f"Error: {tmp_path / 'nothere'}: no such file or directory",
    ]
    for command, usage in [
        ("convert", "convert -o OUT [OPTIONS] INPUT..."),
        ("merge", "merge -o OUT [OPTIONS] PART..."),
        ("inspect", "inspect [OPTIONS] OUT"),
        ("verify", "verify [OPTIONS] OUT"),
        ("warm", "warm [OPTIONS] OUT"),
    ]:
        shown = run(command, "--help").output
        assert shown.startswith(f"Usage: cli {usage}\n"), shown
        examples = shown.split("  Examples:\n")[1].splitlines()
        assert examples and all(line.startswith(f"    npz2mmap {command} ") for line in examples), shown
        assert "DIRECTORY" not in shown and "DATASET" not in shown
    assert "  Examples:\n    npz2mmap convert data/ -o data.mmap\n" in run("--help").output
    missing_list = run("convert", f"@{tmp_path / 'nolist.txt'}", "-o", str(tmp_path / "out"))
    assert missing_list.exit_code == 2
    assert missing_list.output.splitlines()[-1] == f"Error: {tmp_path / 'nolist.txt'}: no such list file"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["convert", "a.npz", "-o", ""], "Error: Invalid value for '-o' / '--output': an empty path"),
        (["merge", "a", "-o", ""], "Error: Invalid value for '-o' / '--output': an empty path"),
        (["verify", ""], "Error: Invalid value for 'OUT': an empty path"),
        (["inspect", ""], "Error: Invalid value for 'OUT': an empty path"),
        (["merge", "", "-o", "m"], "Error: Invalid value for 'PART...': an empty path"),
        (["convert", "", "-o", "out"], "Error: an empty INPUT (an unset shell variable?)"),
    ],
)
def test_an_empty_path_is_a_usage_mistake(tmp_path, monkeypatch, args, message) -> None:
    """-o "$OUT" with OUT unset said "Error: : cannot write the dataset" and exited 1."""
    monkeypatch.chdir(tmp_path)
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1].startswith(message)
    assert "unset shell variable" in result.output.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_merge_part_is_a_usage_mistake_as_a_missing_convert_input_is(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("merge", "nothere", "-o", "m")
    assert (result.exit_code, result.output.splitlines()[-1]) == (2, "Error: nothere: no such dataset")
    assert list(tmp_path.iterdir()) == []


def test_an_input_that_names_a_path_starting_with_at_says_how_to_type_it(tmp_path, monkeypatch) -> None:
    """'@x', a directory of that name, said only "x: no such list file"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "@x").mkdir()
    np.savez(tmp_path / "@x" / "a.npz", v=np.arange(3))
    result = run("convert", "@x", "-o", "out")
    assert (result.exit_code, result.output.splitlines()[-1]) == (
        2, "Error: x: no such list file (to convert the path @x, type ./@x)"
    )
    assert run("convert", "./@x", "-o", "out", "-q").exit_code == 0


def test_a_npy_a_pattern_matches_with_sample_dirs_is_a_usage_mistake_as_one_typed(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for sample in ("s0", "s1"):
        (tmp_path / "d" / sample).mkdir(parents=True)
        np.save(tmp_path / "d" / sample / "x.npy", np.arange(3))
    message = (
        "Error: d/s0/x.npy: a .npy file named with --sample-dirs, where each sample is a directory "
        "of .npy files; name its directory instead"
    )
    for typed in ("d/s0/x.npy", "d/*/x.npy"):
        result = run("convert", typed, "-o", "out", "--sample-dirs")
        assert (result.exit_code, result.output.splitlines()[-1]) == (2, message), typed
