"""Files that disagree: one run names every one of them, and the cast it suggests succeeds."""

from __future__ import annotations

import os
import re
import shlex

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SKIP_BAD_HINT, write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap.cli.commands import cli
from npz2mmap.errors import MismatchError
from npz2mmap.write.conversion import convert


def convert_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["convert", "-q", "--workers", "1", *args])
    return result.exit_code, result.output


def test_every_file_that_disagrees_is_named_in_one_run_with_a_cast_that_holds_them_all(tmp_path) -> None:
    src = tmp_path / "src"
    dtypes = ["float32", "float64", "float32", "int32", "float64", "float32", "float64"]
    for k, dtype in enumerate(dtypes):
        write_npz(src / f"{k}.npz", image=np.zeros(2, dtype))
    with pytest.raises(MismatchError) as refused:
        convert([src], tmp_path / "out", workers=1)
    first = src / "0.npz"
    assert str(refused.value) == (
        f"4 files disagree with the first, {first}: "
        f"{src / '1.npz'}[image]: dtype float64 differs from float32 in {first}; "
        f"{src / '3.npz'}[image]: dtype int32 differs from float32 in {first}; "
        f"{src / '4.npz'}[image]: dtype float64 differs from float32 in {first}; "
        "and 1 more; use --cast image=float64 to store one dtype"
    )
    assert not (tmp_path / "out").exists()
    code, output = convert_cli(str(src), "-o", str(tmp_path / "out"), "--cast", "image=float64")
    assert (code, output) == (0, "")  # the cast suggested succeeds


@pytest.mark.parametrize(
    ("first", "other", "suggested"),
    [("uint8", "float32", "float32"), ("float32", "uint8", "float32"), ("int64", "int8", "int64")],
)
def test_the_cast_suggested_is_one_every_file_allows(tmp_path, first, other, suggested) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(2, first))
    write_npz(tmp_path / "src" / "b.npz", x=np.zeros(2, other))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert code == 1 and output.endswith(f"; use --cast x={suggested} to store one dtype\n")
    assert convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", f"x={suggested}")[0] == 0


