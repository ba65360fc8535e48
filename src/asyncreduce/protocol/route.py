"""Which way an operation goes: the engine, a direct run on its caller's thread, or the
same-host lane. The one place that says "small".

Every operation can go to the engine (its thread matches it with the peers' by key, over the
sockets). Two shorter ways exist for what is small and frequent, an allreduce of up to
``SMALL_ALLREDUCE_BYTES`` or a barrier:

- the **lane** (lane/): the ranks' shared memory, where every rank of the world shares this
  host and opened it; named operations only where the lane has named slots;
- a **direct run** (engine/direct.py): a caller that waits at once runs the exchange itself,
  over the sockets, on the world's own numbering (a group's algorithm is renumbered, and the
  engine runs it).

Every rank routes an operation the same way from the same facts (kind, size, name, the lane's
reach), so where the ways differ across ranks it is because a rank's lane refused it, and the
lane's rules hand it to the engine everywhere (lane/named.py). Whether a direct run may start
now is the engine's state, not a fact of the operation: ``Session.quiet`` says it, and a direct
run that may not start is posted to the engine where it stands. Pure: facts in, a way out.
"""

from __future__ import annotations

import enum

from ..algorithms import SMALL_ALLREDUCE_BYTES

__all__ = ["Reach", "Way", "route", "small"]


class Way(enum.IntEnum):
    """Where an operation goes."""

    ENGINE = 0
    DIRECT = 1
    LANE = 2


class Reach(enum.IntEnum):
    """What the world's same-host lane takes."""

    NONE = 0  # no lane: ranks on several hosts, a group, ASYNCREDUCE_LANE=0, before it opens
    UNNAMED = 1  # unnamed operations (no named slots: ASYNCREDUCE_LANE_NAMED=0 on some rank)
    NAMED = 2  # named ones too


def small(nbytes: int) -> bool:
    """Whether a payload of ``nbytes`` is small: the lane and the direct run take it, and the
    engine busy-polls for it a while (``Session.post``, ``Engine.submit``)."""
    return nbytes <= SMALL_ALLREDUCE_BYTES


def route(kind: str, nbytes: int, named: bool, reach: Reach, waiting: bool, whole: bool) -> Way:
    """The way of a ``kind`` operation of ``nbytes`` (``named``: matched by name), where the
    lane takes ``reach``; ``waiting``: its caller waits for it at once; ``whole``: on the
    world's own numbering, not a group's."""
    if kind != "barrier" and (kind != "allreduce" or nbytes > SMALL_ALLREDUCE_BYTES):
        return Way.ENGINE
    if reach == Reach.NAMED or (reach == Reach.UNNAMED and not named):
        return Way.LANE
    return Way.DIRECT if waiting and whole else Way.ENGINE
