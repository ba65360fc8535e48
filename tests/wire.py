"""A fake wire that joins protocol Sessions in one process, as the engine and a transport would.

Each rank is a ``Session`` with a clock of its own (``now``, advanced by the test). Commands
are carried out as the real engine and transport do: a SEND is queued on the link to its peer
(control frames overtake data, as the transport's priority order does), every header is packed
and then checked by ``parse_header`` on the way in, a frame leaves its queue at a random moment
and its ``sent`` notice comes at another, DROP, WITHDRAW and RELEASE act on the queue, DIVERT
redirects a payload that is half landed. A link delivers in order (TCP does); what is random is
which link moves next, when a receive is split in two, and whether the zero-copy view path is
offered. ``drop_beats`` loses heartbeats (a rank that seems frozen); ``duplicate_control``
delivers every control frame twice.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncreduce.algorithms import DTYPES, KINDS, REDUCTION_CODES, build
from asyncreduce.flight import FlightRecorder
from asyncreduce.protocol import Operation, Session, Settings
from asyncreduce.protocol.commands import (
    BROKE,
    CLAIM,
    DIVERT,
    DROP,
    FINISH,
    RELEASE,
    SEND,
    WITHDRAW,
)
from asyncreduce.request import CallbackRunner, Request
from asyncreduce.transport.frame import (
    DATA,
    FLOW,
    GOODBYE,
    HEADER,
    HEARTBEAT,
    Descriptor,
    Header,
    pack_header,
    parse_header,
)


@dataclass
class Frame:
    src: int
    dst: int
    head: bytes
    payload: bytes  # copied when it leaves: a payload must stay untouched until then
    view: memoryview  # the sender's buffer (read when the frame leaves)
    priority: int
    token: object
    order: int


@dataclass
class Rank:
    session: Session
    now: float = 0.0
    closed: bool = False  # said goodbye
    requests: dict[str, Request[Any]] = field(default_factory=dict)


class Wire:
    """Sessions of ``n`` ranks joined in one process (see the module docstring)."""

    def __init__(self, n: int, seed: int, settings: Settings | None = None) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.settings = settings or Settings(spin=0.0)
        self.runner = CallbackRunner("wire-callbacks")
        self.ranks = [self._rank(r) for r in range(n)]
        self.queued: dict[tuple[int, int], list[Frame]] = {}  # (src, dst): not left yet
        self.claims: list[tuple[int, tuple[bytes, int], bool]] = []  # (rank, key, remember)
        self.links: dict[tuple[int, int], deque[tuple[Header, bytes]]] = {}  # left, in order
        self.unsent: list[Frame] = []  # left, their sent notice still to come
        # (dst, src): a payload half landed: its header, target, private buffer (after a
        # DIVERT) and the whole payload
        self.landing: dict[tuple[int, int], tuple[Header, memoryview, bytearray | None, bytes]] = {}
        self.released: set[tuple[int, int]] = set()  # (src, dst): dst said goodbye to src
        self.lost: set[tuple[int, int]] = set()  # (src, dst) cut: nothing more arrives
        self.drop_beats: set[int] = set()  # ranks whose heartbeats are lost
        self.duplicate_control = False
        self.left_before_hold: dict[tuple[int, int], int] = {}  # (src, dst): DATA bytes
        self._told_to_hold: set[tuple[int, int]] = set()  # (src, dst): src got dst's Hold
        self._order = 0

    def _rank(self, r: int) -> Rank:
        flight = FlightRecorder(r, self.n, 100)
        return Rank(Session(r, self.n, self.settings, flight, 0.0))

    # ---- posting -------------------------------------------------------------------------------

    def make(
        self, rank: int, kind: str, name: str, buffer: np.ndarray, op: str = "sum", root: int = 0,
        timeout: float | None = None,
    ) -> Operation:  # fmt: skip
        """Operation ``name`` (instance 0) of ``rank``, built as Communicator builds it."""
        dtype = DTYPES[buffer.dtype.name]
        flat = buffer.reshape(-1)
        algo = build(kind, rank, self.n, flat, dtype, op, root)
        reduce = REDUCTION_CODES[op] if kind in ("allreduce", "reduce_scatter") else 0
        desc = Descriptor(KINDS[kind], dtype.code, reduce, root, flat.size)
        request: Request[Any] = Request(f"{kind} {name!r}#0", self.runner)
        self.ranks[rank].requests[name] = request
        key = (name.encode(), 0)
        return Operation(key, request.label, desc, request, lambda: buffer, timeout, algo)

    def post(
        self, rank: int, kind: str, name: str, buffer: np.ndarray, op: str = "sum", root: int = 0,
        timeout: float | None = None,
    ) -> Request[Any]:  # fmt: skip
        """Post operation ``name`` (instance 0) on ``rank``."""
        operation = self.make(rank, kind, name, buffer, op, root, timeout)
        state = self.ranks[rank]
        state.session.post(operation, state.now)
        self.apply(rank)
        return operation.request

    # ---- carrying out commands -----------------------------------------------------------------

    def apply(self, rank: int) -> None:
        session = self.ranks[rank].session
        commands = session.commands
        while commands:
            command = commands.pop(0)
            what = command[0]
            if what == SEND:
                self._queue(rank, *command[1:])
            elif what == FINISH:
                _, op, value, error = command
                queued = [f for q in self.queued.values() for f in q if f.token is op]
                assert not queued, f"{op.label} ended with frames still to send"
                if not op.request.done():
                    if error is not None:
                        op.request.set_exception(error)
                    else:
                        op.request.set_result(value)
            elif what == DROP:
                self._drop(rank, command[1])
            elif what == DIVERT:
                self._divert(command[1], rank)
            elif what == WITHDRAW:
                self._withdraw(rank, command[1])
            elif what == RELEASE:
                self._release(rank, command[1])
            elif what == CLAIM:  # (no same-host lane on this wire: nothing holds the key)
                self.claims.append((rank, command[1], command[2]))
            else:
                assert what == BROKE, command

    def _queue(
        self, src: int, dst: int, head: bytes, payload: memoryview, priority: int, token: object,
        age: int,
    ) -> None:  # fmt: skip
        if (src, dst) in self.released or self.ranks[src].closed:
            self.unsent.append(Frame(src, dst, head, b"", payload, priority, token, 0))
            return
        self._order += 1
        frame = Frame(src, dst, head, b"", payload, priority, token, self._order)
        queue = self.queued.setdefault((src, dst), [])
        queue.append(frame)
        queue.sort(key=lambda f: (-f.priority, f.order))

    def _drop(self, src: int, token: object) -> None:
        for queue in (q for (s, _), q in self.queued.items() if s == src):
            queue[:] = [f for f in queue if f.token is not token]
        self.unsent = [f for f in self.unsent if f.token is not token]

    def _withdraw(self, src: int, dst: int) -> None:
        queue = self.queued.get((src, dst), [])
        taken = [f for f in queue if f.token is not None]
        queue[:] = [f for f in queue if f.token is None]
        frames = [(f.token, f.head, f.view) for f in taken]
        self.ranks[src].session.withdrawn(dst, frames)  # type: ignore[arg-type]

    def _release(self, src: int, dst: int) -> None:
        self.released.add((src, dst))
        for frame in self.queued.pop((src, dst), []):
            self.unsent.append(frame)

    def _divert(self, src: int, dst: int) -> None:
        if (dst, src) in self.landing:  # else nothing is arriving from src: nothing to divert
            header, target, _, payload = self.landing[(dst, src)]
            self.landing[(dst, src)] = (header, target, bytearray(target.nbytes), payload)

    # ---- moving frames ---------------------------------------------------------------------

    def goodbye(self, rank: int, reason: str = "") -> None:
        """``rank`` closes in good order (what Engine._say_goodbye sends)."""
        text = reason.encode()
        head = pack_header(GOODBYE, b"", 0, 0, 0, len(text), Descriptor(0, 0, 0, 0, 0))
        for peer in range(self.n):
            if peer != rank:
                self._queue(rank, peer, head, memoryview(text), 1 << 31, None, 0)
        self.ranks[rank].session.stopping = True
        self.ranks[rank].closed = True

    def step(self) -> bool:
        """Move one thing: a frame leaves a queue, arrives, finishes landing, or is reported
        sent. False once nothing can move."""
        moves = [("leave", k) for k, q in self.queued.items() if q]
        moves += [("arrive", k) for k, q in self.links.items() if q and k[::-1] not in self.landing]
        moves += [("land", k) for k in self.landing]
        if self.unsent:
            moves.append(("sent", None))
        if not moves:
            return False
        what, key = self.rng.choice(moves)
        if what == "leave":
            self._leave(self.queued[key].pop(0))
        elif what == "arrive":
            self._arrive(key, *self.links[key].popleft())
        elif what == "land":
            self._land(key)
        else:
            frame = self.unsent.pop(self.rng.randrange(len(self.unsent)))
            self.ranks[frame.src].session.sent(frame.token)
            self.apply(frame.src)
        return True

    def _leave(self, frame: Frame) -> None:
        frame.payload = bytes(frame.view)
        self.unsent.append(frame)
        fixed = frame.head[: HEADER.size]
        name_len, header = parse_header(fixed)  # every frame passes the receiver's checks
        header.name = frame.head[HEADER.size : HEADER.size + name_len]
        pair = (frame.src, frame.dst)
        if header.type == DATA and pair not in self._told_to_hold:
            self.left_before_hold[pair] = self.left_before_hold.get(pair, 0) + len(frame.payload)
        if header.type == HEARTBEAT and frame.src in self.drop_beats:
            return
        link = self.links.setdefault((frame.src, frame.dst), deque())
        link.append((header, frame.payload))
        if self.duplicate_control and header.type not in (DATA, GOODBYE):
            link.append((header, frame.payload))

    def _arrive(self, link: tuple[int, int], header: Header, payload: bytes) -> None:
        src, dst = link
        state = self.ranks[dst]
        if (src, dst) in self.lost or state.closed and header.type != GOODBYE:
            return
        session = state.session
        if header.type == FLOW and header.instance == 1:  # Hold (2: Resume)
            self._told_to_hold.add((dst, src))
        elif header.type == FLOW:
            self._told_to_hold.discard((dst, src))
        if header.type == DATA and self.rng.random() < 0.3:
            staging = bytearray(payload)
            taken = session.on_view(src, header, memoryview(staging), state.now)
            staging[:] = b"\xa5" * len(staging)  # nothing may keep reading the staging
            self.apply(dst)
            if taken:
                return
        target = session.buffer_for(src, header)
        self.apply(dst)
        if target is None:
            target = memoryview(bytearray(len(payload)))
        assert target.nbytes == len(payload), (target.nbytes, len(payload))
        if header.type == DATA and self.rng.random() < 0.3:  # half now, half when it lands
            half = len(payload) // 2
            target[:half] = payload[:half]
            self.landing[(dst, src)] = (header, target, None, payload)
            return
        target[:] = payload
        session.on_frame(src, header, target, state.now)
        self.apply(dst)

    def _land(self, key: tuple[int, int]) -> None:
        dst, src = key
        header, target, private, payload = self.landing.pop(key)
        if private is not None:
            target = memoryview(private)  # the caller's buffer is no longer written
        half = len(payload) // 2
        target[half:] = payload[half:]
        state = self.ranks[dst]
        state.session.on_frame(src, header, target, state.now)
        self.apply(dst)

    def run(self, limit: int = 200_000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the wire never went quiet")

    def tick(self, seconds: float) -> None:
        """Every rank's clock advances by ``seconds``; each ticks once."""
        for rank, state in enumerate(self.ranks):
            state.now += seconds
            if not state.closed:
                state.session.tick(state.now)
                self.apply(rank)
