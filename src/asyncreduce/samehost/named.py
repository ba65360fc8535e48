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
from array import array
from typing import TypeAlias

import numpy as np

from ..algorithms import Array
from ..envvars import native_allowed
from ..kernels.reduction import DType, fold_quietly
from .mailbox import AGREED, DIFFERENT, HERE, SLOT_BYTES, WAITING, SlotHeader, region_bytes

try:
    from ._named_core import NamedCore
except ImportError:  # not built (no C compiler at set-up): the Python slots alone
    NamedCore = None  # type: ignore[assignment,misc]

__all__ = [
    "MAX_RANKS",
    "NAMED_SLOTS",
    "Found",
    "NamedSlots",
    "found_for",
    "key_words",
    "named_bytes",
]

NAMED_SLOTS = 32  # named operations a rank may have in the lane at once
MAX_RANKS = 256  # ranks a host's lane takes named operations for (each has a row of acks)
_FIELDS = 16  # words per slot header: generation, state + 5 descriptor fields, key (3), pad
_STATE, _KEY = 1, 7  # where the header's state and key words start
_COUNT = NAMED_SLOTS * _FIELDS  # the word after the headers: publishes and withdrawals so far
_HEADS = (NAMED_SLOTS + 1) * _FIELDS * 8
_ACKS = MAX_RANKS * NAMED_SLOTS * 8

_AGREED_UNFOLDED = 3  # (the C core's word for AGREED where it left the fold to numpy)

KeyWords = tuple[int, int, int]  # the name's hash (two words) and the instance


Found: TypeAlias = "array[int]"  # per rank: its slot holding the key (-1: not found), that
# slot's generation, and the rank's count when last looked for it in vain (-1: never)


def found_for(world_size: int) -> Found:
    """A fresh ``Found`` for one operation."""
    return array("q", (-1, 0, -1) * world_size)


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
        self.world_size = len(self._order)
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
        generation = self._generation[slot]
        self._write(slot, generation, key, head, data)
        self._generation[slot] = generation + 2
        self._used.add(slot)
        return slot

    def _write(
        self, slot: int, generation: int, key: KeyWords, head: SlotHeader, data: Array | None
    ) -> None:
        words, base = self._mine.words, slot * _FIELDS
        words[base] = generation + 1  # odd: being written
        if data is not None and data.nbytes:
            np.copyto(self._mine.data[slot][: data.nbytes], data.view(np.uint8))
        words[base + _STATE : base + _STATE + 6] = head
        words[base + _KEY], words[base + _KEY + 1], words[base + _KEY + 2] = key
        words[base] = generation + 2  # then the count: a reader that sees it sees the rest
        words[_COUNT] += 1

    def withdraw(self, slot: int) -> None:
        """Take back ``slot``: its operation left the lane here (to the engine, or failed)."""
        generation = self._generation[slot]
        self._take_back(slot, generation)
        self._generation[slot] = generation + 2
        self._used.discard(slot)

    def _take_back(self, slot: int, generation: int) -> None:
        words, base = self._mine.words, slot * _FIELDS
        words[base] = generation + 1
        words[base + _STATE] = 0
        words[base] = generation + 2
        words[_COUNT] += 1

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

    def fold(
        self, key: KeyWords, slot: int, found: Found, head: SlotHeader, out: Array,
        dtype: DType, op: str,
    ) -> int:  # fmt: skip
        """Where every peer's slots hold ``key`` (``found`` remembers where): ``AGREED``
        once ``out`` = every rank's contribution reduced with ``op`` in rank order (``slot``:
        this rank's), as the engine would, and the peers' slots acknowledged; ``DIFFERENT``
        where a peer's header is not ``head``; else ``WAITING`` (a peer not there yet, or one
        that took its slot back while this rank read it: ``out`` is then this rank's
        contribution again)."""
        if not self._find(key, found):
            return WAITING
        for peer, named in self._peers.items():
            base = found[3 * peer] * _FIELDS + _STATE
            if named.words[base : base + 6] != head:
                return DIFFERENT
        return AGREED if self._fold_checked(slot, found, out, dtype, op) else WAITING

    def wait(self, found: Found, seconds: float) -> bool:
        """Spin for at most ``seconds`` until a peer not found yet published something. This
        one never spins (False: the caller looks again); the native one does, without the
        GIL."""
        return False

    def _find(self, key: KeyWords, found: Found) -> bool:
        complete = True
        for peer, named in self._peers.items():
            words, at = named.words, 3 * peer
            there = found[at]
            if there >= 0:
                if words[there * _FIELDS] == found[at + 1]:
                    continue
                found[at] = -1
            count = words[_COUNT]  # (read first: a publish after it moves it)
            if found[at + 2] == count:
                complete = False
                continue
            where = _search(words, key)
            if where is None:
                found[at + 2] = count
                complete = False
            else:
                found[at], found[at + 1] = where
        return complete

    def _fold_checked(self, slot: int, found: Found, out: Array, dtype: DType, op: str) -> bool:
        """Fold into ``out``; then, unless a peer took its slot back meanwhile (False: ``out``
        put back), acknowledge the peers' slots."""
        nbytes = out.nbytes
        if nbytes:
            parts = [self._every[r].data[slot if r == self.rank else found[3 * r]][:nbytes]
                     for r in self._order]  # fmt: skip
            fold_quietly(dtype, op, parts, out, len(self._order))
        for peer, named in self._peers.items():
            if named.words[found[3 * peer] * _FIELDS] != found[3 * peer + 1]:
                if nbytes:
                    np.copyto(out.view(np.uint8).reshape(-1), self._mine.data[slot][:nbytes])
                return False
        acks = self._mine.acks
        for peer in self._peers:
            acks[peer * NAMED_SLOTS + found[3 * peer]] = found[3 * peer + 1]
        return True

    def missing(self, key: KeyWords) -> set[int]:
        """The peers whose slots do not hold ``key`` now."""
        return {p for p, named in self._peers.items() if _search(named.words, key) is None}

    def release(self) -> None:
        """Let go of every mapping (the lane closed)."""
        for named in self._every.values():
            named.release()
        self._peers, self._every = {}, {}


