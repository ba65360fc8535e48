"""The receiving side of the TCP transport (tcp.py): frames read off each connection and
handed to the sink.

Theory of operation. Receiving is the sans-IO ``FrameReader`` (frame.py) fed from the socket:
headers come through a small staging buffer (several small frames per ``recv``, at most
_READS_PER_EVENT receives per readable event); a payload that came whole with its header may be
consumed right there (the sink's ``frame_view``), else, once the header is checked, the payload
is received straight into the buffer the sink names (``frame_buffer``), usually its final
place, waking only once a good part of the rest has arrived (SO_RCVLOWAT). A flagged header
says the payload is in the peer's shared-memory arena (arena.py), and a CREDIT frame returns
space in ours, which lets the ``Sender`` go on. EOF after a goodbye (either side's) ends the
connection in good order; EOF otherwise, a reset, or a frame that breaks the protocol raises,
and the transport's ``lose`` ends the connection and reports it once.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

from .arena import credited, from_arena
from .base import FrameSink
from .connection import Connection, Outgoing
from .frame import CREDIT, DATA, FLAG_SHM, GOODBYE, FrameError, Header
from .sending import Sender

__all__ = ["Receiver"]

_READS_PER_EVENT = 64


class Receiver:
    """The incoming streams of one transport's connections (see the module docstring)."""

    def __init__(
        self, peers: dict[int, Connection], sink: FrameSink, sender: Sender,
        lose: Callable[[Connection, BaseException], None],
        remove: Callable[[Connection], list[Outgoing]],
    ) -> None:  # fmt: skip
        """``peers``: the transport's open connections (its own dict); ``sender``: its sending
        side (a CREDIT resumes it, and returns space through it); ``lose``: it ends a
        connection that failed; ``remove``: it forgets one closed in good order, returning
        the frames that will now never leave."""
        self._peers, self._sink, self._sender = peers, sink, sender
        self._lose, self._remove = lose, remove

    def on_readable(self, peer: Connection) -> None:
        """The loop saw ``peer``'s socket readable: read what it holds (within bounds)."""
        try:
            for _ in range(_READS_PER_EVENT):
                if not self._read_once(peer):
                    return
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, FrameError) as exc:
            self._lose(peer, exc)

    def _read_once(self, peer: Connection) -> bool:
        """One recv; returns False when the socket has nothing more (or the peer is gone)."""
        reader = peer.reader
        room = reader.room()
        n = peer.sock.recv_into(room)
        if n == 0:
            return self._eof(peer)
        if reader.payload is None:  # headers (and small payloads) through the staging buffer
            reader.received(n)
            self.parse_staged(peer)
            return n == len(room) and peer.rank in self._peers  # a short read: drained for now
        if reader.received(n):
            self._set_lowat(peer, 1)  # the next header wakes us at once
            self._deliver(peer)
            return True
        self._set_lowat(peer, min(len(room) - n, peer.lowat_cap))
        return False  # a short read means the socket is drained for now

    def _set_lowat(self, peer: Connection, nbytes: int) -> None:
        """Wake for this peer only once ``nbytes`` have arrived (SO_RCVLOWAT; an EOF or an
        error wakes at once). Used for the rest of a payload, which its sender writes whole:
        one wake-up per ~half a megabyte instead of one per ~64 KiB the network delivers,
        so a rank that computes meanwhile is interrupted a tenth as often."""
        nbytes = max(1, nbytes)
        if peer.lowat == nbytes:
            return
        try:
            peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:  # not supported here: wake for every byte, as without it
            peer.lowat_cap = 1
            return
        peer.lowat = nbytes

    def parse_staged(self, peer: Connection) -> None:
        """Take every complete frame out of the staging buffer, and start the payload after."""
        reader = peer.reader
        while (header := reader.next_header()) is not None:
            if header.type == CREDIT:
                reader.skip()
                credited(peer, header.instance)
                if not peer.inflight:
                    self._sender.flush(peer)
            elif header.flags & FLAG_SHM:
                credit = from_arena(peer, header, self._sink)
                if credit is not None:
                    self._sender.send(peer.rank, credit, memoryview(b""), 1 << 62, None)
            else:
                self._start_payload(peer, header)

    def _start_payload(self, peer: Connection, header: Header) -> None:
        """Consume a staged payload where it lies, or land the payload where the sink says."""
        reader, size = peer.reader, header.payload_len
        if size and header.type == DATA:
            staged = reader.staged_payload(size)
            if staged is not None and self._sink.frame_view(peer.rank, header, staged):
                reader.skip(size)  # consumed where it lies
                return
        dest = self._sink.frame_buffer(peer.rank, header)
        if dest is None:
            dest = memoryview(bytearray(size))
        elif len(dest) != size:
            raise FrameError(f"rank {peer.rank} sent {size} bytes where {len(dest)} were expected")
        if reader.land(dest):
            self._deliver(peer)

    def _deliver(self, peer: Connection) -> None:
        """The frame being read is whole: hand it to the sink."""
        header = peer.reader.header
        payload = peer.reader.finish()
        assert header is not None
        if header.type == GOODBYE:
            peer.said_goodbye = True
        self._sink.on_frame(peer.rank, header, payload)

    def _eof(self, peer: Connection) -> bool:
        """EOF is the end of a closing handshake (either side said goodbye), else a failure."""
        orderly = peer.said_goodbye or self._sender.leaving
        if orderly and peer.reader.between_frames():
            for out in self._remove(peer):
                self._sink.on_sent(out.token)  # never leaving now: nobody waits for them
            return False
        raise ConnectionResetError(errno.ECONNRESET, "connection closed by peer")

    def divert(self, peer_rank: int) -> None:
        """(See ``Transport.divert``.)"""
        peer = self._peers.get(peer_rank)
        if peer is not None:
            peer.reader.divert()
