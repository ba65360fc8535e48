"""Argument types for argparse, shared by the command line and the benchmarks.

Each turns one command-line word into a checked value, or raises ArgumentTypeError whose
message says what was wrong ("must be at least 1, got 0"), which argparse prints after the
option's name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["integer", "number", "positive_int", "positive_float", "port", "seconds"]


def _parsed(text: str, convert: Callable[[str], T], what: str) -> T:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def integer(text: str) -> int:
    return _parsed(text, int, "an integer")


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def number(text: str, what: str = "a number") -> float:
    return _parsed(text, float, what)


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def port(text: str) -> int:
    value = integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {value}")
    return value


def seconds(text: str) -> float:
    value = number(text, "a number of seconds")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value
