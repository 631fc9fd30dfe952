"""Glob patterns in INPUT, matched against the paths a directory walk reaches.

A pattern is split into the directory it starts from (its leading components
without wildcards) and the components below it. The walk of that directory,
with its own rules (each directory once, under the path that sorts first; a
file reached by two paths an error), is filtered by the pattern: matching is
glob's (``*``, ``?``, ``[...]`` within a name, ``**`` any number of
directories; a hidden name matched only by a component that starts with a
dot, never by ``**``), without glob's own walk, which follows symlink loops
to the system's limit.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
import re

from .sources import is_hidden

_SEPARATORS = re.compile("[" + re.escape(os.sep + (os.altsep or "")) + "]")
RECURSIVE = "**"


def is_pattern(text: str) -> bool:
    """Whether an INPUT is a glob pattern: it has wildcards and names no path (one that exists
    is never a pattern)."""
    return glob.has_magic(text) and not os.path.lexists(text)


class Pattern:
    """A glob pattern: the directory its walk starts from, and the components it matches below."""

    def __init__(self, text: str) -> None:
        self.text = text
        components = _SEPARATORS.split(text)
        self.directories_only = components[-1] == "" and len(components) > 1  # 'd/**/' as glob reads it
        if self.directories_only:
            components = components[:-1]
        fixed = 0
        while fixed < len(components) - 1 and not glob.has_magic(components[fixed]):
            fixed += 1
        self.base = _join_base(text, components[:fixed])
        # 'd/*//x.npz' and 'd/*/./x.npz' name what 'd/*/x.npz' names, as for glob and the system
        self.below = tuple(c for c in components[fixed:] if c not in ("", os.curdir))

    def matches(self, path: tuple[str, ...], is_directory: bool) -> bool:
        """Whether the path below ``base`` (its components) is one the pattern names."""
        if self.directories_only and not is_directory:
            return False
        return _match(self.below, path, is_directory)

    def may_match_below(self, directory: tuple[str, ...]) -> bool:
        """Whether some path inside ``directory`` (components below ``base``) can match."""
        return _match_within(self.below, directory)


def _join_base(text: str, components: list[str]) -> str:
    """The directory a pattern's walk starts from, spelt as the pattern spells it ('.' for none)."""
    if not components:
        return os.curdir
    if components == [""]:  # an absolute pattern: '/*.npz'
        return text[0]
    return text[: sum(len(c) for c in components) + len(components) - 1]


@functools.lru_cache(maxsize=4096)
def _match(pattern: tuple[str, ...], path: tuple[str, ...], is_directory: bool, within: bool = False) -> bool:
    """glob's match of a path's names; ``within``: a ``**`` has taken names before these. A ``**``
    that ends the pattern and takes no name names the directory it follows, never a file."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == RECURSIVE:
        if not path:
            return (is_directory or within) if not rest else _match(rest, path, is_directory)
        return _match(rest, path, is_directory) or (
            not is_hidden(path[0]) and _match(pattern, path[1:], is_directory, True)
        )
    return bool(path) and _name_matches(head, path[0]) and _match(rest, path[1:], is_directory)


@functools.lru_cache(maxsize=4096)
def _match_within(pattern: tuple[str, ...], directory: tuple[str, ...]) -> bool:
    """Whether some path inside ``directory`` can match: a ``**`` never enters a hidden one."""
    if not pattern:
        return False
    if not directory:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == RECURSIVE:
        return _match_within(rest, directory) or (
            not is_hidden(directory[0]) and _match_within(pattern, directory[1:])
        )
    return _name_matches(head, directory[0]) and _match_within(rest, directory[1:])


def _name_matches(component: str, name: str) -> bool:
    """glob's rule for one name: a hidden one only for a component that starts with a dot."""
    if is_hidden(name) and not component.startswith("."):
        return False
    return fnmatch.fnmatch(name, component)
