"""Raw TCP streams in a ring: the no-library reference of the overlap benchmark (a helper).

Theory of operation
-------------------
``RawTcpRank`` is a ``harness.Rank`` of the pseudo-library ``tcp``: rank r holds one plain TCP
connection to its right neighbour (r+1 mod N) and one from its left (r-1 mod N), nothing else.
``Streams.post`` moves, in two background threads, exactly what a ring allreduce of ``size``
bytes moves over each rank's link each way, ``ring_bytes(N, size)`` = 2(N-1)/N * size (N=2:
the whole buffer both ways with the one peer): ``sendall`` to the right and ``recv_into`` from
the left, from and into buffers of ``size`` bytes, and reduces nothing; ``Streams.wait`` joins
both threads. Python stays out of the way: the sender hands the kernel whole buffers on a
blocking socket, and the receiver, with SO_RCVLOWAT, is woken once 512 KiB (or the rest) have
arrived, not for every ~64 KiB the network delivers (``poll``, then a receive that does not
block: a blocking one would copy what is there, then wait for SO_RCVLOWAT *more* bytes, which
near the end of a transfer never come). So what the transfer costs the CPU is the kernel's
(TCP and, on emulated hosts, the veths, the bridge and the tbf queues): as little as any TCP
library can pay for the same bytes. The sockets are tuned as asyncreduce's own (TCP_NODELAY,
4 MiB SO_SNDBUF/SO_RCVBUF, the same SO_RCVLOWAT cap).

Meeting (``meet``): rank 0 listens at MASTER_ADDR:MASTER_PORT. Every rank opens its ring
listener (any free port) on the address it reaches rank 0 from and tells rank 0 its rank and
port; rank 0 answers each with its right neighbour's address and port; each rank then dials
its right neighbour, says its rank, and accepts its left one. Everything on the wire is
``struct``-packed (nothing is pickled).

``barrier`` and ``max`` travel on the same two connections, between transfers, never during
one: in each of N-1 steps every rank sends the largest value it has seen (8 bytes) to the right
and keeps the larger of that and what comes from the left. After N-1 steps every rank holds the
maximum over all ranks, and none can be done before every rank has started, so ``barrier`` is
``max(0.0)``. The streams are ordered and a receiver reads exactly a transfer's bytes before
anything else, so these small messages never mix with a payload.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import harness

__all__ = ["NAME", "RawTcpRank", "Streams", "ring_bytes"]

NAME = "tcp"
SOCKET_BUFFER = 4 << 20  # as asyncreduce's TCP transport
LOWAT_BYTES = 512 << 10  # wake for at least this much of a transfer's rest (as asyncreduce)
MEET_S = 60.0  # the longest the ranks take to meet
_HELLO = struct.Struct("!IH")  # to rank 0: my rank, my ring listener's port
_WHERE = struct.Struct("!HH")  # from rank 0: the right neighbour's port, its address's length
_RANK = struct.Struct("!I")  # to the right neighbour: my rank
_VALUE = struct.Struct("!d")  # barrier and max
Address = tuple[str, int]


def ring_bytes(nprocs: int, nbytes: int) -> int:
    """What a ring allreduce of ``nbytes`` moves over each rank's link each way: 2(N-1)/N."""
    return 2 * (nprocs - 1) * nbytes // nprocs


class RawTcpRank(harness.Rank):
    """One rank of the reference: a connection to the right neighbour and one from the left.

    Rank, world size and rank 0's address come from RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT unless given."""

    def __init__(
        self, rank: int | None = None, size: int | None = None, master: Address | None = None
    ) -> None:
        self.lib = NAME
        self.rank = int(os.environ["RANK"]) if rank is None else rank
        self.size = int(os.environ["WORLD_SIZE"]) if size is None else size
        if master is None:
            master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.out, self.inc = meet(self.rank, self.size, master)

    def barrier(self) -> None:
        self.max(0.0)

    def max(self, value: float) -> float:
        for _ in range(self.size - 1):
            self.out.sendall(_VALUE.pack(value))
            value = max(value, _VALUE.unpack(recv_exact(self.inc, _VALUE.size))[0])
        return value

    def streams(self, nbytes: int) -> Streams:
        """Transfers of what a ring allreduce of ``nbytes`` moves each way, on this rank's
        connections."""
        return Streams(self.out, self.inc, nbytes, ring_bytes(self.size, nbytes))

    def close(self) -> None:
        self.out.close()
        self.inc.close()


