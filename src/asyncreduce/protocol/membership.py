"""Agreement on who is alive: after a failure, the ranks that remain agree on one membership,
with no coordinator and without the lost rank's help (issue 37). Sans-IO: messages in,
messages out (``outbox``), no socket, thread or clock.

Theory of operation. One agreement per membership (its ``epoch``) decides one value: the set of
ranks to exclude. It is single-decree Paxos (Lamport, "Paxos Made Simple") among the ranks of
that membership, each of them proposer, acceptor and learner:

- **Quorums.** Every rank weighs 2 and the membership's lowest rank 3, and a quorum is more
  than half of the total weight. Any two quorums share a rank, which is what keeps the decision
  one however messages are delayed, reordered or lost with their sender, and whoever suspects
  whom: a rank that is frozen, cut off or slow is just an acceptor that does not answer. Of two
  halves of a partition, only the one holding the lowest rank can decide; a side without a
  quorum never decides (no split brain), and its ranks give up when their caller's patience runs
  out.
- **Who proposes.** The lowest rank this rank does not suspect (``leader``). A rank that thinks
  itself leader proposes with ballot ``(round, rank)``; a higher ballot wins. A proposer that is
  refused by a lower rank's ballot waits (that rank leads) until ``retry``, even if it suspects
  that rank (two ranks that cannot reach each other would else pre-empt each other for ever);
  refused by a higher rank's, it tries again at once with a higher round. A rank that joins
  the agreement and does not lead tells its leader so (START), so a leader that has noticed
  nothing yet starts.
- **Phase 1.** PREPARE(b): an acceptor that promised nothing higher promises b and answers with
  what it accepted (ballot and value, if any) and whom it suspects; else it refuses (NACK, with
  its promise).
- **Phase 2.** Once a quorum promised, and so did every rank that neither the proposer nor any
  promiser suspects (so a rank that only some have noticed lost is not kept for want of asking
  the others), the proposer's value is the value accepted under the highest ballot among the
  promises (Paxos's rule: a value that may be decided is never replaced), else the ranks
  suspected by the proposer or any promiser that did not themselves promise, and of the
  promisers those cut off from the ones kept: in rank order from the proposer, a promiser that
  suspects a rank kept, or that one suspects, goes (a link down between two live ranks would
  else break the next membership again, and the next). ACCEPT(b, v): an acceptor that
  promised nothing higher accepts.
- **Decision.** With a quorum of acceptances the value is decided: DECIDE(v) goes to every
  rank of the membership, the excluded too (a live one learns it is out), and every rank that
  learns it passes it on once, so a proposer lost halfway through telling does not leave some
  ranks without it. A rank that knows the decision answers any later message with it.

The survivors are then ``members - excluded``: the proposer and every promiser of the deciding
ballot's phase 1 are among them, so they always hold a quorum of the old membership.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

__all__ = [
    "Ballot", "Prepare", "Promise", "Accept", "Accepted", "Nack", "Decide", "Start", "Message",
    "Membership", "MembershipError", "encode", "decode",
]  # fmt: skip


class MembershipError(Exception):
    """A membership message that cannot be right (malformed, or naming a rank not a member)."""


class Ballot(NamedTuple):
    """A proposal's number: higher rounds win, and of one round the higher rank."""

    round: int
    rank: int


NO_BALLOT = Ballot(0, -1)


class Prepare(NamedTuple):
    ballot: Ballot


class Promise(NamedTuple):
    ballot: Ballot
    accepted: Ballot  # NO_BALLOT: nothing accepted
    value: frozenset[int]  # what it accepted (empty if nothing)
    suspects: frozenset[int]


class Accept(NamedTuple):
    ballot: Ballot
    value: frozenset[int]


class Accepted(NamedTuple):
    ballot: Ballot


class Nack(NamedTuple):
    ballot: Ballot  # the ballot refused
    promised: Ballot  # what the acceptor promised instead


