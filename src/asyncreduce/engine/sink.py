"""Between the protocol and the wire: the transport's events handed to the Session (the
``FrameSink`` the transport calls on the loop's thread), and the Session's commands carried
out on the transport and the requests, in order, once the event's call has returned.

A send may report itself sent at once, inside ``transport.send``; that event's commands join
the same list and are applied by the same loop (``applying`` keeps it from re-entering). If a
command raises (a bug), those after it stay for the crash handler, which applies each alone,
logging and skipping one that fails, so no request is lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ..flight import FlightRecorder
from ..keys import Key
from ..protocol.commands import (
    AGREED,
    BROKE,
    CLAIM,
    DIVERT,
    DROP,
    FINISH,
    RELEASE,
    SEND,
    WITHDRAW,
    Command,
)
from ..protocol.operation import Operation, Settings
from ..protocol.session import Session
from ..transport.base import FrameSink, Transport
from ..transport.frame import Header
from .ownership import Ownership

__all__ = ["Sink"]

log = logging.getLogger("asyncreduce.engine")


def _no_lane(key: Key, remember: bool) -> None:
    """``Sink.claim`` before a lane is open: nothing holds the key."""


def _nobody_waits(epoch: int, survivors: frozenset[int] | None) -> None:
    """``Sink.agreed`` until the engine says who waits for a membership (engine/shrinks.py)."""


class Sink(FrameSink):
    """One engine's events in and commands out (see the module docstring); only the thread
    that holds the loop calls it."""

    transport: Transport  # set once the transport is made (it is made with this sink)

    def __init__(
        self, rank: int, session: Session, settings: Settings, flight: FlightRecorder,
        closing: threading.Event, loop: Ownership,
    ) -> None:  # fmt: skip
        """``closing``: close() was asked for (a lost peer is then no failure); ``loop``: who
        holds the loop (a waiter that does runs at once: no yield at its completion)."""
        self.rank, self.session, self.settings, self.flight = rank, session, settings, flight
        self._closing, self._loop = closing, loop
        self.applying = False  # commands are being applied (a send may report itself sent)
        self.claim: Callable[[Key, bool], None] = _no_lane  # the lane's, once it is open
        self.agreed: Callable[[int, frozenset[int] | None], None] = _nobody_waits

    def apply(self, each_alone: bool = False) -> None:
        """Carry out the session's commands, in order (``each_alone``: the crash handler's
        way, see the module docstring)."""
        if self.applying:
            return
        self.applying = True
        commands = self.session.commands
        i = 0
        try:
            while i < len(commands):
                command = commands[i]
                i += 1
                try:
                    self._carry_out(command)
                except Exception:
                    if not each_alone:
                        raise
                    log.exception("rank %d could not carry out %r", self.rank, command[:2])
        finally:
            del commands[:i]
            self.applying = False

    def _carry_out(self, command: Command) -> None:
        transport = self.transport
        if command[0] == SEND:
            _, peer, head, payload, priority, token, age = command
            transport.send(peer, head, payload, priority, token, age)
        elif command[0] == FINISH:
            _, op, value, error = command
            if op.request.done():
                return
            if error is not None:
                op.request.set_exception(error)
            else:
                op.request.set_result(value)
                if op.small and self.settings.spin and not self._loop.driving:
                    os.sched_yield()  # the waiter runs now, not after another round of the loop
        elif command[0] == DROP:
            transport.drop(command[1])
        elif command[0] == DIVERT:
            transport.divert(command[1])
        elif command[0] == RELEASE:
            transport.release(command[1])
        elif command[0] == WITHDRAW:
            peer = command[1]
            taken = transport.withdraw(peer)
            kept = [(t, h, p) for h, p, t in taken if isinstance(t, Operation)]
            self.session.withdrawn(peer, kept)
        elif command[0] == BROKE:
            self._write_flight_record()
        elif command[0] == CLAIM:
            self.claim(command[1], command[2])
        elif command[0] == AGREED:
            self.agreed(command[1], command[2])

    def _write_flight_record(self) -> None:
        if self.settings.flight_dir:
            try:
                where = self.flight.dump(self.settings.flight_dir)
                log.warning("rank %d broke; its flight record is in %s", self.rank, where)
            except OSError as exc:
                log.warning("rank %d could not write its flight record: %s", self.rank, exc)

    # ---- FrameSink: called by the transport on the loop's thread ----------------------------

    def frame_buffer(self, peer: int, header: Header) -> memoryview | None:
        target = self.session.buffer_for(peer, header)
        if self.session.commands:
            self.apply()
        return target

    def frame_view(self, peer: int, header: Header, view: memoryview) -> bool:
        taken = self.session.on_view(peer, header, view, time.monotonic())
        if self.session.commands:
            self.apply()
        return taken

    def on_frame(self, peer: int, header: Header, payload: memoryview) -> None:
        self.session.on_frame(peer, header, payload, time.monotonic())
        if self.session.commands:
            self.apply()

    def on_sent(self, token: object) -> None:
        if isinstance(token, Operation):
            self.session.sent(token, time.monotonic() if token.unsent == 1 else None)
            if self.session.commands:
                self.apply()

    def on_peer_lost(self, peer: int, error: BaseException) -> None:
        self.session.lost(peer, error, self._closing.is_set())
        self.apply()