class Streams:
    """``each_way`` bytes to the right and as many from the left, at once, in two threads,
    from and into buffers of ``nbytes`` (cycled over when ``each_way`` is larger)."""

    def __init__(self, out: socket.socket, inc: socket.socket, nbytes: int, each_way: int) -> None:
        self.out, self.inc, self.each_way = out, inc, each_way
        self.sending = memoryview(bytearray(nbytes))
        self.receiving = memoryview(bytearray(nbytes))

    def post(self) -> tuple[Job, Job]:
        """Start one transfer both ways; returns at once."""
        return (
            Job(lambda: send_all(self.out, self.sending, self.each_way)),
            Job(lambda: recv_all(self.inc, self.receiving, self.each_way)),
        )

    def wait(self, jobs: tuple[Job, Job]) -> None:
        """Until both directions of the transfer are done; raises what either raised."""
        for job in jobs:
            job.result()


class Job(threading.Thread):
    """``work()`` in a thread of its own, started at once."""

    def __init__(self, work: Callable[[], None]) -> None:
        super().__init__(name="rawtcp", daemon=True)
        self.work = work
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # handed to whoever waits
            self.error = exc

    def result(self) -> None:
        """Join the thread; raise what ``work`` raised."""
        self.join()
        if self.error is not None:
            raise self.error


def send_all(sock: socket.socket, view: memoryview, total: int) -> None:
    """Send ``total`` bytes of ``view`` (over and over if it is shorter), whole buffers."""
    while total > 0:
        n = min(total, len(view))
        sock.sendall(view[:n])
        total -= n


def recv_all(sock: socket.socket, view: memoryview, total: int) -> None:
    """Receive ``total`` bytes into ``view`` (over and over if it is shorter), waking only once
    ``LOWAT_BYTES`` (or the rest, when less) have arrived; SO_RCVLOWAT is 1 again after.

    ``poll``, then a receive that does not block: a blocking receive would copy what is there,
    then sleep until SO_RCVLOWAT *more* bytes arrive, which near the end of a transfer may
    never happen (it hung the reference now and then)."""
    waiter = select.poll()
    waiter.register(sock, select.POLLIN)
    lowat = 1
    while total > 0:
        n, got = min(total, len(view)), 0
        while got < n:
            lowat = _set_lowat(sock, lowat, min(total - got, LOWAT_BYTES))
            got += _recv_ready(sock, waiter, view[got:n])
        total -= n
    _set_lowat(sock, lowat, 1)


def _recv_ready(sock: socket.socket, waiter: select.poll, view: memoryview) -> int:
    """Wait until the socket is readable (SO_RCVLOWAT bytes, an EOF or an error), then take
    what is there, up to ``len(view)``; how many bytes."""
    waiter.poll()
    try:
        more = sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
    except BlockingIOError:  # woken for nothing
        return 0
    if more == 0:
        raise ConnectionError("the left neighbour closed its connection mid-transfer")
    return more


def _set_lowat(sock: socket.socket, now: int, wanted: int) -> int:
    """SO_RCVLOWAT ``wanted`` (it is ``now``): a blocking receive returns, and the kernel wakes
    the thread, only once that many bytes are there (or at EOF); returns ``wanted``."""
    if wanted != now:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
    return wanted


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (a small message)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a neighbour closed its connection")
        data += chunk
    return data


# ---- meeting ---------------------------------------------------------------------------------


