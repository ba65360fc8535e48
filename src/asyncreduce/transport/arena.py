"""The shared-memory arenas of the TCP transport (the shm lane): a large payload to a same-host
peer goes into the arena this rank writes for it, and only its header, flagged ``FLAG_SHM``,
on the wire; the reader reduces straight from its side of the arena (or copies out), then
returns the space in batches with CREDIT frames. The arenas themselves are samehost/shm.py's.
"""

from __future__ import annotations

from ..samehost.shm import SHM_MIN_BYTES, copy_bytes
from .base import FrameSink
from .connection import Connection, Outgoing
from .frame import CREDIT, DATA, FLAG_SHM, Descriptor, FrameError, Header, pack_header, with_flags

__all__ = ["credited", "from_arena", "to_arena"]


def to_arena(peer: Connection, out: Outgoing) -> bool:
    """Move a large payload for a same-host peer into its arena (``out`` then carries the
    flagged header alone); False if there is no room yet (the peer's CREDIT makes some)."""
    arena = peer.arena_out
    size = out.payload.nbytes
    if arena is None or size < SHM_MIN_BYTES or not arena.fits(size) or out.sent:
        return True
    if not arena.write(out.payload):
        return False
    out.head = with_flags(out.head, FLAG_SHM)
    out.payload = memoryview(b"")
    return True


def credited(peer: Connection, position: int) -> None:
    """The peer returned its arena space up to ``position``; FrameError if it cannot have."""
    if peer.arena_out is None:
        raise FrameError(f"rank {peer.rank} returned arena space it was never given")
    try:
        peer.arena_out.credit(position)
    except ValueError as exc:
        raise FrameError(f"rank {peer.rank}: {exc}") from None


def from_arena(peer: Connection, header: Header, sink: FrameSink) -> bytes | None:
    """A payload in the peer's arena, handed to ``sink`` (reduced straight from it, or copied
    out); the CREDIT frame to send back, when one is due (credit goes in batches)."""
    arena = peer.arena_in
    if arena is None or header.type != DATA or not arena.fits(header.payload_len):
        raise FrameError(f"rank {peer.rank} sent a shared-memory frame this rank cannot read")
    view = arena.read(header.payload_len)
    if sink.frame_view(peer.rank, header, view):
        peer.reader.skip()
    else:
        dest = sink.frame_buffer(peer.rank, header) or memoryview(bytearray(len(view)))
        if len(dest) != len(view):
            raise FrameError(
                f"rank {peer.rank} sent {len(view)} bytes where {len(dest)} were expected"
            )
        copy_bytes(dest, view)
        peer.reader.skip()  # nothing of it was on the wire
        sink.on_frame(peer.rank, header, dest)
    view.release()
    if not arena.credit_due():
        return None
    arena.credited = arena.position
    return pack_header(CREDIT, b"", arena.position, 0, 0, 0, Descriptor(0, 0, 0, 0, 0))
