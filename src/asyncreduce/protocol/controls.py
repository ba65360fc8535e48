"""The Session's control traffic: the beat (deadlines, heartbeats, silent peers, stall
questions), the control messages it hears (hold, resume, post notices, questions and answers,
abort, failed, goodbye) and data frames for operations not posted here.

A mixin of ``Session`` (session.py), which holds the state named below and the ways to end an
operation (``_fail``, ``_fail_everywhere``, ``fail_all``, ``_maybe_complete``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import BrokenError
from ..transport.frame import Descriptor, Header
from . import commands as do
from . import wire
from .commands import CONTROL_PRIORITY
from .epochs import epoch_prefix
from .failure import silent_for, timed_out
from .flow import KeptFrame
from .operation import Operation
from .outside import Watched
from .parts import SessionParts
from .wire import Control, Key, describe

__all__ = ["ControlTraffic"]

log = logging.getLogger("asyncreduce.engine")


class ControlTraffic(SessionParts):
    """What the Session says and hears besides an operation's data (see above)."""

    if TYPE_CHECKING:  # the Session's ways to end an operation (session.py)

        def fail_all(
            self, error: BaseException, about: tuple[Key, Descriptor] | None = None
        ) -> None: ...
        def _fail(self, op: Operation, error: BaseException) -> None: ...
        def _fail_everywhere(self, op: Operation, error: BaseException) -> None: ...
        def _maybe_complete(self, op: Operation) -> None: ...
        def answer(self, key: Key) -> int: ...
        def of_this_epoch(self, key: Key) -> bool: ...  # epochs.py's
        def _on_agree(self, peer: int, message: wire.Agree) -> None: ...
        def _agreement_beat(self, now: float) -> None: ...
        def _keep_if_next(self, peer: int, message: Control, of_next: bool) -> None: ...

    def tick(self, now: float) -> None:
        """Expire deadlines; every beat, tell every peer we are alive, fail what waits on a
        silent one, and ask about stalled operations."""
        self._now = now
        for op in self.liveness.expired(now):
            if self.matching.live(op):
                self._fail_everywhere(op, timed_out(op, self.rank, op.algo.pending_sources))
        if not self.liveness.beat_due(now):
            return
        if self.flow.told:  # (held frames also go when their operation fails here)
            self._resume_drained()
        self._control(self.liveness.open_peers(), wire.Beat())
        silent = self.liveness.silent(now)
        for op in list(self.matching.ops.values()):
            # waiting for a silent rank's data, or for room to send (a silent rank reads nothing)
            stuck = silent if op.unsent else silent & op.algo.pending_sources
            if stuck:
                self._fail_everywhere(op, silent_for(op, self.rank, stuck,
                                                     self.settings.peer_timeout))  # fmt: skip
        self._inspect_stalls(now)
        self._agreement_beat(now)

    def _on_control(self, peer: int, message: Control) -> None:
        if isinstance(message, wire.Hold):
            if self.flow.start_holding(peer):  # send it only what it has posted from now on
                self.commands.append((do.WITHDRAW, peer))
        elif isinstance(message, wire.PostNotice):
            self._send_kept(peer, self.flow.posted_there(peer, message.key, self.matching.live))
            self._claim(message.key, remember=True)
        elif isinstance(message, wire.Resume):
            self._send_kept(peer, self.flow.resumed(peer, self.matching.live))
        elif isinstance(message, wire.Ask):
            self._claim(message.key, remember=True)
            answer = self.answer(message.key)
            self._control((peer,), wire.Answer(message.key, message.desc, answer))
        elif isinstance(message, wire.Answer):
            self.stall.answered(message.key, peer, message.answer, self._now)
        elif isinstance(message, wire.Abort) and message.epoch != self.epoch:
            self._keep_if_next(peer, message, message.epoch == self.epoch + 1)
        elif isinstance(message, wire.Abort):
            why = f"rank {peer} broke ({message.reason}), so this rank broke too"
            self.fail_all(BrokenError(why))
        elif isinstance(message, wire.Agree):
            self._on_agree(peer, message)
        elif isinstance(message, wire.Failed) and not self.of_this_epoch(message.key):
            of_next = message.key[0].startswith(epoch_prefix(self.epoch + 1))
            self._keep_if_next(peer, message, of_next)
        elif isinstance(message, wire.Failed):
            error = message.error(f"{message.reason} (reported by rank {peer})")
            failing = self.matching.ops.get(message.key)
            if failing is not None:
                self._fail(failing, error)
            else:
                self.matching.failed_with(message.key, error)
            self.fail_all(error, (message.key, message.desc))  # passed on: all fail alike

    def _on_goodbye(self, peer: int, reason: str) -> None:
        """``peer`` closed in good order: fail what still needs it (``pending_sources``: a
        frame to come, or its memory still to be read), on every rank (the others may need it
        through us); a later post is judged the same way (``post``). Its frames came before
        its goodbye, so an operation that no longer waits on it can still complete."""
        gone = f"rank {peer} has closed its communicator" + (f" ({reason})" if reason else "")
        self.liveness.departed[peer] = gone
        for op in list(self.matching.ops.values()):
            self._fail_what_needs_the_departed(op)
        for op, _, _ in self.flow.forget(peer):  # kept back for it: it needs them no more
            op.unsent -= 1
            self._maybe_complete(op)
        self.commands.append((do.RELEASE, peer))

    def _fail_what_needs_the_departed(self, op: Operation, posted: bool = False) -> None:
        """Fail ``op`` on every rank if it still waits on a rank that said goodbye. An
        operation posted after such a goodbye runs first on the frames that rank sent before
        it (it may need nothing more from it: a broadcast's leaf, or a rank the departed one
        already served) and fails if it had anything to send that rank (``posted``): that rank
        left without it (a send, a gather to it, a broadcast it was to relay)."""
        pending = op.algo.pending_sources
        for peer, gone in list(self.liveness.departed.items()):
            if peer in pending:
                why = f"{op.label} still needed rank {peer}, but {gone}"
            elif posted and peer == op.dropped_for:
                why = f"{op.label} had data for rank {peer}, but {gone} without it"
            else:
                continue
            self._fail_everywhere(op, BrokenError(why))
            return

    def _send_kept(self, peer: int, frames: list[KeptFrame]) -> None:
        for op, head, payload in frames:
            self.commands.append((do.SEND, peer, head, payload, op.priority, op, op.age))

    def _resume_drained(self) -> None:
        """Peers told to hold may send freely again once this rank holds little (flow.py)."""
        for peer in self.flow.drained(self.matching.unexpected_bytes):
            self._control((peer,), wire.Resume())

    def _claim(self, key: Key, remember: bool) -> None:
        """A peer runs ``key`` on the engine: a named operation the same-host lane holds must
        run there too (lane/named.py)."""
        if key[0] and key not in self.matching.ops and key not in self.matching.done:
            self.commands.append((do.CLAIM, key, remember))

    def _control(self, peers: Iterable[int], message: Control) -> None:
        """Send ``message`` to each of ``peers``, encoded once."""
        head, payload = wire.encode(message)
        view = memoryview(payload)
        for peer in peers:
            self.commands.append((do.SEND, peer, head, view, CONTROL_PRIORITY, None, 0))

    def _inspect_stalls(self, now: float) -> None:
        self.stall.overdue(now)
        for op in list(self.matching.ops.values()):
            if self.stall.due(op.key, op.started, now):
                self._ask_about(op, now)

    def _ask_about(self, op: Watched, now: float) -> None:
        """Ask every peer what it knows of ``op``, stalled here (stall.py)."""
        self.stall.asked(op.key, op.label, op.started, now)
        self._control(self.liveness.open_peers(), wire.Ask(op.key, op.desc))

    def _unposted(self, peer: int, header: Header, payload: memoryview) -> None:
        """A DATA frame for an operation not posted here: late (it completed here), dropped
        (it failed here, or it is another membership's: an earlier one's, late, or while
        broken any but the next one's), or kept for when it is posted (back-pressure past
        the cap)."""
        matching = self.matching
        wanted = self.prefix if self.broken is None else epoch_prefix(self.epoch + 1)
        if header.key in matching.done:
            self._late_frame(peer, header)
        elif header.key not in matching.failed and header.key[0].startswith(wanted):
            if header.key not in matching.unexpected:
                self._claim(header.key, remember=False)
            matching.keep(peer, header, payload)
            if self.flow.over_cap(peer, matching.unexpected_bytes):
                self._control((peer,), wire.Hold())
                for op in matching.ops.values():
                    self._control((peer,), wire.PostNotice(op.key, op.desc))

    def _late_frame(self, peer: int, header: Header) -> None:
        """A frame for an operation completed here: ranks disagreed in a way the operation could
        not see (a broadcast's root). Drop it and say so; nothing can fail retroactively."""
        desc = self.matching.done[header.key]
        if header.desc != desc:
            log.error(
                "rank %d completed %r#%d as %s but rank %d posted %s; its data was ignored",
                self.rank, header.name.decode(errors="replace"), header.key[1],
                describe(desc), peer, describe(header.desc),
            )  # fmt: skip