def meet(rank: int, size: int, master: Address) -> tuple[socket.socket, socket.socket]:
    """(the connection to the right neighbour, the one from the left), by way of rank 0 at
    ``master``; blocking sockets. TimeoutError after ``MEET_S``."""
    deadline = time.monotonic() + MEET_S
    if rank == 0:
        ring, right = _meet_as_root(size, master, deadline)
    else:
        ring, right = _meet_through_root(rank, master, deadline)
    with ring:
        return _link(rank, size, ring, right, deadline)


def _meet_as_root(size: int, master: Address, deadline: float) -> tuple[socket.socket, Address]:
    """Rank 0: take every rank's hello at ``master``, tell each its right neighbour."""
    ring = tcp_listener((master[0], 0), 1)
    table = {0: (master[0], ring.getsockname()[1])}
    calls: dict[int, socket.socket] = {}
    with tcp_listener(master, size) as door:
        while len(calls) < size - 1:
            door.settimeout(_left(deadline))
            conn, source = door.accept()
            conn.settimeout(_left(deadline))
            who, port = _HELLO.unpack(recv_exact(conn, _HELLO.size))
            if not 0 < who < size or who in calls:
                raise RuntimeError(f"rank {who} said hello (world size {size}), unexpected")
            table[who], calls[who] = (source[0], port), conn
    for who, conn in calls.items():
        with conn:
            addr, port = table[(who + 1) % size]
            conn.sendall(_WHERE.pack(port, len(addr.encode())) + addr.encode())
    return ring, table[1 % size]


def _meet_through_root(
    rank: int, master: Address, deadline: float
) -> tuple[socket.socket, Address]:
    """Rank > 0: open the ring listener, say hello to rank 0, hear the right neighbour."""
    with tcp_dial(master, deadline) as call:
        ring = tcp_listener((call.getsockname()[0], 0), 1)
        call.sendall(_HELLO.pack(rank, ring.getsockname()[1]))
        port, length = _WHERE.unpack(recv_exact(call, _WHERE.size))
        return ring, (recv_exact(call, length).decode(), port)


def _link(
    rank: int, size: int, ring: socket.socket, right: Address, deadline: float
) -> tuple[socket.socket, socket.socket]:
    """Dial the right neighbour and accept the left one on ``ring``; blocking sockets."""
    out = tcp_dial(right, deadline)
    out.sendall(_RANK.pack(rank))
    ring.settimeout(_left(deadline))
    inc, _ = ring.accept()
    tune(inc)
    inc.settimeout(_left(deadline))
    (who,) = _RANK.unpack(recv_exact(inc, _RANK.size))
    if who != (rank - 1) % size:
        raise RuntimeError(f"rank {rank}: rank {who} dialed in, expected {(rank - 1) % size}")
    out.settimeout(None)
    inc.settimeout(None)
    return out, inc


def tune(sock: socket.socket) -> None:
    """As asyncreduce's TCP transport: no Nagle, 4 MiB socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def tcp_listener(where: Address, backlog: int) -> socket.socket:
    """A tuned listening socket at ``where`` (port 0: any free one); accepted ones inherit the
    buffer sizes, which TCP must know before the handshake."""
    family, _, _, _, sockaddr = socket.getaddrinfo(*where, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tune(sock)
    sock.bind(sockaddr)
    sock.listen(backlog)
    return sock


def tcp_dial(where: Address, deadline: float) -> socket.socket:
    """A tuned connection to ``where``, retried until ``deadline`` (the listener may not be
    up yet)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(*where, type=socket.SOCK_STREAM)[0]
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        tune(sock)
        sock.settimeout(_left(deadline))
        try:
            sock.connect(sockaddr)
            return sock
        except OSError:  # refused (not listening yet), timed out, unreachable
            sock.close()
            if time.monotonic() + 0.05 >= deadline:
                raise TimeoutError(f"could not reach {where[0]}:{where[1]} in time") from None
            time.sleep(0.05)


def _left(deadline: float) -> float:
    """Seconds left before ``deadline``; TimeoutError when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the ranks did not meet in time")
    return left
