"""The C fold's codes are the Python code table's (issue 36, item 4).

kernels/reduction.py is the one source of the element-type and reduction codes: the frame
carries them (transport/frame.py), the lane's headers carry them, and kernels/_fold.h, which
the C helpers switch on, restates them as enum constants. A header number that drifted from
the table would make C fold one reduction as another, or read one type's bytes as another's,
and only on the paths that run in C. So the header is read here (its ``enum { ... }`` blocks
and any ``#define AR_NAME number``, C's numbering: a constant without ``= value`` is the one
before it plus one) and every constant in it is checked against the table, one test per
code, each failure naming the code. A constant the table does not know fails too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncreduce import algorithms
from asyncreduce.kernels.reduction import DTYPE_BY_CODE, DTYPES, REDUCTION_CODES, REDUCTIONS
from asyncreduce.transport import frame

HEADER = Path(__file__).resolve().parents[1] / "src" / "asyncreduce" / "kernels" / "_fold.h"

#: The element types the C fold and combine take (test_mailbox_core.py's FOLDED): each needs
#: its AR_ constant, and any other type must have none (C would claim a type numpy folds).
FOLDED_IN_C = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8")

_PREFIX = {"float": "F", "int": "I", "uint": "U"}


def c_name_of_dtype(name: str) -> str | None:
    """The header's name for an element type: float32 -> AR_F32, uint8 -> AR_U8 (None for a
    type with no such spelling: bool, bfloat16, complex64, ...)."""
    found = re.fullmatch(r"(float|int|uint)(\d+)", name)
    return f"AR_{_PREFIX[found.group(1)]}{found.group(2)}" if found else None


def c_constants(text: str) -> dict[str, int]:
    """Every enum constant and object-like integer ``#define`` named AR_* in a C header, with
    its value as C gives it."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)  # comments out
    found: dict[str, int] = {}
    for block in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", text):
        value = -1
        for item in (part.strip() for part in block.split(",")):
            if not item:
                continue
            entry = re.fullmatch(r"(\w+)\s*(?:=\s*(\w+))?", item)
            assert entry, f"kernels/_fold.h: cannot read the enum entry {item!r}"
            name, given = entry.groups()
            value = int(given, 0) if given is not None else value + 1
            if name.startswith("AR_"):
                assert name not in found, f"kernels/_fold.h defines {name} twice"
                found[name] = value
    for name, given in re.findall(r"^\s*#\s*define\s+(AR_\w+)\s+\(?\s*(-?\w+)\s*\)?\s*$", text,
                                  flags=re.M):  # fmt: skip
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", given):
            assert name not in found, f"kernels/_fold.h defines {name} twice"
            found[name] = int(given, 0)
    return found


CONSTANTS = c_constants(HEADER.read_text())
REDUCTION_NAMES = {f"AR_{name.upper()}": name for name in REDUCTIONS}
DTYPE_NAMES = {c: name for name in DTYPES if (c := c_name_of_dtype(name)) is not None}


def test_the_reader_numbers_as_c_does() -> None:
    """(The reader itself: implicit values count up from the one before, from 0 at first;
    comments and other defines are not constants.)"""
    text = """/* enum { AR_GONE = 9 }; */
    enum { AR_A, AR_B = 5, AR_C, /* AR_D = 1, */ AR_E = 0x10 };
    enum named { AR_F = 2 };
    #define AR_G 7
    #define AR_H(x) (x + 1)
    #define AR_I 200e-6
    """
    assert c_constants(text) == {"AR_A": 0, "AR_B": 5, "AR_C": 6, "AR_E": 16, "AR_F": 2,
                                 "AR_G": 7}  # fmt: skip


def test_the_header_holds_codes_at_all() -> None:
    """(So the tests below cannot pass by reading nothing.)"""
    assert len(CONSTANTS) >= len(REDUCTIONS) + len(FOLDED_IN_C), sorted(CONSTANTS)


@pytest.mark.parametrize("name", REDUCTIONS)
def test_a_reductions_c_code_is_the_tables(name: str) -> None:
    c_name = f"AR_{name.upper()}"
    assert c_name in CONSTANTS, f"kernels/_fold.h has no {c_name} (REDUCTION_CODES[{name!r}])"
    assert CONSTANTS[c_name] == REDUCTION_CODES[name], (
        f"kernels/_fold.h: {c_name} = {CONSTANTS[c_name]}, but kernels/reduction.py's "
        f"REDUCTION_CODES[{name!r}] = {REDUCTION_CODES[name]}"
    )


@pytest.mark.parametrize("name", FOLDED_IN_C)
def test_an_element_types_c_code_is_the_tables(name: str) -> None:
    c_name = c_name_of_dtype(name)
    assert c_name in CONSTANTS, f"kernels/_fold.h has no {c_name} (DTYPES[{name!r}].code)"
    assert CONSTANTS[c_name] == DTYPES[name].code, (
        f"kernels/_fold.h: {c_name} = {CONSTANTS[c_name]}, but kernels/reduction.py's "
        f"DTYPES[{name!r}].code = {DTYPES[name].code}"
    )


def test_every_c_code_names_a_code_of_the_table() -> None:
    """No constant the table does not know (a type C would claim that numpy folds, or a
    reduction that is not one), and no type C folds beyond FOLDED_IN_C."""
    unknown = sorted(set(CONSTANTS) - set(REDUCTION_NAMES) - set(DTYPE_NAMES))
    assert not unknown, f"kernels/_fold.h: {unknown} are in no code table of kernels/reduction.py"
    typed = sorted(DTYPE_NAMES[c] for c in CONSTANTS if c in DTYPE_NAMES)
    assert typed == sorted(FOLDED_IN_C), f"kernels/_fold.h folds {typed}"


def test_the_table_is_one_table() -> None:
    """The frame and the algorithms take the codes from kernels/reduction.py, not copies; the
    codes are distinct, so a C switch on them has one case per code."""
    assert algorithms.REDUCTION_CODES is REDUCTION_CODES
    assert algorithms.DTYPE_BY_CODE is DTYPE_BY_CODE and frame.DTYPE_BY_CODE is DTYPE_BY_CODE
    assert frame.REDUCTION_CODES is REDUCTION_CODES
    assert len(DTYPE_BY_CODE) == len(DTYPES), "two element types share a code"
    assert len(set(REDUCTION_CODES.values())) == len(REDUCTIONS), "two reductions share a code"
