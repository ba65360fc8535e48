"""Shared-memory arenas: the data plane between ranks on the same host.

Theory of operation. For each ordered pair of ranks on one host (same boot, same network
and process namespaces) the sender owns an *arena*: a shared-memory segment (below) that both
ranks map. Headers still travel on the pair's TCP
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

Segments (arenas, and the windows of window.py, which also hold the lane's mailboxes) are
anonymous files (``memfd_create``): nothing is ever named in /dev/shm, so nothing can be left
there however a process ends (SIGKILL, or SIGTERM while it waits for a peer in set-up). Its
creator makes one mode 0600, full size (a lack of memory fails here, not with SIGBUS later),
sealed against shrinking and growing, and keeps its descriptor open while the peers open it
as ``/proc/<pid>/fd/<n>`` (the kernel lets a process of the same user do that: a ptrace
*read* check, which Yama does not restrict); then it closes it, and the memory lives exactly
as long as some process maps it. A peer maps only what is a sealed, private (this user, mode
0600) anonymous asyncreduce file, of the announced size and the announced inode, so a
reused pid or descriptor number is never mapped instead. Ranks in different process
namespaces cannot see each other's pids: ``host_identity`` tells them apart, so they talk
over TCP.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

import numpy as np

__all__ = [
    "copy_bytes",
    "Arena",
    "Segment",
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
_PREFIX = "asyncreduce-"  # a segment's name, as /proc/<pid>/fd/<n> shows it: /memfd:asyncreduce-
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_NAME = re.compile(r"memfd:([0-9]{1,10}):([0-9]{1,10}):([0-9]{1,20}):([0-9]{1,20})")


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
    """Ranks with the same identity can share memory: same boot, same network namespace, and
    the same process namespace (a peer's segment is opened through its pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"unshared-{os.getpid()}-{secrets.token_hex(8)}"
    return f"{boot}/{netns}/{pidns}"


@dataclass(frozen=True)
class Segment:
    """A shared-memory segment this process made: ``name`` is what its peers pass to
    ``open_segment``; ``close()`` once they have (from then on only mappings hold it)."""

    name: str
    fd: int

    def close(self) -> None:
        os.close(self.fd)


def create_segment(size: int) -> tuple[Segment, mmap.mmap]:
    """A new private anonymous shared-memory file of ``size`` bytes (see the module
    docstring), and its mapping; the caller closes the segment once its peers have mapped it."""
    fd = os.memfd_create(f"{_PREFIX}{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)  # a lack of memory fails here, not with SIGBUS later
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    return Segment(f"memfd:{os.getpid()}:{fd}:{info.st_dev}:{info.st_ino}", fd), mapping


def open_segment(name: str, size: int) -> mmap.mmap:
    """Map a peer's segment; refuses anything that is not a sealed private anonymous file of
    ours (this user, mode 0600) with the inode and the size the peer announced (ValueError),
    and a process it cannot reach (OSError)."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not an asyncreduce shared-memory segment: {name[:80]!r}")
    pid, number, dev, ino = (int(field) for field in match.groups())
    where = f"/proc/{pid}/fd/{number}"
    if not os.readlink(where).startswith(f"/memfd:{_PREFIX}"):
        raise ValueError(f"{where} is not an asyncreduce shared-memory segment")
    fd = os.open(where, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (dev, ino) or not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not the segment announced (another file)")
        if info.st_size != size or info.st_mode & 0o077 or info.st_uid != os.getuid():
            raise ValueError(f"{where} has the wrong size, mode or owner")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ValueError(f"{where} is not sealed against resizing")
        return mmap.mmap(fd, size, flags=_MAP_FLAGS)
    finally:
        os.close(fd)


def create_arena(size: int = ARENA_BYTES) -> tuple[Segment, Arena]:
    """A new private arena segment and its mapping; the caller closes the segment."""
    segment, mapping = create_segment(size)
    return segment, Arena(mapping)


def open_arena(name: str, size: int = ARENA_BYTES) -> Arena:
    """Map a peer's arena (see ``open_segment``)."""
    return Arena(open_segment(name, size))
