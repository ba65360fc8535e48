"""Shared-memory arenas: the data plane between ranks on the same host.

Theory of operation. For each ordered pair of ranks on one host (same boot, same network
namespace) the sender owns an *arena*: a file in /dev/shm, mode 0600, with an unguessable
name, that both ranks map and the sender unlinks as soon as the receiver has mapped it, so
nothing is left behind however either process ends. Headers still travel on the pair's TCP
connection, which also tells a dead peer at once; a DATA frame whose SHM flag is set carries
no bytes on TCP: its payload sits in the sender's arena at the next place.

The arena is a ring used strictly in order. A payload goes at the writer's cursor, or at
offset 0 if it would cross the end (the tail is skipped); writer and reader apply the same
rule, so no offset travels. The reader consumes payloads in the order their headers arrive
(TCP keeps that order), then returns the space with a CREDIT frame carrying its cumulative
position, once a quarter of the window is free to return. The writer starts a payload only
while at most a window (half the arena) is uncredited, so a more urgent frame never queues
behind much bulk data; a payload is at most half the window, so even with the skipped tail it
fits in the other half. A writer that waits has more than a window outstanding, so the
reader always has a credit to send: nobody waits forever. The writer never
overwrites bytes the reader has not credited, so the data is stable while the reader copies
it out or reduces straight from it.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

__all__ = [
    "copy_bytes",
    "Arena",
    "create_arena",
    "open_arena",
    "create_segment",
    "open_segment",
    "host_identity",
    "ARENA_BYTES",
    "SHM_MIN_BYTES",
]

ARENA_BYTES = 8 << 20  # per ordered pair of ranks on a host
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no page faults on the hot path
SHM_MIN_BYTES = 16 << 10  # smaller payloads ride along with their header on TCP
_DIR = "/dev/shm"


def copy_bytes(dest: memoryview, src: memoryview) -> None:
    """dest[:] = src through numpy, which lets other threads run during a large copy."""
    np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(src, np.uint8))


class Arena:
    """One direction of one pair: positions are cumulative byte counts, skips included."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.size = len(mapping)
        self.window = self.size // 2  # at most this much uncredited: urgent frames wait less
        self._mapping = mapping
        self.view = memoryview(mapping)
        self.position = 0  # writer: bytes placed; reader: bytes consumed
        self.credited = 0  # writer: bytes the reader gave back; reader: bytes it reported

    def _place(self, nbytes: int) -> tuple[int, int]:
        """(offset, how far the cursor moves) for the next payload of ``nbytes``."""
        offset = self.position % self.size
        if offset + nbytes > self.size:
            return 0, self.size - offset + nbytes
        return offset, nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether a payload this large may ever use the arena."""
        return nbytes <= self.window // 2

    def credit_due(self) -> bool:
        """Reader: enough consumed since the last CREDIT to send another."""
        return self.position - self.credited >= self.window // 4

    def write(self, payload: memoryview) -> bool:
        """Copy ``payload`` in at the next place; False (nothing written) if no room yet."""
        offset, advance = self._place(payload.nbytes)
        uncredited = self.position - self.credited
        if uncredited > self.window or uncredited + advance > self.size:
            return False
        copy_bytes(self.view[offset : offset + payload.nbytes], payload)
        self.position += advance
        return True

    def read(self, nbytes: int) -> memoryview:
        """The next payload (valid until the reader credits it back)."""
        offset, advance = self._place(nbytes)
        self.position += advance
        return self.view[offset : offset + nbytes]

    def credit(self, position: int) -> None:
        """The reader has consumed everything before ``position``."""
        if not self.credited <= position <= self.position:
            raise ValueError(f"credit {position} outside [{self.credited}, {self.position}]")
        self.credited = position

    def close(self) -> None:
        try:
            self.view.release()
            self._mapping.close()
        except BufferError:
            pass  # a slice is still referenced somewhere; the mapping goes with it


def host_identity() -> str:
    """Ranks with the same identity can share memory: same boot, same network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unshared-{os.getpid()}-{secrets.token_hex(8)}"
    return f"{boot}/{netns}"


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """A new private shared-memory file (0600, random name) of ``size`` bytes, mapped; the
    caller unlinks it once its peers have mapped it."""
    name = f"asyncreduce-{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with SIGBUS later
        mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path, mapping


def open_segment(path: str, size: int) -> mmap.mmap:
    """Map a peer's segment; refuses anything that is not a plain private file of ours
    (this user, mode 0600) of the size the peer announced."""
    if not path.startswith(_DIR + "/asyncreduce-") or "/" in path[len(_DIR) + 1 :]:
        raise ValueError(f"not an asyncreduce shared-memory file: {path!r}")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_size != size or info.st_mode & 0o077 or info.st_uid != os.getuid():
            raise ValueError(f"{path} has the wrong size, mode or owner")
        return mmap.mmap(fd, size, flags=_MAP_FLAGS)
    finally:
        os.close(fd)


def create_arena(size: int = ARENA_BYTES) -> tuple[str, Arena]:
    """A new private arena file and its mapping; the caller unlinks it."""
    path, mapping = create_segment(size)
    return path, Arena(mapping)


def open_arena(path: str, size: int = ARENA_BYTES) -> Arena:
    """Map a peer's arena (see ``open_segment``)."""
    return Arena(open_segment(path, size))
