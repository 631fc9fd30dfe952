"""Element dtypes as a dataset stores them: little-endian, and in index.json as numpy's descr.

Parsing a stored dtype is bounded: nesting is counted before numpy recurses,
and a type string is short. ``docs/FORMAT.md`` states the same rules.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import FormatError
from ..text import brief

# numpy (and our own parsing) recurses once per level of nested records, and once per
# subarray: a record member may be a subarray of a subarray (numpy keeps those unflattened).
MAX_DTYPE_DEPTH = 32
# Records and subarrays counted together: room for a subarray member at every record level.
MAX_DTYPE_NESTING = 2 * MAX_DTYPE_DEPTH


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian dtype a source dtype is stored as (recursively for records)."""
    return dtype.newbyteorder("<")


def dtype_to_json(dtype: np.dtype) -> Any:
    descr = np.lib.format.dtype_to_descr(dtype)
    return json.loads(json.dumps(descr))


# The longest type string numpy writes is far shorter ('<M8[ns]', '|V1000000000', '<U2147483647').
MAX_DESCR_CHARS = 64


def dtype_from_json(value: Any, where: str) -> np.dtype:
    """Parse a stored dtype; refuse anything not little-endian, sized and pickle-free.

    Records nested more than MAX_DTYPE_DEPTH levels, or records and subarrays
    together more than MAX_DTYPE_NESTING, are refused before numpy recurses
    into them, and so is a subarray dtype, which the converter never stores:
    a field's shape is in ``shape``, its dtype describes one element.
    """
    problem = _nesting_problem(*_descr_nesting(value))
    if problem is not None:
        raise FormatError(f"{where}: dtype {problem}")
    try:
        dtype = np.lib.format.descr_to_dtype(_descr_from_json(value))
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, SyntaxError, MemoryError) as exc:
        # SyntaxError: numpy parses a comma-separated type string as Python (a 5000-digit number...)
        raise FormatError(
            f"{where}: dtype {brief(value)} is not a valid numpy descr ({brief(str(exc))})"
        ) from None
    if dtype.hasobject:
        raise FormatError(f"{where}: dtype {brief(value)} holds Python objects, which are never stored")
    if dtype.subdtype is not None:
        raise FormatError(
            f"{where}: dtype {brief(value)} is a subarray dtype; a field's shape belongs in 'shape'"
        )
    if dtype.itemsize == 0:
        raise FormatError(f"{where}: dtype {brief(value)} has no size")
    if storage_dtype(dtype) != dtype:
        raise FormatError(f"{where}: dtype {brief(value)} is not little-endian")
    return dtype


def dtype_nesting_problem(dtype: np.dtype) -> str | None:
    """What makes ``dtype`` nest too deeply for a dataset (see dtype_from_json), or None."""
    return _nesting_problem(*_dtype_nesting(dtype))


def _nesting_problem(records: int, levels: int) -> str | None:
    if records > MAX_DTYPE_DEPTH:
        return f"nests records more than {MAX_DTYPE_DEPTH} levels deep"
    if levels > MAX_DTYPE_NESTING:
        return f"nests records and subarrays more than {MAX_DTYPE_NESTING} levels deep"
    return None


def _descr_nesting(value: Any) -> tuple[int, int]:
    """How deeply records, and records and subarrays together, nest in a JSON descr.

    Walked without recursion, stopping past either limit. A record member
    ``[name, descr, shape]`` counts as a subarray of ``descr``.
    """
    deepest = (0, 0)
    stack = [(value, 0, 0)]
    while stack:
        node, records, levels = stack.pop()
        deepest = max(deepest[0], records), max(deepest[1], levels)
        if records > MAX_DTYPE_DEPTH or levels > MAX_DTYPE_NESTING:
            break
        if _is_subarray_descr(node):
            stack.append((node[0], records, levels + 1))
        elif isinstance(node, list):
            for entry in node:
                if isinstance(entry, list) and len(entry) > 1:
                    stack.append((entry[1], records + 1, levels + 1 + (len(entry) > 2)))
    return deepest


def _dtype_nesting(dtype: np.dtype) -> tuple[int, int]:
    """How deeply records, and records and subarrays together, nest in ``dtype``, as _descr_nesting counts."""
    deepest = (0, 0)
    stack = [(dtype, 0, 0)]
    while stack:
        node, records, levels = stack.pop()
        deepest = max(deepest[0], records), max(deepest[1], levels)
        if records > MAX_DTYPE_DEPTH or levels > MAX_DTYPE_NESTING:
            break
        if node.subdtype is not None:
            stack.append((node.subdtype[0], records, levels + 1))
        elif node.fields is not None:
            stack.extend((node.fields[name][0], records + 1, levels + 1) for name in node.names or ())
    return deepest


def _is_subarray_descr(value: Any) -> bool:
    """Whether a JSON descr is numpy's subarray descr ``(descr, shape)``: ``[descr, [n, ...]]``.

    A record's second member is a list starting with a name, never a list of ints.
    """
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[1], list)
        and len(value[1]) > 0
        and all(type(n) is int for n in value[1])
    )


def _descr_from_json(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) > MAX_DESCR_CHARS:
            raise TypeError(f"a type string of {len(value)} characters (at most {MAX_DESCR_CHARS})")
        return value
    if not isinstance(value, list):
        raise TypeError("expected a string or a list of fields")
    if _is_subarray_descr(value):
        return (_descr_from_json(value[0]), tuple(value[1]))
    return [_record_field_from_json(item) for item in value]


def _record_field_from_json(item: Any) -> tuple[Any, ...]:
    if not isinstance(item, list) or len(item) not in (2, 3):
        raise TypeError("a record field must be [name, descr] or [name, descr, shape]")
    name = tuple(item[0]) if isinstance(item[0], list) else item[0]
    parts: list[Any] = [name, _descr_from_json(item[1])]
    if len(item) == 3:
        if not isinstance(item[2], list):
            raise TypeError("a record field's shape must be a list")
        parts.append(tuple(item[2]))
    return tuple(parts)