def test_a_cast_refused_suggests_one_that_succeeds(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", image=np.zeros(2, np.uint8))
    write_npz(tmp_path / "src" / "b.npz", image=np.zeros(2, np.float32))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", "image=uint8")
    assert (code, output) == (
        1,
        f"Error: {tmp_path / 'src' / 'b.npz'}[image]: dtype float32 cannot be cast to uint8 without changing "
        "kind; use --cast image=float32 to store one dtype\n",
    )


def test_where_no_cast_holds_both_the_message_says_what_else_to_do(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(2, np.uint8), y=np.int64(0))
    write_npz(tmp_path / "src" / "b.npz", x=np.array(["ab"]), y=np.int64(1))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert (code, output) == (
        1,
        f"Error: {tmp_path / 'src' / 'b.npz'}[x]: dtype <U2 differs from uint8 in {tmp_path / 'src' / 'a.npz'}; "
        "uint8 and <U2 share no dtype --cast could store them as (it keeps their kind): convert such files "
        "apart, or leave x out with --keys\n",
    )


def test_a_truncated_zip_is_called_truncated_and_the_way_past_it_named(tmp_path) -> None:
    good = write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    cut = tmp_path / "src" / "b.npz"
    cut.write_bytes(good.read_bytes()[:100])
    (tmp_path / "src" / "c.npz").write_bytes(b"plain text, no zip at all")
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert (code, output) == (
        1,
        f"Error: {cut}: not a valid zip/npz file: truncated (it starts as a zip does, but its end, the zip's "
        f"directory, is missing; 100 bytes){SKIP_BAD_HINT}\n",
    )
    cut.unlink()
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert output == f"Error: {tmp_path / 'src' / 'c.npz'}: not a valid zip/npz file (File is not a zip file){SKIP_BAD_HINT}\n"


def test_files_that_disagree_then_a_bad_file_are_all_named(tmp_path) -> None:
    src = tmp_path / "src"
    write_npz(src / "0.npz", x=np.zeros(2, np.float32))
    write_npz(src / "1.npz", x=np.zeros(2, np.float64))
    (src / "2.npz").write_bytes(b"")
    code, output = convert_cli(str(src), "-o", str(tmp_path / "out"))
    assert (code, output) == (
        1,
        f"Error: {src / '1.npz'}[x]: dtype float64 differs from float32 in {src / '0.npz'}; use --cast "
        f"x=float64 to store one dtype; then the scan stopped at {src / '2.npz'}: not a valid zip/npz file "
        f"(File is not a zip file){SKIP_BAD_HINT}\n",
    )


def test_messages_name_the_inputs_files_as_the_user_typed_them(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "data" / "train" / "0.npz", x=np.zeros(2, np.float32))
    write_npz(tmp_path / "data" / "train" / "1.npz", x=np.zeros(2, np.float64))
    os.mkdir("elsewhere")
    for typed in ["data/train", "data/train/", "./data/train", "data/../data/train", str(tmp_path / "data/train")]:
        code, output = convert_cli(typed, "-o", "out")
        shown = typed.rstrip("/")
        assert (code, output) == (
            1,
            f"Error: {shown}/1.npz[x]: dtype float64 differs from float32 in {shown}/0.npz; "
            "use --cast x=float64 to store one dtype\n",
        ), typed
    monkeypatch.chdir("elsewhere")
    code, output = convert_cli("../data/train/0.npz", "../data/train/1.npz", "-o", "out")
    assert output == (
        "Error: ../data/train/1.npz[x]: dtype float64 differs from float32 in ../data/train/0.npz; "
        "use --cast x=float64 to store one dtype\n"
    )
    (tmp_path / "data" / "train" / "1.npz").write_bytes(b"")
    code, output = convert_cli("../data", "-o", "out", "--skip-bad")
    assert output.startswith(
        "Warning: skipped 1 bad file, listed in out/skipped.jsonl; the first: ../data/train/1.npz: not a valid"
    )
    assert str(tmp_path) in (tmp_path / "elsewhere" / "out" / "skipped.jsonl").read_text()  # the file: absolute


@pytest.mark.parametrize("empty_name", ["0.npz", "b.npz"])  # first, or among the others
def test_an_npz_holding_no_arrays_is_a_bad_file_wherever_it_sorts(tmp_path, empty_name) -> None:
    """It was "keys differ ... select common keys with --keys", which then failed again, and --skip-bad
    never left it out, though the docs list such files among the bad ones."""
    src = tmp_path / "src"
    for name in ["a.npz", "c.npz"]:
        write_npz(src / name, x=np.arange(3))
    np.savez(src / empty_name)
    for options in [[], ["--keys", "x"]]:
        code, output = convert_cli(str(src), "-o", str(tmp_path / "out"), *options)
        assert (code, output) == (1, f"Error: {src / empty_name}: holds no arrays{SKIP_BAD_HINT}\n")
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "out"), "--skip-bad", "-q"])
    assert result.exit_code == 0 and result.output.startswith("Warning: skipped 1 bad file")
    assert (tmp_path / "out" / "skipped.jsonl").read_text().count(f"{empty_name}: holds no arrays") == 1


