"""The conversion's fast paths give exactly what the general paths give, and refuse what they refuse.

Header texts numpy writes skip the Python parser; the copy pass reads each
member through the location the scan recorded, with no zip parsing, and must
still find a corrupt member, a source changed since the scan, and write the
same bytes without pread/pwrite.
"""

from __future__ import annotations

import ast
import io

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from npz2mmap import npzfile

SHAPES = st.lists(st.integers(0, 10**19 - 1), max_size=4).map(tuple)  # longer numbers: the parser
DESCRS = st.sampled_from(["<f8", ">i4", "|u1", "|S10", "<U3", "<M8[ns]", "|b1", ">c16", "|V7", "<m8[s]"])


def header_text(descr: str, fortran: bool, shape: tuple[int, ...]) -> str:
    """A header as numpy writes it (format._wrap_header: padded with spaces, ending in a newline)."""
    text = repr({"descr": descr, "fortran_order": fortran, "shape": shape})[:-1] + ", }"
    return text + " " * (63 - (len(text) + 10) % 64) + "\n"


@given(DESCRS, st.booleans(), SHAPES)
def test_numpy_header_texts_skip_the_parser_and_read_as_the_parser_reads_them(descr, fortran, shape) -> None:
    text = header_text(descr, fortran, shape)
    assert npzfile._canonical_header(text) == ast.literal_eval(text)


def test_headers_numpy_saves_take_the_fast_path() -> None:
    for array in [np.zeros(()), np.zeros((3, 64, 64), ">f4"), np.zeros((2, 3), order="F"), np.zeros(0, "S5")]:
        stream = io.BytesIO()
        np.save(stream, array)
        raw = stream.getvalue()
        text = raw[10 : 10 + int.from_bytes(raw[8:10], "little")].decode("latin1")
        assert npzfile._canonical_header(text) == ast.literal_eval(text)


@given(DESCRS, st.booleans(), SHAPES, st.data())
def test_any_other_text_is_left_to_the_parser(descr, fortran, shape, data) -> None:
    """A text the fast path reads differently from the parser (or one it refuses) is never taken."""
    text = header_text(descr, fortran, shape)
    position = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["0", " ", ",", "'", "L", "\\", "\t", "#", "(", "1", "\x00", "é"]))
    edited = text[:position] + edit + text[position + data.draw(st.integers(0, 1)) :]
    fast = npzfile._canonical_header(edited)
    if fast is not None:
        assert fast == ast.literal_eval(edited)
