"""What TcpTransport keeps for each connection: the frames queued for it, and its stream in.

Theory of operation. A frame waiting to leave is an ``Outgoing``: its packed head, its payload
(a view of the sender's buffer: no copy), the token reported to the sink once it has left, and
how much of it has left so far. They wait in ``Connection.queue``, a heap on (-priority, age,
sequence), and move to ``inflight`` in batches that are written in order. Incoming bytes go
through ``Connection.reader`` (frame.py's FrameReader). The rest is the connection's state in
the closing handshake and its SO_RCVLOWAT setting.
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass, field

from ..samehost.shm import Arena
from .frame import HEADER, MAX_NAME_BYTES, FrameReader

__all__ = ["Connection", "Outgoing", "receive_buffer"]

_STAGE_BYTES = (64 << 10) + HEADER.size + MAX_NAME_BYTES  # (a small allreduce's frame, whole:
# SMALL_ALLREDUCE_BYTES; a direct run takes it from here: TcpTransport.swaps and take_frame)
_LOWAT_BYTES = 512 << 10  # the most of a payload's rest to wait for before waking (receiving.py)


@dataclass(order=True)
class Outgoing:
    """One queued frame; ``sent`` bytes of head+payload have left already."""

    order: tuple[int, int, int]  # (-priority, age, sequence): the send heap's order
    head: bytes = field(compare=False)
    payload: memoryview = field(compare=False)
    token: object = field(compare=False)
    sent: int = field(default=0, compare=False)

    def remaining(self) -> list[memoryview | bytes]:
        h = len(self.head)
        if self.sent < h:
            return [self.head[self.sent :], self.payload]
        return [self.payload[self.sent - h :]]

    @property
    def size(self) -> int:
        return len(self.head) + len(self.payload)


class Connection:
    """One connection: its send queue and its incoming stream."""

    def __init__(self, rank: int, sock: socket.socket, arenas: tuple[Arena, Arena] | None) -> None:
        self.rank = rank
        self.sock = sock
        self.fd = sock.fileno()  # (for C: the same while the connection is open)
        self.arena_out: Arena | None = arenas[0] if arenas else None  # we write, it reads
        self.arena_in: Arena | None = arenas[1] if arenas else None  # it writes, we read
        self.queue: list[Outgoing] = []  # a heap: most urgent first
        self.inflight: deque[Outgoing] = deque()  # taken from the queue, being written in order
        self.writing = False
        self.reader = FrameReader(_STAGE_BYTES)  # the incoming stream, cut into frames
        self.lowat = 1  # the socket's SO_RCVLOWAT
        # wait for at most a quarter of the receive buffer the kernel granted (it caps SO_RCVBUF
        # at net.core.rmem_max): more could exceed what the window lets the sender send
        self.lowat_cap = min(_LOWAT_BYTES, receive_buffer(sock) // 4)
        self.said_goodbye = False  # the peer is closing in good order: EOF is expected
        self.half_close = False  # shut our side once the queue is empty


def receive_buffer(sock: socket.socket) -> int:
    """The receive buffer the kernel granted this socket (0 if it will not say)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    except OSError:
        return 0
