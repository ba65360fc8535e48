"""Errors that say whose fault it is.

Every error asyncreduce raises is one of these (or the builtin ``TimeoutError``):

* ``UsageError``: you called it wrong (bad type, non-contiguous buffer, unknown op). Nothing
  was sent; the communicator stays usable.
* ``ClosedError``: you closed the communicator (or it was closed while the request was pending).
* ``BrokenError``: something outside failed (a peer died, a connection dropped). The cause is
  chained; the communicator must be rebuilt.
* ``MismatchError``: ranks disagree on an operation (kind, dtype, count, reduction, root). The
  message shows both sides; the operation fails on every rank, the communicator stays usable.
* ``TimeoutError`` (builtin): a deadline passed (rendezvous, a per-call ``timeout=``).
"""

from __future__ import annotations

__all__ = ["AsyncReduceError", "UsageError", "ClosedError", "BrokenError", "MismatchError"]


class AsyncReduceError(Exception):
    """Base class of every asyncreduce error except the builtin ``TimeoutError``."""


class UsageError(AsyncReduceError, ValueError):
    """The call was wrong: the message says what was wrong and what to do instead."""


class ClosedError(AsyncReduceError):
    """The communicator was closed by its owner."""


class BrokenError(AsyncReduceError):
    """A peer or a link failed; every pending request fails this way. Rebuild the communicator."""


class MismatchError(AsyncReduceError):
    """Ranks posted the same operation key with different parameters (both sides are named)."""