class Decide(NamedTuple):
    value: frozenset[int]


class Start(NamedTuple):
    """ "I am agreeing on who is alive": its leader starts, if it has not."""


Message = Prepare | Promise | Accept | Accepted | Nack | Decide | Start


class Membership:
    """Rank ``rank``'s part in agreeing who remains of ``members`` (see the module docstring).
    Feed it ``suspect``, ``on_message`` and ``retry``; send what it leaves in ``outbox``
    (``(peer, message)``, in order), then clear it; ``excluded`` is the decision, once made."""

    def __init__(self, rank: int, members: Iterable[int]) -> None:
        self.rank = rank
        self.members = frozenset(members)
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of {sorted(self.members)}")
        lowest = min(self.members)
        self._weight = {m: 3 if m == lowest else 2 for m in self.members}
        self._quorum = sum(self._weight.values()) // 2 + 1
        self.suspects: set[int] = set()
        self.outbox: list[tuple[int, Message]] = []
        self.excluded: frozenset[int] | None = None  # the decision
        self._promised = NO_BALLOT
        self._accepted: tuple[Ballot, frozenset[int]] | None = None
        self._round = 0  # the highest round seen
        self._ballot: Ballot | None = None  # this rank's proposal in flight
        self._promises: dict[int, Promise] = {}
        self._accepts: set[int] = set()
        self._value: frozenset[int] | None = None  # its value, once in phase 2
        self._deferring = False  # refused by a lower rank's ballot: wait for ``retry``
        self._told = False  # told its leader it agrees (START)

    # ---- what the caller asks ------------------------------------------------------------------

    @property
    def leader(self) -> int:
        """The lowest member this rank does not suspect (itself at worst)."""
        return min(self.members - self.suspects)

    @property
    def survivors(self) -> frozenset[int] | None:
        """The membership agreed on, once decided."""
        return None if self.excluded is None else self.members - self.excluded

    def weight(self, ranks: Iterable[int]) -> int:
        return sum(self._weight.get(r, 0) for r in set(ranks))

    def has_quorum(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` weigh more than half of the membership (see the docstring)."""
        return self.weight(ranks) >= self._quorum

    # ---- events --------------------------------------------------------------------------------

    def suspect(self, peers: Iterable[int]) -> None:
        """The failure detector suspects ``peers`` (a lost connection, a silent peer): start or
        join the agreement; this rank proposes if it leads and is not proposing yet, and a
        proposal waiting for a rank now suspected goes on without it."""
        new = (set(peers) & self.members) - self.suspects - {self.rank}
        self.suspects |= new
        if self.excluded is not None:
            return
        if self.leader != self.rank:
            if new or not self._told:  # (its leader may be new)
                self._told = True
                self.outbox.append((self.leader, Start()))
        elif self._ballot is None and not self._deferring:
            self._propose()
        elif self._value is None and self._promises:
            self._maybe_accept()

    def retry(self) -> None:
        """The caller's timer: a proposal that did not conclude in time starts again, higher
        (a leader that waited on a lower rank's ballot, or on answers that did not come)."""
        self._deferring = False
        if self.excluded is None and self.leader == self.rank:
            self._propose()
        elif self.excluded is None:
            self.outbox.append((self.leader, Start()))

    def on_message(self, peer: int, message: Message) -> None:
        """A message from ``peer`` (validated by ``decode``: a member's, well formed)."""
        if peer not in self.members or peer == self.rank:
            return
        if self.excluded is not None:
            if not isinstance(message, Decide):
                self.outbox.append((peer, Decide(self.excluded)))
            return
        self._take(peer, message)

    def _take(self, peer: int, message: Message) -> None:
        if isinstance(message, Start):
            if self._ballot is None and not self._deferring and self.leader == self.rank:
                self._propose()
        elif isinstance(message, Decide):
            self._decide(message.value)
        elif isinstance(message, Prepare):
            self._on_prepare(peer, message.ballot)
        elif isinstance(message, Accept):
            self._on_accept(peer, message.ballot, message.value)
        elif isinstance(message, Promise):
            self._on_promise(peer, message)
        elif isinstance(message, Accepted):
            self._on_accepted(peer, message.ballot)
        elif isinstance(message, Nack):
            self._on_nack(message)

    # ---- the proposer --------------------------------------------------------------------------

    def _propose(self) -> None:
        self._round += 1
        ballot = self._ballot = Ballot(self._round, self.rank)
        self._promises, self._accepts, self._value = {}, set(), None
        self._send_others(Prepare(ballot))
        self._on_prepare(self.rank, ballot)

    def _on_promise(self, peer: int, promise: Promise) -> None:
        if promise.ballot != self._ballot or self._value is not None:
            return
        self._promises[peer] = promise
        self._maybe_accept()

    def _maybe_accept(self) -> None:
        """Phase 2, once a quorum and every rank nobody suspects promised (see above)."""
        promised = self._promises.keys()
        suspected = self.suspects.union(*(p.suspects for p in self._promises.values()))
        if not self.has_quorum(promised) or self.members - promised - suspected:
            return
        accepted = [p for p in self._promises.values() if p.accepted != NO_BALLOT]
        if accepted:
            value = max(accepted, key=lambda p: p.accepted).value
        else:
            value = frozenset(suspected - promised) | self._cut_off()
        ballot = self._ballot
        assert ballot is not None
        self._value = value
        self._send_others(Accept(ballot, value))
        self._on_accept(self.rank, ballot, value)

    def _cut_off(self) -> frozenset[int]:
        """The promisers cut off from the ones kept (see the module docstring)."""
        heard = {peer: p.suspects for peer, p in self._promises.items()}
        kept = [self.rank]
        for peer in sorted(heard.keys() - {self.rank}):
            if not heard[peer] & set(kept) and not any(peer in heard[k] for k in kept):
                kept.append(peer)
        return frozenset(heard.keys() - set(kept))

    def _on_accepted(self, peer: int, ballot: Ballot) -> None:
        if ballot != self._ballot or self._value is None:
            return
        self._accepts.add(peer)
        if self.has_quorum(self._accepts):
            self._decide(self._value)

    def _on_nack(self, nack: Nack) -> None:
        if nack.ballot != self._ballot:
            return
        self._round = max(self._round, nack.promised.round)
        self._ballot = None  # refused: a higher ballot is in play
        if nack.promised.rank > self.rank and self.leader == self.rank:
            self._propose()  # a rank that thinks a lower one lost: take over at once
        elif nack.promised.rank < self.rank:
            self._deferring = True  # a lower rank leads: wait for ``retry``

    # ---- the acceptor --------------------------------------------------------------------------

    def _on_prepare(self, peer: int, ballot: Ballot) -> None:
        self._round = max(self._round, ballot.round)
        if ballot < self._promised:
            self._reply(peer, Nack(ballot, self._promised))
            return
        self._promised = ballot
        taken, value = self._accepted or (NO_BALLOT, frozenset())
        self._reply(peer, Promise(ballot, taken, value, frozenset(self.suspects)))

    def _on_accept(self, peer: int, ballot: Ballot, value: frozenset[int]) -> None:
        self._round = max(self._round, ballot.round)
        if ballot < self._promised:
            self._reply(peer, Nack(ballot, self._promised))
            return
        self._promised = ballot
        self._accepted = (ballot, value)
        self._reply(peer, Accepted(ballot))

    def _reply(self, peer: int, message: Message) -> None:
        """Answer ``peer``; an answer to this rank's own proposal is taken at once."""
        if peer != self.rank:
            self.outbox.append((peer, message))
        else:
            self._take(peer, message)

    # ---- the learner ---------------------------------------------------------------------------

    def _decide(self, value: frozenset[int]) -> None:
        if self.excluded is not None:
            return
        self.excluded = value
        self._send_others(Decide(value))

    def _send_others(self, message: Message) -> None:
        for peer in sorted(self.members - {self.rank}):
            self.outbox.append((peer, message))


# ---- on the wire -------------------------------------------------------------------------------
# A message is: type (u8), then its ballots (round u32, rank u32 each) and its sets (count u32,
# then each rank u32, ascending). Nothing is trusted before ``decode`` has checked it.

_TYPES: dict[type, int] = {
    Prepare: 1, Promise: 2, Accept: 3, Accepted: 4, Nack: 5, Decide: 6, Start: 7,
}  # fmt: skip
_BALLOTS = {1: 1, 2: 2, 3: 1, 4: 1, 5: 2, 6: 0, 7: 0}  # how many ballots each type carries
_SETS = {1: 0, 2: 2, 3: 1, 4: 0, 5: 0, 6: 1, 7: 0}  # and how many sets
_U8, _U32 = struct.Struct("<B"), struct.Struct("<I")
_BALLOT = struct.Struct("<II")
_NONE = 0xFFFFFFFF  # NO_BALLOT's rank on the wire


def encode(message: Message) -> bytes:
    """The bytes of ``message`` (see above)."""
    code = _TYPES[type(message)]
    parts = [_U8.pack(code)]
    for field in message:
        if isinstance(field, Ballot):
            parts.append(_BALLOT.pack(field.round, _NONE if field.rank < 0 else field.rank))
        else:
            ranks = sorted(field)
            parts.append(_U32.pack(len(ranks)) + b"".join(_U32.pack(r) for r in ranks))
    return b"".join(parts)


def decode(data: bytes, world_size: int) -> Message:
    """The message in ``data``, checked: a known type, its exact length, ranks below
    ``world_size`` in ascending order; else MembershipError."""
    view = memoryview(data)
    if len(view) < 1 or view[0] not in _BALLOTS:
        raise MembershipError(f"not a membership message (type {bytes(view[:1])!r})")
    code, at = view[0], 1
    ballots: list[Ballot] = []
    for _ in range(_BALLOTS[code]):
        if len(view) < at + _BALLOT.size:
            raise MembershipError("a membership message ends inside a ballot")
        round_, rank = _BALLOT.unpack_from(view, at)
        at += _BALLOT.size
        if rank == _NONE:
            ballots.append(NO_BALLOT)
        elif rank < world_size:
            ballots.append(Ballot(round_, rank))
        else:
            raise MembershipError(f"a ballot names rank {rank} of a world of {world_size}")
    sets = []
    for _ in range(_SETS[code]):
        if len(view) < at + 4:
            raise MembershipError("a membership message ends inside a set")
        (count,) = _U32.unpack_from(view, at)
        at += 4
        if count > world_size or len(view) < at + 4 * count:
            raise MembershipError(f"a set of {count} ranks does not fit its message")
        ranks = [_U32.unpack_from(view, at + 4 * i)[0] for i in range(count)]
        at += 4 * count
        if any(r >= world_size for r in ranks) or ranks != sorted(set(ranks)):
            raise MembershipError(f"a set of ranks out of order or range: {ranks[:8]}")
        sets.append(frozenset(ranks))
    if at != len(view):
        raise MembershipError(f"{len(view) - at} bytes after a membership message")
    return _build(code, ballots, sets)


def _build(code: int, ballots: list[Ballot], sets: list[frozenset[int]]) -> Message:
    if code == 1:
        return Prepare(ballots[0])
    if code == 2:
        return Promise(ballots[0], ballots[1], sets[0], sets[1])
    if code == 3:
        return Accept(ballots[0], sets[0])
    if code == 4:
        return Accepted(ballots[0])
    if code == 5:
        return Nack(ballots[0], ballots[1])
    if code == 6:
        return Decide(sets[0])
    return Start()
