"""TCP transport: frames over one connection per pair of ranks, driven by one selector loop.

Theory of operation. The connections come ready from the mesh (mesh.py); ``TcpTransport``
owns them from then on as non-blocking sockets, and their loop: one selector, waking for a
readable connection, a writable one that has frames waiting, or ``wakeup``. Its sides live
next to it, each over the same dict of open connections:

    sending.py    ``Sender``: a frame to an idle connection straight into the socket, else a
                  heap per peer on (-priority, age, order), written several frames per sendmsg
    receiving.py  ``Receiver``: the sans-IO ``FrameReader`` (frame.py) fed from the socket,
                  payloads landing where the sink says, frames handed to the sink
    arena.py      a large payload to a same-host peer through its shared-memory arena (a
                  flagged header on the wire, CREDIT frames returning the space)
    pairs.py      ``QuietPairs``: a direct run's frame straight in, its partner's straight out

Closing is a handshake: GOODBYE, half-close, read to EOF. EOF otherwise, a reset, or a frame
that breaks the protocol ends that connection (``_lose``, here) and is reported once.
"""

from __future__ import annotations

import selectors
import socket
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from ..samehost.shm import SHM_MIN_BYTES, Arena
from .base import FrameSink, Transport
from .connection import Connection, Outgoing
from .listener import WakeUp
from .pairs import NOT_HERE, QuietPairs, native_take_wanted
from .receiving import Receiver
from .sending import Sender

if TYPE_CHECKING:
    from ..kernels.fold import Combining, Swap

__all__ = ["TcpTransport", "native_take_wanted"]


class TcpTransport(Transport):
    """Frames over one TCP connection per peer (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        sockets: dict[int, socket.socket],
        sink: FrameSink,
        arenas: dict[int, tuple[Arena, Arena]] | None = None,
    ) -> None:
        """``arenas`` maps a same-host peer to (the arena this rank writes, the one it reads)."""
        self.rank = rank
        self.sink = sink
        self._selector = selectors.DefaultSelector()
        self._wake = WakeUp()
        self._selector.register(self._wake.reader, selectors.EVENT_READ, None)
        self._peers: dict[int, Connection] = {}
        self._gone: list[Connection] = []
        self._lost: set[int] = set()  # ranks whose connection is gone (sends to them: dropped)
        self._sender = Sender(self._peers, self._lost, self._selector, sink, self._lose)
        self._receiver = Receiver(self._peers, sink, self._sender, self._lose, self._remove)
        self._pairs = QuietPairs(
            self._peers, self._sender.record_idle_send, self._lose, self._receiver.parse_staged
        )
        for peer_rank, sock in sockets.items():
            sock.setblocking(False)
            peer = Connection(peer_rank, sock, (arenas or {}).get(peer_rank))
            self._peers[peer_rank] = peer
            self._selector.register(sock, selectors.EVENT_READ, peer)

    # ---- sending (sending.py) ------------------------------------------------------------

    def send(
        self,
        peer: int,
        head: bytes,
        payload: memoryview,
        priority: int,
        token: object,
        age: int = 0,
    ) -> None:
        self._sender.send(peer, head, payload, priority, token, age)

    def send_now(self, peer: int, head: bytes, payload: memoryview, priority: int) -> bool:
        target = self._peers.get(peer)
        if target is None or target.queue or target.inflight or target.writing or (
            target.arena_out is not None and payload.nbytes >= SHM_MIN_BYTES
        ):  # fmt: skip  # (not quiet, or gone: as send does it)
            return super().send_now(peer, head, payload, priority)
        return self._sender.send_idle(target, head, payload, None, (-priority, 0, 0))

    def send_goodbye(self, reason: bytes) -> None:
        self._sender.send_goodbye(reason)

    def release(self, peer_rank: int) -> None:
        self._sender.release(peer_rank)

    def drop(self, token: object) -> None:
        self._sender.drop(token)

    def withdraw(self, peer_rank: int) -> list[tuple[bytes, memoryview, object]]:
        return self._sender.withdraw(peer_rank)

    # ---- quiet pairs (pairs.py) ----------------------------------------------------------

    def quiet(self, peer: int, nbytes: int) -> bool:
        return self._pairs.quiet(peer, nbytes)

    def swap(
        self, peer: int, head: bytes, payload: memoryview, priority: int, seconds: float = 0.0,
        combining: Combining | None = None, incoming_first: bool = False,
    ) -> memoryview | None:  # fmt: skip
        """(See Transport.) In C where it can (pairs.py), else as ``Transport.swap`` does it."""
        found = self._pairs.swap(peer, head, payload, priority, seconds, combining, incoming_first)
        if found is NOT_HERE:
            return super().swap(peer, head, payload, priority, seconds)
        return found  # type: ignore[return-value]

    def swaps(
        self, steps: tuple[Swap, ...], head: bytes, payload: memoryview, priority: int,
        seconds: float = 0.0, combining: Combining | None = None,
    ) -> tuple[int, memoryview | None]:  # fmt: skip
        """(See Transport.) All in one call into C where it can (pairs.py), else ``swap`` by
        ``swap``."""
        done = self._pairs.swaps(steps, head, payload, priority, seconds, combining)
        if done is None:
            return super().swaps(steps, head, payload, priority, seconds, combining)
        return done

    def take_frame(
        self, peer: int, head: bytes, size: int, seconds: float = 0.0
    ) -> memoryview | None:
        return self._pairs.take_frame(peer, head, size, seconds)

    # ---- receiving (receiving.py) --------------------------------------------------------

    def divert(self, peer_rank: int) -> None:
        self._receiver.divert(peer_rank)

    # ---- the loop ------------------------------------------------------------------------

    def poll(self, timeout: float | None, unread: Collection[int] = ()) -> None:
        if self._pairs.settle():  # (a look that found something else: news, so no waiting)
            timeout = 0.0
        for key, events in self._selector.select(timeout):
            peer = key.data
            if peer is None:
                self._wake.drain()
                continue
            if events & selectors.EVENT_WRITE and peer.rank in self._peers:
                self._sender.flush(peer)
            readable = events & selectors.EVENT_READ and peer.rank not in unread
            if readable and peer.rank in self._peers:
                self._receiver.on_readable(peer)

    def wakeup(self) -> None:
        self._wake.wake()

    # ---- the connections -----------------------------------------------------------------

    def open_peers(self) -> int:
        return len(self._peers)

    def _remove(self, peer: Connection) -> list[Outgoing]:
        """Forget ``peer``; return the frames that will now never leave."""
        if self._peers.pop(peer.rank, None) is None:
            return []
        self._selector.unregister(peer.sock)
        peer.sock.close()
        self._gone.append(peer)  # its arenas are unmapped at close(), never mid-frame
        self._lost.add(peer.rank)
        unsent = list(peer.inflight) + peer.queue
        peer.queue, peer.inflight = [], deque()
        return unsent

    def _lose(self, peer: Connection, error: BaseException) -> None:
        """End a connection that failed: report it once, then every frame that never left."""
        if peer.rank not in self._peers:
            return
        unsent = self._remove(peer)
        if peer.said_goodbye:
            error = ConnectionResetError(
                f"rank {peer.rank} reset the connection after its goodbye: {error}"
            )
        self.sink.on_peer_lost(peer.rank, error)
        for out in unsent:
            self.sink.on_sent(out.token)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._selector.unregister(peer.sock)
            peer.sock.close()
        for peer in [*self._peers.values(), *self._gone]:
            for arena in (peer.arena_in, peer.arena_out):
                if arena is not None:
                    arena.close()
        self._peers.clear()
        self._selector.close()
        self._wake.close()
