"""Errors that say whose fault it is.

Every error asyncreduce raises is one of these (or the builtin ``TimeoutError``):

* ``UsageError``: you called it wrong (bad type, non-contiguous buffer, unknown op). Nothing
  was sent; the communicator stays usable.
* ``ClosedError``: you closed the communicator (or it was closed while the request was pending).
* ``BrokenError``: something outside failed (a peer died, a connection dropped). The cause is
  chained; the communicator must be rebuilt.
* ``MismatchError``: ranks disagree on an operation (kind, dtype, count, reduction, root). The
  message shows both sides; the operation fails on every rank.
* ``AuthenticationError``: a peer and this rank disagree about the shared secret
  (``ASYNCREDUCE_SECRET``); never retried, the message says which side lacks it.
* ``TimeoutError`` (builtin): a deadline passed (rendezvous, a per-call ``timeout=``, a peer
  silent for ``ASYNCREDUCE_PEER_TIMEOUT``).

Failure is sticky: after the first ``BrokenError``, ``MismatchError`` or ``TimeoutError`` of an
operation, the communicator is broken on every rank, and every pending and later request fails
with ``BrokenError`` whose ``__cause__`` is that first error. Build a new communicator.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AsyncReduceError",
    "UsageError",
    "ClosedError",
    "BrokenError",
    "MismatchError",
    "AuthenticationError",
    "ranks_phrase",
]


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


class AuthenticationError(AsyncReduceError):
    """A peer and this rank disagree about the shared secret (or about having one at all).

    Not retried: a wrong secret does not become right by waiting. The message says which side
    lacks or mismatches the secret and what to set; it never contains the secret itself.
    """


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 1, 2`` or ``no rank``: ranks named the same way in every message."""
    listed = sorted(ranks)
    if not listed:
        return "no rank"
    words = ", ".join(map(str, listed))
    return f"rank {words}" if len(listed) == 1 else f"ranks {words}"
