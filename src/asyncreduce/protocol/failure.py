"""How failures are worded: the error an operation gets when the communicator broke under it,
and a fresh error of the same class for a later post of a key that failed already.

Failure is sticky and the same everywhere: the first failure breaks the session (session.py,
``fail_all``); every pending operation then fails with ``BrokenError`` chained to that cause,
and a peer told with a ``Failed`` message fails that operation with the class it names.
"""

from __future__ import annotations

from typing import Any

from ..errors import BrokenError

__all__ = ["broken_by", "same_error"]


def broken_by(op: Any, cause: BaseException) -> BrokenError:
    """The error of an operation (anything with a ``label``) that fails because the
    communicator broke: ``cause`` chained. The ordered engine's failures are worded alike."""
    error = BrokenError(f"{op.label} failed: the communicator is broken: {cause}")
    error.__cause__ = cause
    return error


def same_error(error: BaseException, message: str) -> BaseException:
    """A new exception of the same class as ``error`` with ``message``, chained to it."""
    new = type(error)(message)
    new.__cause__ = error
    return new