def test_a_cast_of_real_values_to_complex_warns_of_nothing(tmp_path) -> None:
    """numpy's ComplexWarning of the check that the cast loses nothing reached the user's stderr."""
    import warnings

    from npz2mmap.check.verify import verify
    from npz2mmap.read.reader import DatasetReader

    write_npz(tmp_path / "src" / "a.npz", x=np.array([1.5, -2.0], np.float32))
    write_npz(tmp_path / "src" / "b.npz", x=np.array([3.0, 0.25], np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert([tmp_path / "src"], tmp_path / "out", workers=1, casts={"x": "complex64"})
        assert verify(tmp_path / "out", sources=True).ok
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("x", i).tolist() for i in range(2)] == [[1.5 + 0j, -2 + 0j], [3 + 0j, 0.25 + 0j]]


def test_a_record_value_a_cast_would_change_is_shown_apart_from_what_it_would_become(tmp_path) -> None:
    """numpy prints a float32 record field as it prints the float64 one: "(0.1,) ... stored as (0.1,)"."""
    write_npz(tmp_path / "src" / "0.npz", x=np.array([(0,)], [("a", "<f4")]))
    write_npz(tmp_path / "src" / "1.npz", x=np.array([(0.1,)], [("a", "<f8")]))
    with pytest.raises(MismatchError) as refused:
        convert([tmp_path / "src"], tmp_path / "out", casts={"x": [("a", "<f4")]}, workers=1)
    assert str(refused.value) == (
        f"{tmp_path / 'src' / '1.npz'}[x]: value (0.1,) at index (0,) does not survive the cast to "
        "[('a', '<f4')]: it would be stored as (0.10000000149011612,) (--cast keeps only values that "
        "[('a', '<f4')] represents exactly)"
    )


@pytest.mark.parametrize(
    ("stored", "cast", "why"),
    [
        (np.array([7, 12345], np.int64), "U8", "without changing kind"),  # 7 stored as '7'
        (np.array([1.5], np.float64), "S8", "without changing kind"),
        (np.array([5, 7], np.int64), "m8[s]", "without changing kind"),  # 5 steps stored as 5 seconds
        (np.array([True]), "m8[D]", "without changing kind"),
        (np.array([True, False]), "V8", "without changing kind"),  # True stored as raw bytes
        (np.array([(1, 2.0)], [("a", "<i8"), ("b", "<f8")]), [("a", "<m8[s]"), ("b", "<f8")],
         "member by member (the same names, in order)"),
        (
            np.array([(1.0, 2.0)], [("b", "<f4"), ("a", "<f4")]),  # numpy casts by position: a and b swapped
            [("a", "<f8"), ("b", "<f8")],
            "member by member (the same names, in order)",
        ),
        (
            np.array([(1.5,)], [("a", "<f4")]),  # a scalar member broadcast into two
            [("a", "<f8", (2,))],
            "member by member (the same names, in order)",
        ),
    ],
    ids=["int-to-text", "float-to-bytes", "int-to-time", "bool-to-time", "bool-to-void", "member-to-time",
         "records-reordered", "member-broadcast"],
)
def test_a_cast_numpy_allows_but_that_moves_or_retypes_values_is_refused(tmp_path, stored, cast, why) -> None:
    """Each converted, exit 0, into values that were not the files' (verify --sources passed)."""
    write_npz(tmp_path / "src" / "a.npz", x=stored)

    def write() -> None:
        with npz2mmap.Writer(tmp_path / "w", casts={"x": cast}) as writer:
            writer.append({"x": stored})

    for make in (lambda: convert([tmp_path / "src"], tmp_path / "out", workers=1, casts={"x": cast}), write):
        with pytest.raises(MismatchError) as refused:
            make()
        assert f"cannot be cast to {np.dtype(cast)} {why}" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_subarray_dtype_is_no_cast_target(tmp_path) -> None:
    """Writer(casts={'x': '(2,)i8'}) stored raw V16 bytes, each value twice; the CLI gave a traceback."""
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(2))
    message = "'(2,)i8' is a subarray dtype, a shape with a dtype: name the element dtype, 'int64'; the shape comes from the files"
    with pytest.raises(ValueError) as refused:
        npz2mmap.Writer(tmp_path / "w", casts={"x": "(2,)i8"})
    assert str(refused.value) == message
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", "x=(2,)i8")
    assert code == 2 and output.splitlines()[-1] == f"Error: Invalid value for '--cast': {message}"


def test_no_command_prints_the_help_on_its_lines(tmp_path) -> None:
    """It came as one line of literal \\n escapes."""
    result = CliRunner().invoke(cli, [], prog_name="npz2mmap")
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert lines[0] == "Usage: npz2mmap [OPTIONS] COMMAND [ARGS]..." and "Commands:" in lines


