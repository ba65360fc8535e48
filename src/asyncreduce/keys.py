"""Operation keys: how ranks that post in different orders still find the same operation.

Theory of operation. An operation's key is its name (under the communicator's prefix) plus how
many times this rank posted that name before. Named operations may therefore be posted in any
order on each rank; unnamed ones share the name "" and, as in MPI, must be posted in the same
order everywhere. A group's keys live under a prefix of their own (``grp-DIGEST-N/``: the digest
of its members' ranks in the engine, ``N`` how many groups of those members this communicator
made before), so its operations never meet the parent's. Point-to-point operations are named by
source, destination and tag (``p2p:SRC>DST:TAG``), so a send and the receive that names its
source match like any other operation, in the order posted.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import defaultdict

from .errors import UsageError
from .transport.frame import MAX_NAME_BYTES

__all__ = ["Key", "Keys", "p2p_name"]

Key = tuple[bytes, int]  # (the name on the wire, how many times this rank posted it before)


class Keys:
    """One communicator's counters of posted names (any thread may ask for the next key)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._unnamed = prefix.encode()  # the wire name of every unnamed operation
        self._fits = len(self._unnamed) <= MAX_NAME_BYTES  # (else every post is refused below)
        self._lock = threading.Lock()
        self._unnamed_posted = itertools.count()  # next() is one C call, atomic under the GIL
        self._posted: defaultdict[str, int] = defaultdict(int)
        self._groups: defaultdict[tuple[int, ...], int] = defaultdict(int)

    def next(self, name: str | None) -> Key:
        """The key of the next operation posted as ``name`` (None: unnamed)."""
        if name is None:  # most posts: nothing to check or encode, no lock
            if not self._fits:
                too_long = len(self._unnamed)
                raise UsageError(f"name is {too_long} bytes long; at most {MAX_NAME_BYTES}")
            return self._unnamed, next(self._unnamed_posted)
        if not isinstance(name, str) or not name:
            raise UsageError(f"name must be a non-empty string or None, got {name!r}")
        name = self.prefix + name
        wire = name.encode()
        if len(wire) > MAX_NAME_BYTES:
            raise UsageError(f"name is {len(wire)} bytes long; at most {MAX_NAME_BYTES}")
        with self._lock:
            instance = self._posted[name]
            self._posted[name] = instance + 1
        return wire, instance

    def for_group(self, members: tuple[int, ...], engine_ranks: tuple[int, ...]) -> Keys:
        """The keys of a new group of ``members`` (this communicator's ranks), which are
        ``engine_ranks`` in the engine: every member numbers its groups alike."""
        with self._lock:
            instance = self._groups[members]
            self._groups[members] = instance + 1
        digest = hashlib.sha1(repr(engine_ranks).encode()).hexdigest()[:12]
        return Keys(f"{self.prefix}grp-{digest}-{instance}/")


def p2p_name(src: int, dst: int, tag: int) -> str:
    """The name of the point-to-point operations from ``src`` to ``dst`` with ``tag``."""
    if not isinstance(tag, int) or not 0 <= tag < 2**63:
        raise UsageError(f"tag must be a non-negative int, got {tag!r}")
    return f"p2p:{src}>{dst}:{tag}"
