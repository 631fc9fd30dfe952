"""The ``npz2mmap`` commands: thin click commands that parse, call one library function and render.

Only the CLI (this folder: these commands, their entry point ``main.py``, ``render.py``,
``click_support.py``) prints, draws progress bars and picks exit codes: 0 for success, 1 for
bad data, a failed verify or Ctrl-C, 2 for usage errors. It never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import click
import numpy as np

from .._version import __version__
from ..check.summary import describe_dataset, describe_sample, field_statistics
from ..check.verify import VerifyReport
from ..check.verify import verify as verify_dataset
from ..check.warm import warm as warm_dataset
from ..errors import MissingInputError, NamedNpyError, Npz2mmapError, RaggedFieldWarning, UnknownKeyError
from ..format.index import ALIGN_RULE, MIN_ALIGN, SKIPPED_NAME, is_valid_align
from ..ingest.discover import is_npy_named_with_sample_dirs, npy_with_sample_dirs
from ..ingest.npy_header import CLI_HEADER_OPTION, MAX_HEADER_SIZE_LIMIT, MAX_NPY_HEADER_CHARS, HeaderLimit
from ..progress import showing_progress
from ..read.memory import fits_in_memory, larger_than_memory, memory_limit
from ..text import human_bytes, plural
from ..write.conversion import ConvertResult
from ..write.conversion import convert as convert_files
from ..write.merge import merge as merge_parts
from ..write.options import cast_dtype, repeated, resolve_part
from ..write.shapes import NearlyFixed, describe_nearly_fixed
from .click_support import (
    DirectoryPath,
    F,
    OneLineErrorsGroup,
    debug_option,
    echo_err,
    friendly_errors,
    one_line,
    progress_option,
    quiet_progress,
)
from .render import PathsAsGiven, render_json, render_sample, render_summary


def _parse_keys(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    keys = value.split(",")  # exact: a key may hold spaces (" y" is not "y")
    if not any(keys):
        raise click.BadParameter("give at least one key, e.g. --keys input,label")
    if not all(keys):
        raise click.BadParameter(
            f"{value!r} names an empty key: give keys between commas, e.g. --keys input,label"
        )
    twice = repeated(keys)
    if twice is not None:
        raise click.BadParameter(f"{value!r} names {twice!r} twice: name each key once")
    return keys


def _parse_casts(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, np.dtype]:
    casts: dict[str, np.dtype] = {}
    given: dict[str, str] = {}
    for value in values:
        key, dtype, cast = _split_cast(value)
        if key in casts and casts[key].newbyteorder("<") != cast.newbyteorder("<"):  # stored little-endian
            raise click.BadParameter(f"{given[key]!r} and {value!r} cast {key!r} two ways; give one")
        casts[key], given[key] = cast, value
    return casts


def _split_cast(value: str) -> tuple[str, str, np.dtype]:
    """KEY=DTYPE split at the first "=" after which a dtype follows, so a key may hold "="
    (``lr=0.1=float32``) and a dtype may start with one (``x==f4``, native order)."""
    splits = [k for k, char in enumerate(value) if char == "=" and 0 < k < len(value) - 1]
    if not splits:
        raise click.BadParameter(f"{value!r} is not KEY=DTYPE, e.g. input=float32")
    problems = []
    for k in splits:
        try:
            return value[:k], value[k + 1 :], cast_dtype(value[k + 1 :])
        except ValueError as exc:
            problems.append(str(exc))
    raise click.BadParameter(problems[0])


def _parse_fixed(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    if not all(values):
        raise click.BadParameter("give a key, e.g. --fixed image")
    return values


def _check_align(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if not is_valid_align(value):
        raise click.BadParameter(f"must be {ALIGN_RULE}, got {value}")
    return value


def examples(*lines: str) -> str:
    """An Examples section for a command's --help, its lines kept as they are (click's \b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


@click.group(
    cls=OneLineErrorsGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=examples(
        "npz2mmap convert data/ -o data.mmap",
        "npz2mmap inspect data.mmap",
        "npz2mmap verify data.mmap --sources",
        "npz2mmap convert --help                 # each command's options and examples",
    ),
)
@click.version_option(__version__, prog_name="npz2mmap")
@debug_option
def cli() -> None:
    """Convert many .npz or .npy files into one memory-mapped dataset for PyTorch."""


