"""Named slots: where the ranks of one host leave their *named* small allreduces, found by key.

Theory of operation. An unnamed operation has a sequence number that every rank agrees on, so
its slot is fixed (mailbox.py). A named one may be posted in any order, from any thread, so a
rank cannot know where a peer will put it: each rank publishes it in any free slot of its own
``NAMED_SLOTS``, headed by its key (a 128-bit hash of the name and the instance), and readers
search a peer's slots for the key (the slot the key's hash prefers first, then all).

Each slot carries a generation, written like a sequence lock: odd while its owner writes it,
even once written. A reader reads the generation first and again after reading what it needs;
a change means the owner took the slot back (``withdraw``: the operation went to the engine),
and the reader looks again. The owner reuses a slot only once every peer has said it is done
with that generation (``ack``: each rank has a row of words per owner, which only it writes)
or after taking it back: so a slot an operation completed from is never overwritten under a
reader. (x86-64 orders stores with stores and loads with loads: ``mailbox.supported``.)

Nothing here blocks or knows about threads or operations: lane.py decides. What a peer wrote
is checked before use: a slot is read only with a stamp, a key and a header that match, and
its data only for the reader's own length.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from ..algorithms import Array
from ..kernels.reduction import DType, fold_quietly
from .mailbox import AGREED, DIFFERENT, HERE, SLOT_BYTES, WAITING, SlotHeader, region_bytes

__all__ = ["MAX_RANKS", "NAMED_SLOTS", "NamedSlots", "Found", "key_words", "named_bytes"]

NAMED_SLOTS = 32  # named operations a rank may have in the lane at once
MAX_RANKS = 256  # ranks a host's lane takes named operations for (each has a row of acks)
_FIELDS = 16  # words per slot header: generation, state + 5 descriptor fields, key (3), pad
_STATE, _KEY = 1, 7  # where the header's state and key words start
_COUNT = NAMED_SLOTS * _FIELDS  # the word after the headers: publishes and withdrawals so far
_HEADS = (NAMED_SLOTS + 1) * _FIELDS * 8
_ACKS = MAX_RANKS * NAMED_SLOTS * 8

KeyWords = tuple[int, int, int]  # the name's hash (two words) and the instance


class Found:
    """Where one operation's key was found in each peer's slots (peer -> slot, generation),
    and for a peer where it was not, that peer's count when it was looked for (``_COUNT``):
    its slots are searched again only once the count moved."""

    __slots__ = ("at", "looked")

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, int]] = {}
        self.looked: dict[int, int] = {}


def named_bytes() -> int:
    """What the named slots add to a rank's region (after the mailbox's)."""
    return _HEADS + _ACKS + NAMED_SLOTS * SLOT_BYTES


@functools.lru_cache(maxsize=4096)
def _name_hash(name: bytes) -> tuple[int, int]:
    digest = hashlib.blake2b(name, digest_size=16).digest()
    return int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(
        digest[8:], "little", signed=True
    )


def key_words(name: bytes, instance: int) -> KeyWords:
    """The words a key is published and found by."""
    return (*_name_hash(name), instance)


class _Named:
    """One rank's named part of its region: headers (int64 words), acks, data."""

    def __init__(self, raw: Array) -> None:
        start = region_bytes()
        if raw.size < start + named_bytes():
            raise ValueError(f"named slots need {start + named_bytes()} bytes, got {raw.size}")
        heads = raw[start : start + _HEADS]
        self.words = memoryview(heads).cast("q")  # type: ignore[arg-type]
        self.acks = memoryview(raw[start + _HEADS : start + _HEADS + _ACKS]).cast("q")  # type: ignore[arg-type]
        data = start + _HEADS + _ACKS
        self.data = [raw[data + i * SLOT_BYTES : data + (i + 1) * SLOT_BYTES]
                     for i in range(NAMED_SLOTS)]  # fmt: skip

    def release(self) -> None:
        self.words.release()
        self.acks.release()
        self.data.clear()


