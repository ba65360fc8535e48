"""Transports: how frames move between the ranks of one communicator.

Theory of operation. The engine speaks only to the small interface in base.py (``Transport``
and the ``FrameSink`` it reports to). Under it:

    frame.py     the frame format, its checks, and FrameReader (bytes in, frames out; no socket)
    mesh.py      building the connections: every pair of ranks, authenticated, once at init
    listener.py  the authenticated accept loop shared by the mesh and the rendezvous store
    tcp.py       TcpTransport: its connections and their loop, closing handshake
    sending.py   its sending side: a priority heap per connection, writes in batches
    receiving.py its receiving side: frames read off each connection, handed to the sink
    connection.py  what TcpTransport keeps per connection (queued frames, the stream in)
    arena.py     large payloads to same-host ranks through their shared-memory arenas (the
                 arenas themselves: samehost/shm.py), CREDIT returning the space
    pairs.py     the quiet-pair mode a direct run uses: a frame straight into an idle
                 connection, the partner's straight off the stream (in C where it was built)
    owner.py     whose process is at the other end of a same-host connection

Nothing here knows operations or algorithms; the engine owns those.
"""

from __future__ import annotations

from .base import FrameSink, Transport

__all__ = ["FrameSink", "Transport"]