def test_a_declared_string_width_stores_every_shorter_string_and_names_the_width_a_longer_one_needs(
    tmp_path,
) -> None:
    """Rows from Hugging Face datasets: a width per value; the Writer refused the second row."""
    with pytest.raises(MismatchError) as refused:
        with npz2mmap.Writer(tmp_path / "w", casts={"text": "U8"}) as writer:
            writer.append({"text": np.str_("abc")})
            writer.append({"text": np.str_("abcdefgh")})
            writer.append({"text": np.str_("abcdefghijk")})
    assert str(refused.value) == (
        "sample 2[text]: value 'abcdefghijk' does not survive the cast to <U8: it would be stored as "
        "'abcdefgh' (casts= keeps only values that <U8 represents exactly: declare a wider one, U11 or more, "
        "for strings of 11 characters)"
    )
    with npz2mmap.Writer(tmp_path / "ok", casts={"text": "U11"}) as writer:
        for text in ["abc", "abcdefgh", "abcdefghijk"]:
            writer.append({"text": np.str_(text)})
    from npz2mmap.read.reader import DatasetReader

    reader = DatasetReader(tmp_path / "ok")
    assert [str(reader.view("text", i)) for i in range(3)] == ["abc", "abcdefgh", "abcdefghijk"]


def test_a_file_whose_dtypes_differ_in_two_keys_is_named_with_a_cast_for_each(tmp_path) -> None:
    """Only the first key was named, with a cast for it alone; following it gave a second error."""
    src = tmp_path / "src"
    write_npz(src / "0.npz", a=np.zeros(2, np.float32), b=np.zeros(2, np.int32))
    write_npz(src / "1.npz", a=np.zeros(2, np.float64), b=np.zeros(2, np.int64))
    code, output = convert_cli(str(src), "-o", str(tmp_path / "out"))
    first = src / "0.npz"
    assert (code, output) == (
        1,
        f"Error: {src / '1.npz'}[a]: dtype float64 differs from float32 in {first}; {src / '1.npz'}[b]: dtype "
        f"int64 differs from int32 in {first}; use --cast a=float64 to store one dtype; use --cast b=int64 "
        "to store one dtype\n",
    )
    assert convert_cli(str(src), "-o", str(tmp_path / "out"), "--cast", "a=float64", "--cast", "b=int64")[0] == 0


@pytest.mark.parametrize("files", [1, 4])
def test_a_key_of_keys_that_no_file_holds_is_a_usage_error_not_a_disagreement(tmp_path, files) -> None:
    """--keys z on files that agree, none holding z, said "4 files disagree" (exit 1)."""
    for k in range(files):
        write_npz(tmp_path / "src" / f"{k}.npz", img=np.zeros(3, np.float32), y=np.int64(k))
    first = tmp_path / "src" / "0.npz"
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--keys", "img,z")
    assert code == 2 and output.splitlines()[-1] == (
        f"Error: --keys names 'z', which no input file holds ({first} has 'img', 'y'): select keys the files hold"
    )
    assert not (tmp_path / "out").exists()
    write_npz(tmp_path / "src" / "9.npz", img=np.zeros(3, np.float32), z=np.int64(9))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--keys", "img,z")
    one_by_name = f"Error: {first}: no key 'z' (has: 'img', 'y')\n"
    assert (code, output if files == 1 else output[:30]) == (1, one_by_name if files == 1 else "Error: 4 files disagree with t")


def test_a_cast_every_file_refuses_says_so_not_that_files_disagree(tmp_path) -> None:
    for k in range(4):
        write_npz(tmp_path / "src" / f"{k}.npz", img=np.zeros(3, np.float32))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", "img=f4,f4")
    target = "[('f0', '<f4'), ('f1', '<f4')]"
    problem = f"[img]: dtype float32 cannot be cast to {target} member by member (the same names, in order)"
    src = tmp_path / "src"
    assert (code, output) == (
        1,
        f"Error: 4 files refuse --cast img={target}: {src / '0.npz'}{problem}; {src / '1.npz'}{problem}; "
        f"{src / '2.npz'}{problem}; and 1 more; use --cast img=float32 to store one dtype\n",
    )


