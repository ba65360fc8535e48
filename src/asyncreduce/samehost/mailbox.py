"""Mailboxes: each rank's slots in shared memory, where the ranks of one host leave what their
unnamed small allreduces need from one another.

Theory of operation. Every rank owns one region, which only it writes and every peer on the
host maps (a shared window, window.py). It holds ``SLOTS`` slots and a counter. The unnamed
operation with sequence number ``seq`` (its key's instance: every rank posts unnamed
operations in the same order) always goes to slot ``seq % SLOTS``, on every rank, so a reader
knows where to look without being told. A slot holds its operation's descriptor and either
this rank's contribution (``HERE``) or a note that this rank runs the operation on the engine
instead (``ON_ENGINE``). Failures do not go through the mailboxes: the engine tells every rank
(lane.py).

Single writer, ordered stores. The owner writes a slot's data and descriptor first and its
stamp (``seq + 1``) last; a reader reads the stamp first. On x86-64 stores are seen in the
order they are made and loads are not reordered with loads, and numpy makes each store in its
own call, so a reader that sees the stamp sees what came before it. (Other CPUs would need
fences: ``supported`` says where mailboxes are used.) Each rank's counter ``through`` says
how many unnamed operations it is done with: for every one below it, it has read all it
needs (or never needed to). The owner reuses a slot for ``seq`` only once every rank, itself
included, is through ``seq - SLOTS``, so nothing a reader may still read is ever overwritten,
and the reader needs no lock and no second look.

Nothing here blocks, sleeps or knows about threads: lane.py drives it (``wait`` only spins,
for a time it is given). What a peer wrote is checked before use: a slot is read only if its
stamp is the operation's, and its data only for the reader's own length, which fits a slot
(the lane uses it only where the descriptors, counts included, agree).

Two implementations, one layout: ``Mailbox`` in Python and numpy, the reference, and
``NativeMailbox``, whose publish, look, fold and wait run in C (``_mailbox_core.pyx``, built
by the set-up command where a C compiler is; ``open_mailbox`` picks it where every rank has
it, so every rank folds with the same code).
"""

from __future__ import annotations

import functools
import platform
from array import array
from typing import TypeAlias

import numpy as np

from ..algorithms import SMALL_ALLREDUCE_BYTES, Array
from ..envvars import native_allowed
from ..kernels.reduction import DType, fold_quietly

try:
    from ._mailbox_core import Core
except ImportError:  # not built (no C compiler at set-up): the Python mailbox alone
    Core = None  # type: ignore[assignment,misc]

__all__ = ["AGREED", "DIFFERENT", "HERE", "ON_ENGINE", "SLOT_BYTES", "SLOTS", "WAITING",
           "SlotHeader", "Mailbox", "NativeMailbox", "header", "native_wanted", "open_mailbox",
           "region_bytes", "supported"]  # fmt: skip

SLOTS = 32  # operations a rank may have published ahead of its slowest peer
SLOT_BYTES = SMALL_ALLREDUCE_BYTES  # the largest contribution a slot takes
HERE, ON_ENGINE = 1, 2  # what a slot holds
WAITING, AGREED, DIFFERENT = 0, 1, 2  # what the peers' slots for one operation say
_AGREED_UNFOLDED = 3  # (the C mailbox's word for AGREED where it left the fold to numpy)

_STAMP, _STATE = 0, 1  # header fields (int64): stamp, state, then the 5 descriptor fields
_FIELDS = 8  # per slot header: 64 bytes, a cache line
_HEAD = 8 * 8  # the counter ``through``, alone on its cache line
_DATA = _HEAD + SLOTS * _FIELDS * 8
_HEAD_WORDS = _HEAD // 8


SlotHeader: TypeAlias = "array[int]"  # a slot's header after its stamp: state, the 5 fields


@functools.lru_cache(maxsize=1024)
def header(state: int, descriptor: tuple[int, ...]) -> SlotHeader:
    """What ``publish`` writes after the stamp, and ``state`` compares with, as one block;
    shared by every operation with the same descriptor (a loop posts the same few), so
    never written to."""
    return array("q", (state, *descriptor))


def region_bytes() -> int:
    """The size of one rank's region."""
    return _DATA + SLOTS * SLOT_BYTES


def supported() -> bool:
    """Whether this CPU orders plain stores as the mailboxes need (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def native_wanted() -> bool:
    """Whether this rank can and would use ``NativeMailbox``: it was built, and
    ASYNCREDUCE_NATIVE is not 0."""
    return Core is not None and native_allowed()


def open_mailbox(rank: int, mine: Array, peers: dict[int, Array], native: bool) -> Mailbox:
    """Rank ``rank``'s mailbox over these regions: ``NativeMailbox`` if ``native`` (every rank
    wants it: ``native_wanted``), else ``Mailbox``."""
    return (NativeMailbox if native else Mailbox)(rank, mine, peers)


class _Region:
    """One rank's region (a flat uint8 array of ``region_bytes()``): its counter and headers
    as int64 words (a memoryview: a store or load is one plain machine access, no numpy call),
    and its slots' data."""

    def __init__(self, raw: Array) -> None:
        if raw.size < region_bytes() or not raw.flags.c_contiguous:
            raise ValueError(f"a mailbox needs {region_bytes()} contiguous bytes, got {raw.size}")
        self.words = memoryview(raw[:_DATA]).cast("q")  # type: ignore[arg-type]  # [through, pad x7, headers...]
        self.slots = [raw[_DATA + i * SLOT_BYTES : _DATA + (i + 1) * SLOT_BYTES]
                      for i in range(SLOTS)]  # fmt: skip


def _base(seq: int) -> int:
    return _HEAD_WORDS + (seq % SLOTS) * _FIELDS  # the word where ``seq``'s header starts


