"""Numbers from ASYNCREDUCE_* environment variables, checked in one place.

Every tunable the library reads from the environment (timeouts, buffer sizes, spin time) goes
through ``env_number``, so a value that is not a number, or out of range, fails with the same
message naming the variable, wherever it is read: the transport, the protocol or an engine.
"""

from __future__ import annotations

import math
import os
from typing import TypeVar

from .errors import UsageError

__all__ = ["env_number", "native_allowed"]

_KINDS = {int: "an integer", float: "a number"}
Number = TypeVar("Number", int, float)


def env_number(name: str, default: Number, kind: type[Number], least: float) -> Number:
    """The number in environment variable ``name`` (``default`` if unset), at least ``least``."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not least <= value < math.inf:
        raise UsageError(
            f"{name}={text!r}: expected {_KINDS.get(kind, kind.__name__)} >= {least:g}"
        )
    return value


def native_allowed() -> bool:
    """ASYNCREDUCE_NATIVE is not 0: the C helpers may be used where they were built (the
    lane's mailbox, the direct run's look)."""
    return env_number("ASYNCREDUCE_NATIVE", 1, int, 0) > 0