POOL = ["int8", "int64", "uint8", "float32", "float64", "complex64", "bool", "<U1", "<U3", "S2", "datetime64[s]"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtypes=st.lists(st.sampled_from(POOL), min_size=2, max_size=4),
    cast=st.none() | st.sampled_from(POOL),
)
def test_a_suggested_cast_succeeds_whatever_the_files_order_and_the_cast_given(tmp_path, dtypes, cast) -> None:
    """--cast x=U8 on int64 then <U1 files suggested --cast x=int64, which <U1 refuses: the cast a
    refusal suggests must hold the files that took the cast given too."""
    root = tmp_path / str(abs(hash((tuple(dtypes), cast))))
    for k, dtype in enumerate(dtypes):
        write_npz(root / "src" / f"{k}.npz", x=np.zeros(2, dtype))
    casts = {"x": cast} if cast else None
    try:
        convert([root / "src"], root / "out", casts=casts, workers=1)
        return
    except MismatchError as exc:
        message = str(exc)
    suggested = re.search(r"; use --cast (.+?) to store one dtype", message)
    if suggested is not None:  # as a shell reads it
        key, _, dtype = shlex.split(suggested.group(1))[0].partition("=")
        convert([root / "src"], root / "again", casts={key: dtype}, workers=1)  # no error
    else:
        assert "share no dtype --cast could store them as" in message or "has no dtype" in message, message


def test_files_a_cast_refuses_among_files_that_take_it_are_said_to_refuse_it(tmp_path) -> None:
    """int64 files refusing --cast x=U8 beside a <U1 file that takes it: the files refuse the cast
    (not "disagree with the first"), and no cast stores int64 and <U1 alike."""
    src = tmp_path / "src"
    for name, dtype in (("a", "int64"), ("b", "<U1"), ("c", "int64")):
        write_npz(src / f"{name}.npz", x=np.zeros(2, dtype))
    code, output = convert_cli(str(src), "-o", str(tmp_path / "out"), "--cast", "x=U8")
    problem = "[x]: dtype int64 cannot be cast to <U8 without changing kind"
    assert (code, output) == (
        1,
        f"Error: 2 files refuse --cast x=<U8: {src / 'a.npz'}{problem}; {src / 'c.npz'}{problem}; "
        "int64 and <U1 share no dtype --cast could store them as (it keeps their kind): "
        "convert such files apart, or leave x out with --keys\n",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("first", "other", "hint"),
    [
        (np.array([2**63 + 1], np.uint64), np.array([-1]), "use --cast x=float64 to store one dtype, if"),
        (np.array([b"\xff"], "S1"), np.array(["a"], "U1"), "use --cast x=U1 to store one dtype, if"),
        (np.array([2**53 + 1]), np.array([0.5], np.float32), "use --cast x=float64 to store one dtype, if"),
        (np.array([1], np.int32), np.array([0.5]), "use --cast x=float64 to store one dtype\n"),
        (
            np.array(["2020-01-01"], "M8[ns]"),
            np.array(["2300-01-01"], "M8[D]"),
            'use --cast "x=datetime64[ns]" to store one dtype, if',
        ),
    ],
    ids=["uint64-int64", "bytes-text", "int64-float32", "int32-float64", "days-nanoseconds"],
)
def test_a_cast_that_some_values_may_not_survive_is_suggested_as_such(tmp_path, first, other, hint) -> None:
    """uint64 and int64 files were told to use --cast x=float64, which then refused 2**63 + 1: a
    cast that keeps only some of a dtype's values says so, and the refusal names the value."""
    write_npz(tmp_path / "src" / "a.npz", x=first)
    write_npz(tmp_path / "src" / "b.npz", x=other)
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert code == 1 and output.endswith(
        hint if hint.endswith("\n") else f"{hint} every value fits it\n"
    ), output
    target = shlex.split(re.search(r"; use --cast (.+?) to store one dtype", output).group(1))[0]
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", target)
    assert code == (0 if hint.endswith("\n") else 1), output
    assert code == 0 or "value" in output and "at index (0,)" in output