class NamedSlots:
    """Rank ``rank``'s named slots (in ``mine``, which it writes) and its peers' (read)."""

    def __init__(self, rank: int, mine: Array, peers: dict[int, Array]) -> None:
        if rank >= MAX_RANKS or any(p >= MAX_RANKS for p in peers):
            raise ValueError(f"named slots take at most {MAX_RANKS} ranks")
        self.rank = rank
        self._mine = _Named(mine)
        self._peers = {peer: _Named(raw) for peer, raw in sorted(peers.items())}
        self._every = {**self._peers, rank: self._mine}
        self._order = sorted(self._every)
        self._generation = [0] * NAMED_SLOTS  # of each of this rank's slots, as published
        self._draining: set[int] = set()  # completed here: free once every peer acked
        self._used: set[int] = set()  # holding an operation still in the lane here
        words = self._mine.words
        for slot in range(NAMED_SLOTS):
            words[slot * _FIELDS] = 0
        words[_COUNT] = 0

    # ---- this rank's slots ------------------------------------------------------------------

    def publish(self, key: KeyWords, head: SlotHeader, data: Array | None) -> int:
        """Put ``key``'s ``head`` and contribution ``data`` (None for nothing) in a free slot
        (the one its hash prefers, if free): that slot, or -1 where none is free."""
        slot = self._free_slot(_preferred(key))
        if slot < 0:
            return -1
        words, base = self._mine.words, slot * _FIELDS
        generation = self._generation[slot]
        words[base] = generation + 1  # odd: being written
        if data is not None and data.nbytes:
            np.copyto(self._mine.data[slot][: data.nbytes], data.view(np.uint8))
        words[base + _STATE : base + _STATE + 6] = head
        words[base + _KEY], words[base + _KEY + 1], words[base + _KEY + 2] = key
        self._generation[slot] = generation + 2
        words[base] = generation + 2  # then the count: a reader that sees it sees the rest
        words[_COUNT] += 1
        self._used.add(slot)
        return slot

    def withdraw(self, slot: int) -> None:
        """Take back ``slot``: its operation left the lane here (to the engine, or failed)."""
        words, base = self._mine.words, slot * _FIELDS
        generation = self._generation[slot]
        words[base] = generation + 1
        words[base + _STATE] = 0
        self._generation[slot] = generation + 2
        words[base] = generation + 2
        words[_COUNT] += 1
        self._used.discard(slot)

    def done(self, slot: int) -> None:
        """``slot``'s operation completed here: free once every peer is done with it."""
        self._used.discard(slot)
        self._draining.add(slot)

    def _free_slot(self, prefer: int) -> int:
        """``prefer`` if it is free, else any free slot, or -1."""
        if prefer not in self._used and prefer not in self._draining:
            return prefer
        if self._draining:
            self._drain()
        taken = self._used | self._draining
        if prefer not in taken:
            return prefer
        for slot in range(NAMED_SLOTS):
            if slot not in taken:
                return slot
        return -1

    def _drain(self) -> None:
        me = self.rank * NAMED_SLOTS
        for slot in list(self._draining):
            generation = self._generation[slot]
            if all(p.acks[me + slot] == generation for p in self._peers.values()):
                self._draining.discard(slot)

    # ---- the peers' -------------------------------------------------------------------------

    def find(self, key: KeyWords, found: Found) -> bool:
        """Add to ``found`` each peer whose slots hold ``key`` now; True once all do. What
        ``found`` holds already is checked still there (a taken-back slot is looked for anew)."""
        complete = True
        at, looked = found.at, found.looked
        for peer, named in self._peers.items():
            words = named.words
            there = at.get(peer)
            if there is not None:
                if words[there[0] * _FIELDS] == there[1]:
                    continue
                del at[peer]
            count = words[_COUNT]  # (read first: a publish after it moves it)
            if looked.get(peer) == count:
                complete = False
                continue
            where = _search(words, key)
            if where is None:
                looked[peer] = count
                complete = False
            else:
                at[peer] = where
        return complete

    def state(self, found: Found, head: SlotHeader) -> int:
        """``WAITING`` unless ``found`` has every peer; then ``AGREED`` if each one's header is
        ``head`` (``HERE``, the same descriptor), else ``DIFFERENT``."""
        if len(found.at) < len(self._peers):
            return WAITING
        for peer, (slot, _) in found.at.items():
            base = slot * _FIELDS + _STATE
            if self._peers[peer].words[base : base + 6] != head:
                return DIFFERENT
        return AGREED

    def fold(self, slot: int, found: Found, out: Array, dtype: DType, op: str) -> bool:
        """``out`` = every rank's contribution reduced with ``op`` in rank order (``slot``:
        this rank's), as the engine would; False (``out`` put back to this rank's
        contribution) where a peer took its slot back meanwhile."""
        nbytes = out.nbytes
        if nbytes:
            at = {p: s for p, (s, _) in found.at.items()}
            at[self.rank] = slot
            parts = [self._every[r].data[at[r]][:nbytes] for r in self._order]
            fold_quietly(dtype, op, parts, out, len(self._order))
        for peer, (there, generation) in found.at.items():
            if self._peers[peer].words[there * _FIELDS] != generation:
                if nbytes:
                    np.copyto(out.view(np.uint8).reshape(-1), self._mine.data[slot][:nbytes])
                return False
        return True

    def ack(self, found: Found) -> None:
        """Tell each peer in ``found`` that this rank is done with its slot there."""
        acks = self._mine.acks
        for peer, (slot, generation) in found.at.items():
            acks[peer * NAMED_SLOTS + slot] = generation

    def missing(self, key: KeyWords) -> set[int]:
        """The peers whose slots do not hold ``key`` now."""
        return {p for p, named in self._peers.items() if _search(named.words, key) is None}

    def release(self) -> None:
        """Let go of every mapping (the lane closed)."""
        for named in self._every.values():
            named.release()
        self._peers, self._every = {}, {}


def _preferred(key: KeyWords) -> int:
    """The slot a key is put in where it is free, and looked for first: the next instance of
    a name prefers the next slot, so a loop does not wait for its last one's to drain."""
    return (key[0] + key[2]) % NAMED_SLOTS


def _search(words: memoryview, key: KeyWords) -> tuple[int, int] | None:
    """Where ``key`` is published in one rank's named slots, with the slot's generation."""
    prefer = _preferred(key)
    for slot in (prefer, *range(NAMED_SLOTS)):
        base = slot * _FIELDS
        generation = words[base]
        if generation & 1 or not generation or words[base + _STATE] != HERE:
            continue
        if (words[base + _KEY] == key[0] and words[base + _KEY + 1] == key[1]
                and words[base + _KEY + 2] == key[2] and words[base] == generation):  # fmt: skip
            return slot, generation
    return None
