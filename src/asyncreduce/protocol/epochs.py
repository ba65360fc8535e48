"""The Session's memberships: after a failure, the agreement on who is alive (membership.py)
carried over the connections the ranks already have, and the move to the survivors.

A membership has a number, its ``epoch`` (0 at init), and the ranks in it. Failure still
breaks the session (sticky, as before); what is new is that it can end: when a caller asks to
go on (``shrink``: ``Communicator.shrink``), or a peer's agreement message arrives, this rank
takes part in the agreement of its epoch, suspecting the peers it lost (``lost``), the silent
ones and those that said goodbye. Once decided, a survivor's session moves to epoch + 1:
unbroken, with the excluded ranks departed (never heard again, never sent to, never
waited for), nothing of the old epoch kept but the frames already come for the new one; the
caller learns it through an AGREED command. An excluded rank stays broken and is told so.

What belongs to which epoch: operation keys of epoch ``e`` > 0 start with ``epoch_prefix(e)``
(the survivors' communicator numbers its operations under it), and ABORT and AGREE frames carry
their epoch; so an operation, a frame, a failure or an abort of an earlier membership, still in
flight when the survivors moved on, is dropped instead of breaking the new one.

A mixin of ``Session`` (session.py), which holds the state declared in parts.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import BrokenError
from . import commands as do
from . import membership, wire
from .flow import Flow
from .matching import Matching
from .membership import Membership, MembershipError
from .parts import SessionParts
from .stall import StallInspector
from .wire import Control, Key

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..transport.frame import Descriptor
    from .operation import Operation

__all__ = ["AGREE_RETRY", "Epochs", "epoch_prefix"]

log = logging.getLogger("asyncreduce.engine")

AGREE_RETRY = 0.5  # seconds: a leader whose proposal did not conclude proposes again, higher


def epoch_prefix(epoch: int) -> bytes:
    """What every operation key of membership ``epoch`` starts with (none for the first)."""
    return f"\0e{epoch}/".encode() if epoch else b""


class Epochs(SessionParts):
    """The agreement after a failure and the move to the survivors (see the module docstring)."""

    if TYPE_CHECKING:  # the Session's (session.py) and its control traffic's (controls.py)

        def fail_all(
            self, error: BaseException, about: tuple[Key, Descriptor] | None = None
        ) -> None: ...
        def _control(self, peers: Iterable[int], message: Control) -> None: ...
        def _on_control(self, peer: int, message: Control) -> None: ...
        def _fail(self, op: Operation, error: BaseException) -> None: ...

    def shrink(self, now: float) -> None:
        """The caller wants to go on with the survivors: break if not broken (this membership
        is over for every rank), and take part in its agreement."""
        self._now = now
        if self.broken is None:
            self.fail_all(BrokenError(f"rank {self.rank} asked to go on without the lost ranks"))
        self._agreement().suspect(self._suspected())
        self._send_agreement()

    def of_this_epoch(self, key: Key) -> bool:
        """Whether operation ``key`` belongs to this membership."""
        return key[0].startswith(self.prefix)

    def _of_another_epoch(self, op: Operation) -> bool:
        """Fail ``op``, posted to a communicator of an earlier membership, if it is one."""
        if self.of_this_epoch(op.key):
            return False
        self._fail(op, BrokenError(
            f"{op.label}: its communicator is of an earlier membership of the ranks; post it "
            f"to the one asyncreduce.shrink returned ({self.epoch})"))  # fmt: skip
        return True

    def _suspected(self) -> set[int]:
        """Whom this rank holds lost: connections gone, silent, or closed."""
        liveness = self.liveness
        gone = self.lost_peers | liveness.silent(self._now) | liveness.departed.keys()
        return gone & self.members

    def _agreement(self) -> Membership:
        if self.agreement is None:
            self.agreement = Membership(self.rank, self.members)
            self.agree_retry_at = self._now + AGREE_RETRY
        return self.agreement

    def _on_agree(self, peer: int, message: wire.Agree) -> None:
        """A peer's agreement message: one of an earlier epoch, or from a rank not in this
        one, is old news; the first of this epoch breaks this rank too, if it was not."""
        if message.epoch != self.epoch or peer not in self.members:
            return
        try:
            decoded = membership.decode(message.data, self.world_size)
        except MembershipError as exc:
            log.warning("rank %d ignored an agreement message from rank %d: %s", self.rank, peer,
                        exc)  # fmt: skip
            return
        if self.broken is None:
            why = f"rank {peer} began agreeing on who is alive: membership {self.epoch} is over"
            self.fail_all(BrokenError(why))
        agreement = self._agreement()
        agreement.suspect(self._suspected())
        agreement.on_message(peer, decoded)
        self._send_agreement()

    def _keep_if_next(self, peer: int, message: Control, of_next: bool) -> None:
        """An ABORT or a failure of another membership: an earlier one's is old news; one of the
        next (``of_next``: a faster survivor moved on, then broke) is kept until this rank
        moves on too, and heard then."""
        if of_next and self.broken is not None:
            self.from_next.append((peer, message))

    def _suspect(self, peer: int) -> None:
        """The connection to ``peer`` is gone: the agreement, if any, hears it."""
        self.lost_peers.add(peer)
        if self.agreement is not None and self.agreement.excluded is None:
            self.agreement.suspect({peer})
            self._send_agreement()

    def _agreement_beat(self, now: float) -> None:
        """Every beat while agreeing: silent peers are suspected, and a leader whose proposal
        did not conclude proposes again (the lowest rank first: the others wait longer)."""
        agreement = self.agreement
        if agreement is None or agreement.excluded is not None:
            return
        agreement.suspect(self._suspected())
        if now >= self.agree_retry_at:
            agreement.retry()
            place = sorted(self.members).index(self.rank)
            self.agree_retry_at = now + AGREE_RETRY * (1 + place)
        self._send_agreement()

    def _send_agreement(self) -> None:
        agreement = self.agreement
        assert agreement is not None
        for peer, message in agreement.outbox:
            if peer not in self.lost_peers:
                self._control((peer,), wire.Agree(self.epoch, membership.encode(message)))
        agreement.outbox.clear()
        if agreement.excluded is not None:
            self._move_on(agreement.excluded)

    def _move_on(self, excluded: frozenset[int]) -> None:
        """The agreement decided: a survivor's session moves to the next epoch; an excluded
        rank stays broken. Either way the engine hears it (AGREED)."""
        survivors = self.members - excluded
        epoch = self.epoch + 1
        self.agreement = None
        if self.rank in excluded:
            self.epoch = epoch  # (nothing of the survivors' epoch reaches it: it is not theirs)
            self.members = survivors
            self.commands.append((do.AGREED, epoch, None))
            return
        for peer in excluded - self.liveness.departed.keys():
            self.liveness.departed[peer] = f"rank {peer} was excluded from membership {epoch}"
        prefix = epoch_prefix(epoch)
        matching = Matching()
        for key, held in self.matching.unexpected.items():  # come early from a faster survivor
            if key[0].startswith(prefix):
                for peer, header, payload in held:
                    matching.keep(peer, header, payload)
        self.matching, self.flow = matching, Flow(self.settings.held_bytes)
        self.stall = StallInspector(self.rank, self.world_size, self.settings.stall_warning)
        self.working.clear()
        self._landing.clear()
        self.epoch, self.members, self.prefix = epoch, survivors, prefix
        self.broken = None
        self.flight.broken = None
        self.liveness.start(self._now)  # (nobody is silent for the time the agreement took)
        self.commands.append((do.AGREED, epoch, survivors))
        self._control(sorted(survivors - {self.rank}), wire.Resume())  # (a Hold sent while
        # broken, to a survivor already here, is forgotten with the old flow control)
        early, self.from_next = self.from_next, []
        for peer, message in early:
            self._on_control(peer, message)
