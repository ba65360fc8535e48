"""Transports: how frames move between the ranks of one communicator.

Theory of operation. The engine speaks only to the small interface in base.py (``Transport``
and the ``FrameSink`` it reports to). Under it:

    frame.py     the frame format, its checks, and FrameReader (bytes in, frames out; no socket)
    mesh.py      building the connections: every pair of ranks, authenticated, once at init
    listener.py  the authenticated accept loop shared by the mesh and the rendezvous store
    tcp.py       TcpTransport: sending (priority heap, batching), receiving, closing handshake
    connection.py  what TcpTransport keeps per connection (queued frames, the stream in)
    shm.py       the shared-memory arenas that carry large payloads between same-host ranks

Nothing here knows operations or algorithms; the engine owns those.
"""

from __future__ import annotations

from .base import FrameSink, Transport

__all__ = ["FrameSink", "Transport"]