class Mailbox:
    """Rank ``rank``'s region (``mine``, which it writes) and its peers' (``peers``, read)."""

    def __init__(self, rank: int, mine: Array, peers: dict[int, Array]) -> None:
        self.rank = rank
        self._mine = _Region(mine)
        self._peers = {peer: _Region(raw) for peer, raw in sorted(peers.items())}
        self._peer_words = [r.words for r in self._peers.values()]
        every = {**self._peers, rank: self._mine}
        self._slots = [every[r].slots for r in sorted(every)]  # every rank's, in rank order
        self._mine.words[0] = 0
        self.world_size = len(every)

    def free(self, seq: int) -> bool:
        """Whether slot ``seq % SLOTS`` may take ``seq``: every rank, this one included (it
        combines its own contribution from the slot), is done with what it held
        (``seq - SLOTS``)."""
        oldest = seq - SLOTS
        if oldest < 0:
            return True
        if self._mine.words[0] <= oldest:
            return False
        for words in self._peer_words:  # noqa: SIM110  (a generator costs more than the reads)
            if words[0] <= oldest:
                return False
        return True

    def publish(self, seq: int, header: SlotHeader, data: Array | None) -> None:
        """Put ``seq``'s ``header`` (``header(...)``: HERE with this rank's contribution
        ``data``, a contiguous array of at most ``SLOT_BYTES``, or ON_ENGINE with None) in its
        slot. Only after ``free(seq)``."""
        base, words = _base(seq), self._mine.words
        if data is not None:
            np.copyto(self._mine.slots[seq % SLOTS][: data.nbytes], data.view(np.uint8))
        words[base + _STATE : base + _STATE + 6] = header  # one copy: a peer spins on this line
        words[base + _STAMP] = seq + 1  # last: a reader that sees it sees the rest

    def state(self, seq: int, header: SlotHeader) -> int:
        """``WAITING`` while a peer has not published ``seq``; then ``AGREED`` if every peer's
        header is ``header`` (``HERE``, the same descriptor), else ``DIFFERENT``."""
        base, stamp = _base(seq), seq + 1
        peers = self._peer_words
        for words in peers:
            if words[base + _STAMP] != stamp:
                return WAITING
        for words in peers:
            if words[base + _STATE : base + _STATE + 6] != header:
                return DIFFERENT
        return AGREED

    def wait(self, seq: int, seconds: float) -> bool:
        """Spin for at most ``seconds`` until every peer has published ``seq``: True once they
        have. This one never spins (False: the caller's loop looks again); NativeMailbox's
        does, without the GIL."""
        return False

    def collect(self, seq: int, header: SlotHeader, out: Array, dtype: DType, op: str) -> int:
        """``state(seq, header)``, and where it is ``AGREED``, ``out`` = every rank's
        contribution reduced with ``op`` in rank order, as the engine's ``fold`` and
        ``finalize`` would (``header`` is ``out``'s, with ``dtype`` and ``op``)."""
        state = self.state(seq, header)
        if state == AGREED:
            self._fold(seq, out, dtype, op)
        return state

    def _fold(self, seq: int, out: Array, dtype: DType, op: str) -> None:
        if out.nbytes:  # (a barrier's nothing: no numpy call, no error state to set)
            fold_quietly(dtype, op, self.parts(seq, out.nbytes), out, self.world_size)

    def missing(self, seq: int) -> set[int]:
        """The peers that have not published ``seq`` yet."""
        base, stamp = _base(seq), seq + 1
        return {p for p, r in self._peers.items() if r.words[base + _STAMP] != stamp}

    def parts(self, seq: int, nbytes: int) -> list[Array]:
        """Every rank's contribution to ``seq`` (``AGREED``: all are ``nbytes`` long), in rank
        order, as raw bytes."""
        slot = seq % SLOTS
        return [slots[slot][:nbytes] for slots in self._slots]

    def release(self) -> None:
        """Let go of every mapping (the lane closed): each holds a file descriptor until the
        last view of it is gone, and a communicator's may not wait for the garbage collector."""
        for region in (self._mine, *self._peers.values()):
            region.words.release()
            region.slots.clear()
        self._peers, self._peer_words, self._slots = {}, [], []

    def done_through(self, seq: int) -> None:
        """Tell the peers this rank is done with every operation below ``seq``."""
        self._mine.words[0] = seq


class NativeMailbox(Mailbox):
    """``Mailbox`` with its hot steps in C (``_mailbox_core``): the same layout and results;
    ``wait`` spins without the GIL. Only where ``native_wanted`` on every rank."""

    def __init__(self, rank: int, mine: Array, peers: dict[int, Array]) -> None:
        super().__init__(rank, mine, peers)
        if Core is None:
            raise RuntimeError("asyncreduce.samehost._mailbox_core was not built: use Mailbox")
        regions = [mine if r == rank else peers[r] for r in range(self.world_size)]
        self._core = Core(rank, regions, SLOTS, _FIELDS, _HEAD_WORDS, _DATA, SLOT_BYTES)

    def publish(self, seq: int, header: SlotHeader, data: Array | None) -> None:
        self._core.publish(seq, header, data)

    def state(self, seq: int, header: SlotHeader) -> int:
        return self._core.state(seq, header)

    def wait(self, seq: int, seconds: float) -> bool:
        return self._core.wait(seq, seconds)

    def collect(self, seq: int, header: SlotHeader, out: Array, dtype: DType, op: str) -> int:
        state = self._core.collect(seq, header, out)
        if state == _AGREED_UNFOLDED:  # a type or reduction C does not fold: numpy's
            self._fold(seq, out, dtype, op)
            return AGREED
        return state

    def release(self) -> None:
        self._core.release()
        super().release()