def test_a_dtype_in_two_byte_orders_is_listed_once(tmp_path) -> None:
    """'float64, datetime64[ms] and >f8 share no dtype' listed one dtype twice, as three."""
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(2, ">f8"))
    write_npz(tmp_path / "src" / "b.npz", x=np.zeros(2, "M8[ms]"))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert code == 1 and "; float64 and datetime64[ms] share no dtype --cast could store" in output, output


def test_records_of_other_member_dtypes_get_a_cast_the_cli_can_spell_and_it_succeeds(tmp_path) -> None:
    """Records [('a', '<i4'), ('b', '<f4')] and [('a', '<i8'), ('b', '<f8')] were said to share no
    dtype --cast could store, though casts= stored them; the CLI had no spelling of named records."""
    narrow = np.array([(1, 0.5), (2, 1.5)], dtype=[("a", "<i4"), ("b", "<f4")])
    wide = np.array([(3, 2.5)], dtype=[("a", "<i8"), ("b", "<f8")])
    write_npz(tmp_path / "src" / "a.npz", x=narrow)
    write_npz(tmp_path / "src" / "b.npz", x=wide)
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    suggested = "use --cast \"x=[('a', '<i8'), ('b', '<f8')]\" to store one dtype\n"
    assert code == 1 and output.endswith(f"; {suggested}"), output
    cast = shlex.split(suggested)[2]
    assert convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", cast) == (0, "")
    stored = npz2mmap.DatasetReader(tmp_path / "out")
    assert [stored.view("x", i).tolist() for i in range(2)] == [narrow.astype(wide.dtype).tolist(), wide.tolist()]
    convert([tmp_path / "src"], tmp_path / "python", casts={"x": wide.dtype}, workers=1)
    assert (tmp_path / "python" / "data.npy").read_bytes() == (tmp_path / "out" / "data.npy").read_bytes()


@pytest.mark.parametrize(
    "spelling",
    ["[('a',", "[('a', '<i8')] + []", "[1, 2]", "[('a', 'object')]", "[" * 5000 + "]" * 5000],
    ids=["unclosed", "expression", "no-fields", "object", "deep"],
)
def test_a_record_cast_that_is_no_dtype_is_a_usage_error(tmp_path, spelling) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(2))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", f"x={spelling}")
    assert code == 2 and "Invalid value for '--cast'" in output and len(output.splitlines()) <= 4, output
    assert "not a numpy dtype" in output or "pickle-free" in output, output


@pytest.mark.parametrize(
    ("narrow", "wide"),
    [
        ([("a", "<i4", (2,))], [("a", "<i8", (2,))]),
        ([("a", "<f4", (2, 2))], [("a", "<f8", (2, 2))]),
        ([("p", [("x", "<i2", (2,))]), ("q", "<i8")], [("p", [("x", "<i8", (2,))]), ("q", "<i8")]),
    ],
    ids=["int-subarray", "float-subarray", "nested"],
)
def test_records_whose_members_widen_get_the_wider_record_suggested(tmp_path, narrow, wide) -> None:
    """With the narrower record first, its own dtype was suggested (with 'if every value fits it'),
    which then refused the wider file's values, though the wider record holds both."""
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(2, narrow))
    write_npz(tmp_path / "src" / "b.npz", x=np.zeros(1, wide))
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    suggested = re.search(r"; use --cast (.+?) to store one dtype(.*)$", output.strip())
    assert code == 1 and suggested is not None, output
    assert suggested.group(2) == "", output  # the wider record holds every value
    cast = shlex.split(suggested.group(1))[0]
    assert convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--cast", cast) == (0, "")