def _header_limit(ctx: click.Context, param: click.Parameter, value: int) -> HeaderLimit:
    """The limit, with messages naming this option rather than convert()'s keyword."""
    return HeaderLimit(value, CLI_HEADER_OPTION)


max_header_size_option = click.option(
    "--max-header-size",
    type=click.IntRange(1, MAX_HEADER_SIZE_LIMIT),
    default=MAX_NPY_HEADER_CHARS,
    show_default=True,
    callback=_header_limit,
    metavar="N",
    help=f"Read .npy headers of up to N characters (np.load's max_header_size; at most "
    f"{MAX_HEADER_SIZE_LIMIT:,}). Raise it only for files you trust, such as records of thousands of fields.",
)


def output_option(help_text: str) -> Callable[[F], F]:
    return click.option(
        "-o",
        "--output",
        "out_dir",
        required=True,
        type=DirectoryPath(),
        metavar="OUT",
        help=help_text,
    )


@cli.command(
    options_metavar="-o OUT [OPTIONS]",
    epilog=examples(
        "npz2mmap convert data/ -o data.mmap",
        "npz2mmap convert train/ extra.npz -o train.mmap --skip-bad",
        "npz2mmap convert data/ -o data.mmap --cast image=float32 --fixed image",
        "npz2mmap convert @files.txt -o shards --part auto      # one part per rank",
        "npz2mmap convert frames/ -o frames.mmap --sample-dirs   # frames/s0/x.npy, ...",
    ),
)
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@output_option("Dataset directory to create.")
@click.option(
    "--keys",
    callback=_parse_keys,
    metavar="A,B",
    help="Convert only these keys: NPZ member names, arr_0 for a .npy file, NAME for NAME.npy "
    "with --sample-dirs (default: all).",
)
@click.option(
    "--cast",
    "casts",
    multiple=True,
    callback=_parse_casts,
    metavar="KEY=DTYPE",
    help="Store KEY as DTYPE where sources differ, e.g. x=float32 (same-kind casts only). Repeatable.",
)
@click.option(
    "--fixed",
    multiple=True,
    callback=_parse_fixed,
    metavar="KEY",
    help="KEY must have one sample shape, the first file's: a file that differs is an error "
    "(with --skip-bad, left out). Repeatable.",
)
@click.option(
    "--skip-bad",
    is_flag=True,
    help="Leave out unreadable or corrupt files (and those --fixed refuses) and list them in "
    "OUT/skipped.jsonl instead of stopping.",
)
@click.option(
    "--rows",
    is_flag=True,
    help="Each file holds many samples along axis 0 (all its arrays share that dimension).",
)
@click.option(
    "--sample-dirs",
    is_flag=True,
    help="Each directory holding .npy files is one sample, each NAME.npy in it the field NAME.",
)
@click.option(
    "--part",
    metavar="I/N|auto",
    help="Convert only the I-th (from 0) of N contiguous slices of the sorted inputs into OUT/part-IIIII "
    "(or OUT with {part} replaced); auto takes I and N from torchrun or Slurm.",
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Worker processes (default: all cores)."
)
@click.option(
    "--align",
    type=int,
    default=MIN_ALIGN,
    show_default=True,
    callback=_check_align,
    help="Byte alignment of every region, a power of two (e.g. 4096 for pages).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace an existing dataset at OUT once the new one is complete."
)
@max_header_size_option
@progress_option
@click.option("-q", "--quiet", is_flag=True, help="No progress and no summary (--progress none).")
@click.option(
    "--json", "as_json", is_flag=True, help="The summary as JSON on stdout (warnings stay on stderr)."
)
@friendly_errors
def convert(
    inputs: tuple[str, ...],
    out_dir: str,
    keys: list[str] | None,
    casts: dict[str, np.dtype],
    fixed: tuple[str, ...],
    skip_bad: bool,
    rows: bool,
    sample_dirs: bool,
    part: str | None,
    workers: int | None,
    align: int,
    overwrite: bool,
    max_header_size: HeaderLimit,
    progress_mode: str,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert INPUT... into the dataset directory OUT.

    Each INPUT is an .npz or .npy file, a directory (searched recursively for
    *.npz and *.npy, hidden names skipped, in sorted order), a quoted glob
    pattern ('data/**/*.npz', matches sorted) or @LIST, a text
    file naming one path per line (lines whose first character other than
    white space is # are comments). Each file becomes one sample, in that order
    (with --rows, each row of it); a .npy file holds the one field arr_0 (with
    --sample-dirs, each directory holding .npy files is one sample instead).
    """
    if "@" in inputs:
        message = "'@' names no list file: give @LIST, e.g. @train.txt"
        raise click.BadParameter(message, param_hint="'INPUT...'")
    if sample_dirs:
        named_npy = [path for path in inputs if is_npy_named_with_sample_dirs(path)]
        if named_npy:
            raise click.UsageError(npy_with_sample_dirs(named_npy[0]))
    try:
        chosen_part, _ = resolve_part(part, out_dir)  # a usage error, before anything starts
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--part'" if part else "'-o'") from None
    as_given = PathsAsGiven(inputs)
    with (
        showing_progress(quiet_progress(quiet, progress_mode), echo_err) as progress,
        _usage_errors(),
        _shown_as_given(as_given),
    ):
        result = convert_files(
            list(inputs),
            out_dir,
            keys=keys,
            casts=casts,
            fixed=fixed,
            skip_bad=skip_bad,
            part=chosen_part,
            rows=rows,
            sample_dirs=sample_dirs,
            workers=workers,
            align=align,
            overwrite=overwrite,
            progress=progress,
            max_header_size=max_header_size,
        )
    out_dir = result.out_dir  # OUT/part-IIIII for a part
    if result.skipped:
        first_reason = result.skipped[0][1]
        click.echo(
            one_line(
                f"Warning: skipped {plural(len(result.skipped), 'bad file')}, listed in "
                f"{os.path.join(out_dir, SKIPPED_NAME)}; the first: {as_given(first_reason)}"
            ),
            err=True,
        )
    for item in result.nearly_fixed:
        echo_err(f"Warning: {as_given(_describe_nearly_fixed(item, chosen_part is not None))}")
    if as_json:
        click.echo(render_json(_convert_json(result)))
    elif not quiet:
        index = result.index
        click.echo(
            one_line(
                f"Converted {plural(index.num_samples, 'sample')}, {plural(len(index.fields), 'field')}, "
                f"{human_bytes(result.data_nbytes)} into {out_dir} in {result.seconds:.1f} s"
            )
        )
        growth = _growth_note(result.data_nbytes, result.sources_nbytes)
        if growth:
            click.echo(growth)


def _convert_json(result: ConvertResult) -> dict[str, Any]:
    """What a script reads of a conversion: where, how much, what was left out."""
    return {
        "out_dir": result.out_dir,
        "num_samples": result.index.num_samples,
        "fields": list(result.index.field_names),
        "data_nbytes": result.data_nbytes,
        "sources_nbytes": result.sources_nbytes,
        "seconds": round(result.seconds, 3),
        "skipped": [{"path": path, "reason": reason} for path, reason in result.skipped],
        "nearly_fixed": [
            {
                "field": item.field,
                "shape": list(item.shape),
                "files": item.num_sources,
                "files_differing": item.num_odd,
                "first": item.first_odd_source,
                "first_shape": list(item.first_odd_shape),
            }
            for item in result.nearly_fixed
        ],
    }


@contextlib.contextmanager
def _shown_as_given(as_given: PathsAsGiven) -> Iterator[None]:
    """The project's errors name the inputs' files as the user typed the inputs."""
    try:
        yield
    except Npz2mmapError as exc:
        exc.args = (as_given(str(exc)),)
        raise


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """An option naming a key the inputs do not hold, or an input that does not exist, is a usage
    error (exit 2), found only once the inputs are looked at."""
    try:
        yield
    except (UnknownKeyError, MissingInputError, NamedNpyError) as exc:
        raise click.UsageError(str(exc)) from None


def _describe_nearly_fixed(item: NearlyFixed, in_a_part: bool = False) -> str:
    if in_a_part:  # counted over the part's files; --fixed holds them to the whole list's first
        advice = (
            f"counted over this part's files alone: --fixed {item.field} holds every part to the "
            "first file of the whole input list, so look at the shapes of the whole list before using it"
        )
    elif item.held_fixed_keeps_an_odd_shape():
        advice = (
            f"--fixed {item.field} keeps the first file's shape, and that file is one that differs: "
            f"move it out of the inputs (or save it as {item.shape}), then convert with --fixed {item.field}"
        )
    else:
        advice = f"--fixed {item.field} refuses such files (with --skip-bad, leaves them out)"
    return describe_nearly_fixed(item, "file", item.first_odd_source, advice)


MUCH_LARGER_FACTOR = 4


def _growth_note(data_nbytes: int, sources_nbytes: int) -> str | None:
    """A line for arrays much larger than their source files, which only compression explains.

    Users converting compressed NPZ files do not expect the dataset to be many
    times their size; --cast widens at most 4x, and zip headers add to the sources.
    """
    if not sources_nbytes or data_nbytes <= MUCH_LARGER_FACTOR * sources_nbytes:
        return None
    return (
        f"Note: the dataset's {human_bytes(data_nbytes)} of arrays are {data_nbytes / sources_nbytes:,.0f} "
        f"times the size of their compressed sources, {human_bytes(sources_nbytes)}: the dataset stores "
        "them uncompressed, so that they can be memory-mapped"
    )


@cli.command(
    epilog=examples(
        "npz2mmap inspect data.mmap",
        "npz2mmap inspect data.mmap --sample 0",
        "npz2mmap inspect data.mmap --stats --json",
    )
)
@click.argument("dataset", type=DirectoryPath(), metavar="OUT")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--sample", type=int, default=None, metavar="I", help="Show sample I's arrays instead.")
@click.option(
    "--stats",
    is_flag=True,
    help="Also compute count, NaN and inf counts, min, max, mean and std of numeric fields (reads all data).",
)
@friendly_errors
def inspect(dataset: str, as_json: bool, sample: int | None, stats: bool) -> None:
    """Show a dataset's format, samples, size and fields."""
    if sample is not None and stats:
        raise click.UsageError(
            "--stats cannot be used with --sample, which shows the sample's min, max and mean"
        )
    if sample is not None:
        try:
            info = describe_sample(dataset, sample)
        except IndexError as exc:
            raise click.BadParameter(str(exc), param_hint="--sample") from None
        click.echo(render_json(info) if as_json else render_sample(info))
        return
    summary = describe_dataset(dataset)
    warn_if_larger_than_memory(dataset, summary["blob_nbytes"])
    if stats:
        with showing_progress("none" if as_json else "auto", echo_err) as progress:
            summary["stats"] = field_statistics(dataset, progress)
    click.echo(render_json(summary) if as_json else render_summary(summary))


def warn_if_larger_than_memory(dataset: str, blob_nbytes: int) -> None:
    """A ``Warning:`` line on stderr when the blobs cannot stay in the memory this process may use."""
    limit = memory_limit()
    if not fits_in_memory(blob_nbytes, limit):
        assert limit is not None
        echo_err(one_line(f"Warning: {larger_than_memory(dataset, blob_nbytes, limit)}"))


@cli.command(
    epilog=examples(
        "npz2mmap verify data.mmap",
        "npz2mmap verify data.mmap --sources      # every sample against its file",
    )
)
@click.argument("dataset", type=DirectoryPath(), metavar="OUT")
@click.option("--sources", is_flag=True, help="Also compare every sample bit for bit with its source file.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON on stdout, every problem listed.")
@max_header_size_option
@progress_option
@click.option("-q", "--quiet", is_flag=True, help="No progress; print only problems (--progress none).")
@friendly_errors
def verify(
    dataset: str, sources: bool, as_json: bool, max_header_size: HeaderLimit, progress_mode: str, quiet: bool
) -> None:
    """Check a dataset's checksums and tables; exit 0 only if all is well."""
    with showing_progress(quiet_progress(quiet, progress_mode), echo_err) as progress:
        report = verify_dataset(dataset, sources=sources, progress=progress, max_header_size=max_header_size)
    if as_json:
        click.echo(render_json(_verify_json(report)))
    else:
        for problem in report.problems[:MAX_PROBLEMS_SHOWN]:
            click.echo(one_line(problem), err=True)
        if len(report.problems) > MAX_PROBLEMS_SHOWN:
            more = len(report.problems) - MAX_PROBLEMS_SHOWN
            click.echo(f"... and {plural(more, 'more problem')} (--json lists them all)", err=True)
    if not report.ok:
        raise click.ClickException(f"{dataset}: {plural(len(report.problems), 'problem')} found")
    if not quiet and not as_json:
        click.echo(one_line(_verified_line(dataset, report)))


MAX_PROBLEMS_SHOWN = 10  # problems verify prints; a damaged dataset can have one per sample


def _verified_line(dataset: str, report: VerifyReport) -> str:
    not_compared = report.unsourced + report.labelled
    compared = report.sources_checked and not_compared < report.num_samples
    checked = "checksums, tables, padding" + (" and sources" if compared else "")
    line = f"OK: {dataset}: {plural(report.num_samples, 'sample')} verified ({checked})"
    if report.sources_checked and report.unsourced:
        name, were = _verbs(report.unsourced)
        line += (
            f"; {plural(report.unsourced, 'sample')} of {report.num_samples:,} {name} no source "
            f"(appended by npz2mmap.Writer without source=) and {were} not compared"
        )
    if report.sources_checked and report.labelled:
        name, were = _verbs(report.labelled)
        line += (
            f"; {plural(report.labelled, 'sample')} of {report.num_samples:,} {name} as source a label, "
            f"a file of no sample or one other samples share (npz2mmap.Writer's source=), and {were} not "
            "compared"
        )
    return line


def _verbs(count: int) -> tuple[str, str]:
    return ("names", "was") if count == 1 else ("name", "were")


def _verify_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "path": report.path,
        "ok": report.ok,
        "num_samples": report.num_samples,
        "problems": report.problems,
        "sources_checked": report.sources_checked,
        "samples_without_source": report.unsourced,
        "samples_with_a_label_as_source": report.labelled,
    }


@cli.command(
    options_metavar="-o OUT [OPTIONS]",
    epilog=examples(
        "npz2mmap merge shards/part-* -o shards    # a manifest beside the parts",
        "npz2mmap merge a.mmap b.mmap -o all.mmap --copy",
    ),
)
@click.argument("parts", nargs=-1, required=True, metavar="PART...", type=DirectoryPath())
@output_option("Directory to hold manifest.json, or with --copy the dataset to create.")
@click.option("--copy", is_flag=True, help="Copy the parts into one single dataset instead of listing them.")
@click.option("--overwrite", is_flag=True, help="Replace an existing manifest or dataset at OUT.")
@progress_option
@click.option("-q", "--quiet", is_flag=True, help="No progress and no summary (--progress none).")
@friendly_errors
def merge(
    parts: tuple[str, ...], out_dir: str, copy: bool, overwrite: bool, progress_mode: str, quiet: bool
) -> None:
    """Join datasets into one at OUT: a manifest naming them, or with --copy one blob.

    The PART datasets are read in the order given.

    By default writes OUT/manifest.json naming the parts: instant, nothing is
    copied, and MmapDataset(OUT) reads them as one. With --copy, writes a
    single dataset at OUT.
    """
    with showing_progress(quiet_progress(quiet, progress_mode), echo_err) as progress, _usage_errors():
        with warnings.catch_warnings():  # said below, as a line of output
            warnings.simplefilter("ignore", RaggedFieldWarning)
            result = merge_parts(list(parts), out_dir, copy=copy, overwrite=overwrite, progress=progress)
    if not quiet:
        what = f"one dataset at {out_dir}" if result.copied else os.path.join(out_dir, "manifest.json")
        counts = f"{plural(result.num_parts, 'part')}, {plural(result.num_samples, 'sample')}"
        click.echo(one_line(f"Merged {counts}, into {what}"))
    for line in result.ragged_across_parts:
        echo_err(one_line(f"Warning: {line}"))


@cli.command(epilog=examples("npz2mmap warm data.mmap                  # before training, on each node"))
@click.argument("dataset", type=DirectoryPath(), metavar="OUT")
@progress_option
@click.option("-q", "--quiet", is_flag=True, help="No progress (--progress none).")
@friendly_errors
def warm(dataset: str, progress_mode: str, quiet: bool) -> None:
    """Load a dataset into this node's page cache and report how much is resident."""
    try:
        with showing_progress(quiet_progress(quiet, progress_mode), echo_err) as progress:
            result = warm_dataset(dataset, progress=progress)
        warn_if_larger_than_memory(dataset, result.blob_nbytes)
    except OSError as exc:
        raise click.ClickException(f"{dataset}: cannot read the blob ({exc.strerror or exc})") from None
    where = (
        result.blob_paths[0] if len(result.blob_paths) == 1 else f"{dataset} ({len(result.blob_paths)} parts)"
    )
    if result.resident_nbytes is None:
        shown = f"{human_bytes(result.blob_nbytes)} read; how much stays resident is unknown on this platform"
    else:
        shown = (
            f"{human_bytes(result.resident_nbytes)} of {human_bytes(result.blob_nbytes)} "
            f"resident in the page cache ({result.resident_nbytes / result.blob_nbytes:.0%})"
        )
    click.echo(one_line(f"{where}: {shown}"))
