"""click as the commands use it: one-line errors (``--debug`` for the traceback), options that
take one value given once, the progress options, and stderr lines escaped to one line."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ..errors import Npz2mmapError
from ..progress import PROGRESS_MODES

F = TypeVar("F", bound=Callable[..., Any])


def quiet_progress(quiet: bool, progress_mode: str) -> str:
    """The progress mode of a command with ``-q``: none; a usage error if --progress asked for another."""
    source = click.get_current_context().get_parameter_source("progress_mode")
    if quiet and progress_mode != "none" and source is not ParameterSource.DEFAULT:
        raise click.UsageError(
            f"-q/--quiet shows no progress; it cannot be used with --progress {progress_mode}"
        )
    return "none" if quiet else progress_mode


def progress_option(func: F) -> F:
    """``--progress auto|bar|log|none``, shared by the commands that read or write much data."""
    return click.option(
        "--progress",
        "progress_mode",
        type=click.Choice(PROGRESS_MODES),
        default="auto",
        show_default=True,
        help="bar: progress bars; log: a line every 10 s, for logs; none: nothing; "
        "auto: bars on a terminal, else log.",
    )(func)


# C0 and C1 controls, Unicode line breaks, and the surrogates that stand for undecodable bytes in paths.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


MAX_LINE_CHARS = 4000


def echo_err(line: str) -> None:
    """A line on stderr, as every message of the CLI is."""
    click.echo(one_line(line), err=True)


def one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\x1b``), so it prints as one line.

    Paths come from users and file systems and may hold any of them.
    """
    escaped = _UNPRINTABLE.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)
    if len(escaped) > MAX_LINE_CHARS:  # a path or a list line can be megabytes long
        return escaped[: MAX_LINE_CHARS // 2] + " ... " + escaped[-MAX_LINE_CHARS // 2 :]
    return escaped


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # the help itself, shown for no command: its lines are meant
    except click.ClickException as exc:
        # click types ``message`` Final, yet it is where every error keeps its text until shown.
        exc.message = one_line(exc.message)  # type: ignore[misc]
        raise


class OnceOptionsCommand(click.Command):
    """A command whose options that take one value may be given once: a second one is a usage
    error naming both, where click would keep the last without a word."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_repeated_options(ctx, self.params, args)
        return super().parse_args(ctx, args)


def _refuse_repeated_options(ctx: click.Context, params: list[click.Parameter], args: list[str]) -> None:
    single_valued = {
        flag: param
        for param in params
        if isinstance(param, click.Option) and not (param.multiple or param.is_flag or param.count)
        for flag in param.opts
    }
    seen: dict[str, str] = {}
    for k, arg in enumerate(args):
        if arg == "--":
            break
        flag = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        param = single_valued.get(flag)
        if param is None or param.name is None:
            continue
        attached = arg[len(flag) :].removeprefix("=")
        value = attached or (args[k + 1] if k + 1 < len(args) else "")
        if param.name in seen:
            name = max(param.opts, key=len)
            given = f"{seen[param.name]!r} and {value!r}"
            raise click.UsageError(f"{name} given twice ({given}): give it once", ctx)
        seen[param.name] = value


class OneLineErrorsGroup(click.Group):
    """The command group: every error it reports is one line, whatever paths it names.

    Covers click's own errors (a bad option value quotes what was given) as
    well as ours.
    """

    command_class = OnceOptionsCommand

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_errors():
            return super().invoke(ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section of --help, each command's whole one-line summary wrapped, never cut."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=MAX_LINE_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


DEBUG_HELP = "Show full tracebacks instead of one-line errors."


def _remember_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """Note --debug where every command sees it: ``ctx.meta`` is shared by the group and its command."""
    if value:
        ctx.meta["npz2mmap.debug"] = True
    return value


def debug_option(func: F) -> F:
    """``--debug`` after the command too (``npz2mmap convert ... --debug``), as before it."""
    return click.option(
        "--debug", is_flag=True, expose_value=False, callback=_remember_debug, help=DEBUG_HELP
    )(func)


def friendly_errors(func: F) -> F:
    """Show the project's errors as one line (exit 1); the command gets --debug to show the traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Npz2mmapError as exc:
            if click.get_current_context().meta.get("npz2mmap.debug"):
                raise
            raise click.ClickException(str(exc)) from None

    return debug_option(wrapper)  # type: ignore[return-value]


class DirectoryPath(click.Path):
    """A directory named on the command line; an empty one (``-o "$OUT"`` with OUT unset) is a
    usage mistake (exit 2), not a directory that cannot be written."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":
            self.fail("an empty path (an unset shell variable?): name a directory", param, ctx)
        return super().convert(value, param, ctx)
