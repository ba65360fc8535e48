"""Control messages between ranks of an ordered backend, over point-to-point sends of the
engine itself (MPI) or of a side group (a Gloo group beside a torch one).

Theory of operation. An ``Endpoint`` moves opaque byte slots: ``isend``/``irecv`` return
handles that ``test`` polls (never blocking), because the one thread that owns the engine
must keep every operation progressing. The channel keeps one receive posted per peer at all
times, so a peer's message lands whenever it comes; it splits messages longer than a slot
into chunks (a flag byte says whether more follow) and joins them again. Endpoints whose
receives must have the sender's exact size (Gloo) send whole slots; MPI sends only the bytes.

Every message starts with its type: ROUND (an agreement contribution), BEAT (a heartbeat),
GOODBYE (the sender closed in good order) or BREAK (the sender's communicator broke: an error
class code and the reason). Nothing here trusts a peer: the types, flags and sizes are checked.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["Channel", "Endpoint", "ROUND", "BEAT", "GOODBYE", "BREAK", "ChannelError"]

ROUND, BEAT, GOODBYE, BREAK = 1, 2, 3, 4
_TYPES = {ROUND, BEAT, GOODBYE, BREAK}
_MORE, _LAST = 1, 0
_MAX_MESSAGE = 64 << 20  # a contribution this large would be a bug or an attack


class ChannelError(Exception):
    """A peer sent bytes that are not a control message."""


class Endpoint(Protocol):
    """Point-to-point byte slots of one engine (see the module docstring)."""

    slot: int  # the most bytes one send carries
    exact: bool  # a receive takes exactly ``slot`` bytes (sends are padded)

    def isend(self, peer: int, data: bytes) -> Any: ...

    def irecv(self, peer: int, buffer: bytearray) -> Any: ...

    def test(self, handle: Any) -> int | None:
        """None while pending; then the bytes received (a receive) or 0 (a send)."""
        ...

    def cancel(self) -> None:
        """Give up the receives still posted (closing)."""
        ...


class Channel:
    """Framed control messages to and from every peer over one ``Endpoint``."""

    def __init__(self, endpoint: Endpoint, rank: int, world_size: int) -> None:
        self.endpoint = endpoint
        self.rank = rank
        self._chunk = endpoint.slot - 5  # flag byte, then the chunk's length (4 bytes)
        self._peers = [p for p in range(world_size) if p != rank]
        self._recvs: dict[int, tuple[Any, bytearray]] = {}
        self._partial: dict[int, list[bytes]] = {p: [] for p in self._peers}
        self._sends: deque[Any] = deque()
        for peer in self._peers:
            self._post_recv(peer)

    def send(self, peer: int, kind: int, body: bytes = b"") -> None:
        """Queue one message of ``kind`` to ``peer`` (completes in the background)."""
        data = bytes([kind]) + body
        for lo in range(0, max(len(data), 1), self._chunk):
            piece = data[lo : lo + self._chunk]
            flag = _MORE if lo + self._chunk < len(data) else _LAST
            framed = bytes([flag]) + len(piece).to_bytes(4, "little") + piece
            if self.endpoint.exact:
                framed = framed.ljust(self.endpoint.slot, b"\0")
            self._sends.append(self.endpoint.isend(peer, framed))

    def poll(self) -> Iterator[tuple[int, int, bytes]]:
        """Every whole message that arrived, as (peer, kind, body); retires finished sends."""
        while self._sends and self.endpoint.test(self._sends[0]) is not None:
            self._sends.popleft()
        for peer in self._peers:
            while peer in self._recvs:
                handle, buffer = self._recvs[peer]
                try:
                    got = self.endpoint.test(handle)
                    if got is None:
                        break
                    piece = self._unframe(peer, buffer, got)
                except Exception:
                    del self._recvs[peer]  # nothing more is read from that peer
                    raise
                if piece is not None and piece[0] == GOODBYE:
                    del self._recvs[peer]  # it sends nothing more
                else:
                    self._post_recv(peer, buffer)  # (its bytes were copied out)
                if piece is not None:
                    yield peer, piece[0], piece[1:]

    def drain_sends(self, timeout: float) -> None:
        """Wait (polling) up to ``timeout`` s for queued sends to complete."""
        deadline = time.monotonic() + timeout
        while self._sends and time.monotonic() < deadline:
            if self.endpoint.test(self._sends[0]) is not None:
                self._sends.popleft()
            else:
                time.sleep(50e-6)

    def _post_recv(self, peer: int, buffer: bytearray | None = None) -> None:
        buffer = bytearray(self.endpoint.slot) if buffer is None else buffer
        self._recvs[peer] = (self.endpoint.irecv(peer, buffer), buffer)

    def _unframe(self, peer: int, buffer: bytearray, got: int) -> bytes | None:
        if got < 5 or buffer[0] not in (_MORE, _LAST):
            raise ChannelError(f"rank {peer} sent a control chunk of {got} bytes, flag {buffer[0]}")
        size = int.from_bytes(buffer[1:5], "little")
        if 5 + size > got:
            raise ChannelError(f"rank {peer} sent a control chunk claiming {size} bytes in {got}")
        parts = self._partial[peer]
        parts.append(bytes(buffer[5 : 5 + size]))
        if sum(map(len, parts)) > _MAX_MESSAGE:
            raise ChannelError(f"rank {peer} sent a control message over {_MAX_MESSAGE} bytes")
        if buffer[0] == _MORE:
            return None
        message = b"".join(parts)
        parts.clear()
        if not message or message[0] not in _TYPES:
            raise ChannelError(f"rank {peer} sent a control message of unknown type")
        return message
