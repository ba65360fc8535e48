"""The agreement: which posted operations every rank has posted, in one order all ranks share.

Theory of operation (sans-IO: bytes in, bytes out, no socket, thread or clock). Engines such as
MPI, Gloo and NCCL need every rank to issue collectives in the same order; our callers post
named operations in any order. Ranks therefore agree in numbered *rounds*. In round ``r`` each
rank sends every other rank one *contribution*: the operations it posted since its last one
(key, descriptor, priority). Round ``r`` is complete at a rank once it has sent its own and
received every peer's; since every rank sends the same contribution to all, every rank then
knows exactly the same thing, and computes the same answer without anybody coordinating:

* an operation is *agreed* in the first round after which every rank has posted it;
* the operations agreed in a round run in the order (highest priority first, then name, then
  instance), after those of earlier rounds;
* an agreed operation whose descriptors differ is a mismatch on every rank at once, named
  from each rank's side; it costs no extra message.

When does a rank contribute to round ``r``? When it has posted something new (an event), or
when a peer's contribution for ``r`` arrives while this rank waits for operations of its own
(so the round completes as soon as it can). A rank with nothing posted and nothing to wait for
stays silent: no operation can be agreed without its next post, which starts its contribution.
So rounds run only on events; an idle job sends nothing. A rank is at most one round ahead of
another (it needs everybody's contribution to leave a round), so contributions for the next
round are kept until this one completes.

Bytes per operation per peer: 24 + the name; one message per round per peer carries every
operation posted meanwhile (with a 16-byte round header). Round trips: an operation is agreed
one message latency after the last rank posts it, or two where a waiting rank must answer.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from ...transport.frame import MAX_NAME_BYTES, Descriptor

__all__ = ["Agreement", "Agreed", "Entry", "AgreementError", "encode", "decode"]

Key = tuple[bytes, int]
_HEAD = struct.Struct("<4sQI")  # magic, round, number of entries
_ENTRY = struct.Struct("<HQBBBIQq")  # name length, instance, descriptor (5 fields), priority
_MAGIC = b"ARv1"


class AgreementError(Exception):
    """A contribution that cannot be right (malformed, out of its round, a key posted twice)."""


class Entry(NamedTuple):
    """One rank's post of one operation, as it travels in a contribution (a tuple: one is
    built and read per operation and rank, on the latency path)."""

    name: bytes
    instance: int
    desc: Descriptor
    priority: int

    @property
    def key(self) -> Key:
        return self[0], self[1]


@dataclass(frozen=True)
class Agreed:
    """An operation every rank posted, in the order every rank runs it; ``mismatch`` says
    (from this rank's side) how the ranks' descriptors differ, or is None."""

    key: Key
    desc: Descriptor
    priority: int
    round: int
    mismatch: tuple[int, Descriptor, Descriptor] | None = None  # (other rank, mine, theirs)


def encode(round_: int, entries: Iterable[Entry]) -> bytes:
    """One contribution on the wire."""
    listed = list(entries)
    parts = [_HEAD.pack(_MAGIC, round_, len(listed))]
    for e in listed:
        d = e.desc
        parts.append(_ENTRY.pack(len(e.name), e.instance, d.kind, d.dtype, d.reduce, d.root,
                                 d.count, e.priority))  # fmt: skip
        parts.append(e.name)
    return b"".join(parts)


def decode(message: bytes | memoryview) -> tuple[int, list[Entry]]:
    """(round, entries) of a contribution; AgreementError if it is not one."""
    data = bytes(message)
    if len(data) < _HEAD.size:
        raise AgreementError(f"a contribution of {len(data)} bytes is shorter than its header")
    magic, round_, count = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise AgreementError(f"not a contribution (magic {magic!r})")
    if count > len(data):  # every entry takes more than one byte
        raise AgreementError(f"a contribution claims {count} entries in {len(data)} bytes")
    entries, at, end, step = [], _HEAD.size, len(data), _ENTRY.size
    for _ in range(count):
        if at + step > end:
            raise AgreementError("a contribution ends inside an entry")
        size, instance, kind, dtype, reduce, root, n, priority = _ENTRY.unpack_from(data, at)
        at += step
        if size > MAX_NAME_BYTES or at + size > end:
            raise AgreementError(f"an entry's name of {size} bytes does not fit")
        name = data[at : at + size]
        at += size
        entries.append(Entry(name, instance, Descriptor(kind, dtype, reduce, root, n), priority))
    if at != len(data):
        raise AgreementError(f"{len(data) - at} bytes after the last entry of a contribution")
    return round_, entries


class Agreement:
    """One rank's side of the rounds (see the module docstring).

    ``post`` and ``receive`` return the messages to send, as ``(peer, bytes)``; ``take_agreed``
    hands out what became agreed, in order."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.round = 0  # the round this rank is in
        self._new: list[Entry] = []  # posted here, not yet in a contribution
        self._sent = False  # this rank's contribution to self.round is out
        self._heard: dict[int, dict[int, list[Entry]]] = {}  # round -> peer -> entries
        self._mine: list[Entry] = []  # this rank's contribution to self.round
        self._known: dict[Key, dict[int, Entry]] = {}  # posted somewhere (rank -> entry)
        self._waiting: set[Key] = set()  # posted here, not yet agreed
        self._agreed: list[Agreed] = []
        self._peers = [p for p in range(world_size) if p != rank]
        self._stopped = False  # closing: no contribution to any new round

    # ---- events ------------------------------------------------------------------------------

    def post(self, entry: Entry) -> list[tuple[int, bytes]]:
        """This rank posted ``entry`` (its key must be new here)."""
        if entry.key in self._waiting:
            raise AgreementError(f"key {entry.key!r} is posted twice on rank {self.rank}")
        self._waiting.add(entry.key)
        self._new.append(entry)
        return self._contribute() if not self._sent else []

    def receive(self, peer: int, message: bytes | memoryview) -> list[tuple[int, bytes]]:
        """A peer's contribution arrived."""
        round_, entries = decode(message)
        if not (self.round <= round_ <= self.round + 1):
            raise AgreementError(
                f"rank {peer} sent a contribution for round {round_} while rank {self.rank} is "
                f"in round {self.round}"
            )
        heard = self._heard.setdefault(round_, {})
        if peer in heard:
            raise AgreementError(f"rank {peer} contributed to round {round_} twice")
        heard[peer] = entries
        out = []
        if (
            round_ == self.round
            and not self._sent
            and not self._stopped
            and (self._waiting or self._new)
        ):
            out = self._contribute()  # answer at once: this rank waits for something
        return out + self._maybe_complete()

    # ---- what the engine reads ---------------------------------------------------------------

    def take_agreed(self) -> list[Agreed]:
        """The operations agreed since the last call, in the order to run them."""
        agreed, self._agreed = self._agreed, []
        return agreed

    def posted_by(self, key: Key) -> set[int]:
        """The ranks known to have posted ``key`` (this round's contributions included)."""
        ranks = set(self._known.get(key, ()))
        if key in self._waiting:
            ranks.add(self.rank)
        for heard in self._heard.values():
            ranks.update(p for p, es in heard.items() if any(e.key == key for e in es))
        return ranks

    @property
    def waiting(self) -> int:
        """How many operations posted here are not agreed yet."""
        return len(self._waiting)

    # ---- rounds ------------------------------------------------------------------------------

    def _contribute(self) -> list[tuple[int, bytes]]:
        self._mine, self._new = self._new, []
        self._sent = True
        message = encode(self.round, self._mine)
        return [(p, message) for p in self._peers] + self._maybe_complete()

    def _maybe_complete(self) -> list[tuple[int, bytes]]:
        heard = self._heard.get(self.round, {})
        if not self._sent or len(heard) < len(self._peers):
            return []
        del self._heard[self.round]
        heard[self.rank] = self._mine
        complete, n, known = [], self.world_size, self._known
        for rank, entries in heard.items():
            for entry in entries:
                key = (entry[0], entry[1])
                posts = known.get(key)
                if posts is None:
                    posts = known[key] = {}
                elif rank in posts:
                    raise AgreementError(f"rank {rank} posted {key!r} twice")
                posts[rank] = entry
                if len(posts) == n:
                    complete.append(key)
        agreed = [self._agree(k) for k in complete]
        if len(agreed) > 1:
            agreed.sort(key=_order)
        self._agreed.extend(agreed)
        self.round += 1
        self._sent, self._mine = False, []
        follow = self._heard.get(self.round, {})
        if not self._stopped and (self._new or (follow and self._waiting)):
            return self._contribute()
        return []

    def stop(self) -> None:
        """This rank is leaving: it finishes the round it contributed to, if it did, and
        contributes to no other (its peers, told goodbye, will not expect one)."""
        self._stopped = True

    def _agree(self, key: Key) -> Agreed:
        posts = self._known.pop(key)
        self._waiting.discard(key)
        mine = posts[self.rank][2]
        priority = max(e[3] for e in posts.values())
        mismatch = None
        if any(e[2] != mine for e in posts.values()):
            other = min(r for r, e in posts.items() if e[2] != mine)
            mismatch = (other, mine, posts[other][2])
        return Agreed(key, mine, priority, self.round, mismatch)


def _order(agreed: Agreed) -> tuple[int, bytes, int]:
    return -agreed.priority, agreed.key[0], agreed.key[1]
