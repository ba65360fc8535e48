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

from typing import Final

from ..algorithms import SMALL_ALLREDUCE_BYTES

__all__ = ["DIRECT", "ENGINE", "LANE", "NAMED", "NO_LANE", "UNNAMED", "route", "small"]

# Where an operation goes (plain ints, not an enum: ``route`` runs for every call, and an
# enum's members cost a lookup each, a tenth of a lane allreduce in all; see docs/performance.md)
ENGINE: Final = 0
DIRECT: Final = 1
LANE: Final = 2

# What the world's same-host lane takes (its reach)
NO_LANE: Final = 0  # no lane: ranks on several hosts, a group, ASYNCREDUCE_LANE=0, before it opens
UNNAMED: Final = 1  # unnamed operations (no named slots: ASYNCREDUCE_LANE_NAMED=0 on some rank)
NAMED: Final = 2  # named ones too

_SMALL = SMALL_ALLREDUCE_BYTES


def small(nbytes: int) -> bool:
    """Whether a payload of ``nbytes`` is small: the lane and the direct run take it, and the
    engine busy-polls for it a while (``Session.post``, ``Engine.submit``)."""
    return nbytes <= _SMALL


def route(kind: str, nbytes: int, named: bool, reach: int, waiting: bool, whole: bool) -> int:
    """The way (``ENGINE``, ``DIRECT``, ``LANE``) of a ``kind`` operation of ``nbytes``
    (``named``: matched by name), where the lane takes ``reach`` (``NO_LANE``, ``UNNAMED``,
    ``NAMED``); ``waiting``: its caller waits for it at once; ``whole``: on the world's own
    numbering, not a group's."""
    if kind != "barrier" and (kind != "allreduce" or nbytes > _SMALL):
        return ENGINE
    if reach == NAMED or (reach == UNNAMED and not named):
        return LANE
    return DIRECT if waiting and whole else ENGINE
