# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The named slots' hot steps in C: a named lane operation's publish, its search of the peers'
slots, the fold of every rank's contribution with the check that no slot moved meanwhile, the
acknowledgements, and a wait for the peers that spins without the GIL. samehost/named.py's
``NamedSlots`` is the reference: the layout, the meaning and the results are its own
(``NativeNamedSlots`` there uses this module where it was built; the tests run both). The
fold is kernels/_fold.h's, as in _mailbox_core.pyx (whose docstring says what it takes and why
every rank gets the same bits).

Generations and counts are stored with release and loaded with acquire order, so a reader
that sees one sees what was written before it on any CPU; on x86-64 both are plain moves.
"""

from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

from ._spin_fold cimport (AR_SPIN_BEFORE_NAPS, ar_fold, ar_load_acquire, ar_now, ar_pause,
                          ar_store_release)


cdef enum:
    _HEADER_BYTES = 48  # state and the five descriptor fields, after the generation
    _HERE = 1
    _STATE = 1
    _KEY = 7
    _WAITING = 0
    _AGREED = 1
    _DIFFERENT = 2
    _AGREED_UNFOLDED = 3  # every peer agrees; the fold is numpy's (a type C does not fold)

cdef class NamedCore:
    """Every rank's named slots (``regions``, in rank order, each from byte ``start``), as raw
    addresses; the layout's numbers come from named.py."""

    cdef object _regions
    cdef int64_t **_heads
    cdef int64_t **_acks
    cdef uint8_t **_data
    cdef uint8_t **_parts
    cdef int world, rank, slots, fields, count
    cdef Py_ssize_t slot_bytes

    def __cinit__(self, int rank, object regions, Py_ssize_t start, int slots, int fields,
                  Py_ssize_t heads_bytes, Py_ssize_t acks_bytes, Py_ssize_t slot_bytes):
        cdef int r
        cdef size_t address
        regions = tuple(regions)
        self.world = len(regions)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of {self.world} regions")
        if slots < 1 or fields < _KEY + 3 or heads_bytes < (slots + 1) * fields * 8 \
                or acks_bytes < self.world * slots * 8:
            raise ValueError("not a named-slots layout")
        cdef Py_ssize_t need = start + heads_bytes + acks_bytes + slots * slot_bytes
        for r in range(self.world):
            if regions[r].nbytes < need or not regions[r].flags.c_contiguous:
                raise ValueError(f"region {r} is not a contiguous {need} bytes")
        self._heads = <int64_t **>malloc(self.world * sizeof(int64_t *))
        self._acks = <int64_t **>malloc(self.world * sizeof(int64_t *))
        self._data = <uint8_t **>malloc(self.world * sizeof(uint8_t *))
        self._parts = <uint8_t **>malloc(self.world * sizeof(uint8_t *))
        if self._heads == NULL or self._acks == NULL or self._data == NULL or self._parts == NULL:
            raise MemoryError()
        for r in range(self.world):
            address = regions[r].ctypes.data + start
            self._heads[r] = <int64_t *>address
            self._acks[r] = <int64_t *>(address + heads_bytes)
            self._data[r] = <uint8_t *>(address + heads_bytes + acks_bytes)
        self._regions = regions
        self.rank, self.slots, self.fields, self.count = rank, slots, fields, slots * fields
        self.slot_bytes = slot_bytes

    def __dealloc__(self):
        free(self._heads)
        free(self._acks)
        free(self._data)
        free(self._parts)

    def release(self):
        """Let go of the regions: every later call raises ValueError."""
        self._regions = None

    cdef inline int _check(self, int slot) except -1:
        if self._regions is None:
            raise ValueError("these named slots were released")
        if not 0 <= slot < self.slots:
            raise ValueError(f"no slot {slot}")
        return 0

    def publish(self, int slot, int64_t generation, object header, int64_t k0, int64_t k1,
                int64_t instance, object data):
        """Write ``data`` (a contiguous buffer or None), ``header`` (48 bytes) and the key
        into this rank's ``slot``, between the odd ``generation + 1`` and the even
        ``generation + 2``; then move the count."""
        cdef Py_buffer view
        self._check(slot)
        cdef int64_t *words = self._heads[self.rank] + slot * self.fields
        ar_store_release(words, generation + 1)
        if data is not None:
            PyObject_GetBuffer(data, &view, PyBUF_ANY_CONTIGUOUS)
            try:
                if view.len > self.slot_bytes:
                    raise ValueError(f"{view.len} bytes do not fit a {self.slot_bytes}-byte slot")
                memcpy(self._data[self.rank] + slot * self.slot_bytes, view.buf, view.len)
            finally:
                PyBuffer_Release(&view)
        PyObject_GetBuffer(header, &view, PyBUF_ANY_CONTIGUOUS)
        try:
            if view.len != _HEADER_BYTES:
                raise ValueError(f"a header is {_HEADER_BYTES} bytes, not {view.len}")
            memcpy(words + _STATE, view.buf, _HEADER_BYTES)
        finally:
            PyBuffer_Release(&view)
        words[_KEY], words[_KEY + 1], words[_KEY + 2] = k0, k1, instance
        ar_store_release(words, generation + 2)
        cdef int64_t *count = self._heads[self.rank] + self.count
        ar_store_release(count, count[0] + 1)

    def withdraw(self, int slot, int64_t generation):
        """Take back this rank's ``slot`` (written at ``generation``): ``generation + 2``."""
        self._check(slot)
        cdef int64_t *words = self._heads[self.rank] + slot * self.fields
        ar_store_release(words, generation + 1)
        words[_STATE] = 0
        ar_store_release(words, generation + 2)
        cdef int64_t *count = self._heads[self.rank] + self.count
        ar_store_release(count, count[0] + 1)

    cdef int _search(self, int r, int64_t k0, int64_t k1, int64_t instance,
                     int64_t *generation) noexcept nogil:
        cdef const int64_t *heads = self._heads[r]
        cdef const int64_t *words
        cdef int64_t seen
        cdef int i, slot
        cdef int prefer = <int>(((k0 + instance) % self.slots + self.slots) % self.slots)
        for i in range(-1, self.slots):
            slot = prefer if i < 0 else i
            words = heads + slot * self.fields
            seen = ar_load_acquire(words)
            if seen & 1 or seen == 0 or words[_STATE] != _HERE:
                continue
            if words[_KEY] == k0 and words[_KEY + 1] == k1 and words[_KEY + 2] == instance \
                    and ar_load_acquire(words) == seen:
                generation[0] = seen
                return slot
        return -1

    cdef bint _find(self, int64_t k0, int64_t k1, int64_t instance, int64_t *found) noexcept nogil:
        cdef bint complete = True
        cdef int r, there
        cdef int64_t count, generation = 0
        for r in range(self.world):
            if r == self.rank:
                continue
            if found[3 * r] >= 0:
                if ar_load_acquire(self._heads[r] + found[3 * r] * self.fields) == found[3 * r + 1]:
                    continue
                found[3 * r] = -1
            count = ar_load_acquire(self._heads[r] + self.count)
            if found[3 * r + 2] == count:
                complete = False
                continue
            there = self._search(r, k0, k1, instance, &generation)
            if there < 0:
                found[3 * r + 2] = count
                complete = False
            else:
                found[3 * r], found[3 * r + 1] = there, generation
        return complete

    def fold(self, int64_t k0, int64_t k1, int64_t instance, int slot, object found,
               object header, object out):
        """``NamedSlots.fold`` (``found``: its array, updated in place): 0 waiting, 1
        agreed (``out`` folded, the peers' slots acknowledged), 2 different, or 3 agreed
        with the fold left to numpy (a type or reduction C does not fold; nothing done)."""
        cdef Py_buffer found_view, head_view, out_view
        cdef int64_t *at
        cdef const int64_t *head
        cdef int r, state = _AGREED
        self._check(slot)
        PyObject_GetBuffer(found, &found_view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if found_view.len != 3 * self.world * 8:
                raise ValueError("found is not this world's")
            at = <int64_t *>found_view.buf
            if not self._find(k0, k1, instance, at):
                return _WAITING
            PyObject_GetBuffer(header, &head_view, PyBUF_ANY_CONTIGUOUS)
            try:
                if head_view.len != _HEADER_BYTES:
                    raise ValueError(f"a header is {_HEADER_BYTES} bytes, not {head_view.len}")
                for r in range(self.world):
                    if r != self.rank and memcmp(self._heads[r] + at[3 * r] * self.fields + _STATE,
                                                 head_view.buf, _HEADER_BYTES) != 0:
                        return _DIFFERENT
                head = <const int64_t *>head_view.buf
                PyObject_GetBuffer(out, &out_view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
                try:
                    state = self._fold_checked(slot, at, out_view, <int>head[2], <int>head[3])
                finally:
                    PyBuffer_Release(&out_view)
            finally:
                PyBuffer_Release(&head_view)
        finally:
            PyBuffer_Release(&found_view)
        return state

    cdef int _fold_checked(self, int slot, int64_t *at, Py_buffer out, int dtype,
                           int op) except -1:
        cdef int r
        if out.len > self.slot_bytes:
            raise ValueError(f"{out.len} bytes do not fit a {self.slot_bytes}-byte slot")
        if out.len:
            for r in range(self.world):
                self._parts[r] = self._data[r] + (slot if r == self.rank else at[3 * r]) \
                    * self.slot_bytes
            if not ar_fold(dtype, op, out.buf, self._parts, self.world, out.len):
                return _AGREED_UNFOLDED
        for r in range(self.world):
            if r != self.rank and ar_load_acquire(
                    self._heads[r] + at[3 * r] * self.fields) != at[3 * r + 1]:
                if out.len:  # a peer took its slot back meanwhile: put this rank's part back
                    memcpy(out.buf, self._data[self.rank] + slot * self.slot_bytes, out.len)
                return _WAITING
        for r in range(self.world):
            if r != self.rank:
                self._acks[self.rank][r * self.slots + at[3 * r]] = at[3 * r + 1]
        return _AGREED

    def wait(self, object found, double seconds):
        """Until a peer not found yet in ``found`` moved its count (True), or ``seconds``
        have passed (False), yielding the core between looks (sleeping between them after
        the first 200 us), without the GIL."""
        cdef Py_buffer view
        cdef const int64_t *at
        cdef bint moved = False
        cdef double now, end, naps_from
        cdef int r
        cdef object regions = self._regions  # alive until this returns, released or not
        if regions is None:
            return True
        PyObject_GetBuffer(found, &view, PyBUF_ANY_CONTIGUOUS)
        try:
            if view.len != 3 * self.world * 8:
                raise ValueError("found is not this world's")
            at = <const int64_t *>view.buf
            for r in range(self.world):
                if r != self.rank and at[3 * r] < 0:
                    break
            else:
                return True  # every peer is there: nothing to wait for
            with nogil:
                now = ar_now()
                end, naps_from = now + seconds, now + AR_SPIN_BEFORE_NAPS
                while True:
                    for r in range(self.world):
                        if r != self.rank and at[3 * r] < 0 and \
                                ar_load_acquire(self._heads[r] + self.count) != at[3 * r + 2]:
                            moved = True
                    if moved or now >= end:
                        break
                    ar_pause(now, naps_from)
                    now = ar_now()
        finally:
            PyBuffer_Release(&view)
        return moved