class NativeNamedSlots(NamedSlots):
    """``NamedSlots`` with its hot steps in C (``_named_core``): the same layout and results;
    ``wait`` spins without the GIL. Only where every rank has it (``open_mailbox``'s rule)."""

    def __init__(self, rank: int, mine: Array, peers: dict[int, Array]) -> None:
        super().__init__(rank, mine, peers)
        if NamedCore is None:
            raise RuntimeError("asyncreduce.samehost._named_core was not built: use NamedSlots")
        regions = [mine if r == rank else peers[r] for r in range(self.world_size)]
        self._core = NamedCore(rank, regions, region_bytes(), NAMED_SLOTS, _FIELDS, _HEADS,
                               _ACKS, SLOT_BYTES)  # fmt: skip

    def _write(
        self, slot: int, generation: int, key: KeyWords, head: SlotHeader, data: Array | None
    ) -> None:
        self._core.publish(slot, generation, head, *key, data)

    def _take_back(self, slot: int, generation: int) -> None:
        self._core.withdraw(slot, generation)

    def fold(
        self, key: KeyWords, slot: int, found: Found, head: SlotHeader, out: Array,
        dtype: DType, op: str,
    ) -> int:  # fmt: skip
        state = self._core.fold(*key, slot, found, head, out)
        if state == _AGREED_UNFOLDED:  # a type or reduction C does not fold: numpy's
            return AGREED if self._fold_checked(slot, found, out, dtype, op) else WAITING
        return state  # type: ignore[no-any-return]

    def wait(self, found: Found, seconds: float) -> bool:
        return self._core.wait(found, seconds)  # type: ignore[no-any-return]

    def release(self) -> None:
        self._core.release()
        super().release()


def native_named_wanted() -> bool:
    """Whether this rank can and would use ``NativeNamedSlots``: it was built, and
    ASYNCREDUCE_NATIVE is not 0. Every rank must, or none does (each folds the same way)."""
    return NamedCore is not None and native_allowed()


def open_named(rank: int, mine: Array, peers: dict[int, Array], native: bool) -> NamedSlots:
    """Rank ``rank``'s named slots over these regions: ``NativeNamedSlots`` if ``native``
    (``native_named_wanted`` on every rank), else ``NamedSlots``."""
    return (NativeNamedSlots if native else NamedSlots)(rank, mine, peers)


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
