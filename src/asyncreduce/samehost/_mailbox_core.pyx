# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The mailboxes' hot steps in C (the issue's "small native helper"): a lane operation's
publish, its look at the peers' slots, the fold of every rank's contribution, and a wait for
the peers' stamps that spins without the GIL. mailbox.py's ``Mailbox`` is the reference: the
layout, the meaning and the results are its own (``NativeMailbox`` there uses this module
where it was built; the tests run both).

Stamps are stored with release and loaded with acquire order, so a reader that sees a stamp
sees the slot written before it on any CPU; on x86-64 both are plain moves, as in Python.

The fold (``ar_fold``, in kernels/_fold.h) takes float32, float64, int8, int16, int32, int64 and
uint8 with every reduction that the communicator accepts for them; ``collect`` says 3 for
anything else (bool, float16, bfloat16, complex), which mailbox.py then folds with numpy.
Each element is combined left to right in rank order as numpy's ufuncs do it (``a + b``; max
and min keep a NaN and give a tie of -0.0 and 0.0 to the later operand, as ``np.maximum``),
integers wrap (built with -fwrapv), and nothing is reassociated or contracted into fused
multiply-adds (no -ffast-math, -ffp-contract=off): the compiler vectorizes across elements
only, so every rank that folds the same parts gets the same bits, and numpy's but for which
NaN a sum of two different NaNs keeps (x86 takes one operand's; the operands' order is the
compiler's).
"""

from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

from ._spin_fold cimport (AR_SPIN_BEFORE_NAPS, ar_fold, ar_load_acquire, ar_now, ar_pause,
                          ar_store_release)


cdef enum:
    _HEADER_BYTES = 48  # state and the five descriptor fields, after the stamp


cdef class Core:
    """Every rank's region of one mailbox, in rank order, as raw addresses (``regions``:
    flat uint8 numpy arrays, kept alive here, so no spinning waiter can outlive the memory it
    reads), and the layout mailbox.py defines (``head_words``: the word where slot 0's header
    starts; ``fields``: words per header; ``data``: the byte offset of slot 0's data)."""

    cdef object _regions
    cdef int64_t _released  # 1 once released: a ``wait`` under way reads it between looks
    cdef int64_t **_words
    cdef uint8_t **_data
    cdef uint8_t **_parts
    cdef int world, rank, slots, fields, head_words
    cdef Py_ssize_t slot_bytes

    def __cinit__(self, int rank, object regions, int slots, int fields, int head_words,
                  Py_ssize_t data, Py_ssize_t slot_bytes):
        cdef int r
        cdef uintptr_t address
        regions = tuple(regions)  # (a list the caller keeps could be emptied under us)
        self.world = len(regions)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of {self.world} regions")
        if slots < 1 or fields < 7 or slot_bytes < 0 or data < (head_words + slots * fields) * 8:
            raise ValueError("not a mailbox layout")
        for r in range(self.world):
            if regions[r].nbytes < data + slots * slot_bytes or not regions[r].flags.c_contiguous:
                raise ValueError(f"region {r} is not a contiguous {data + slots * slot_bytes} bytes")
        self._words = <int64_t **>malloc(self.world * sizeof(int64_t *))
        self._data = <uint8_t **>malloc(self.world * sizeof(uint8_t *))
        self._parts = <uint8_t **>malloc(self.world * sizeof(uint8_t *))
        if self._words == NULL or self._data == NULL or self._parts == NULL:
            raise MemoryError()
        for r in range(self.world):
            address = regions[r].ctypes.data
            self._words[r] = <int64_t *>address
            self._data[r] = <uint8_t *>address + data
        self._regions = regions
        self.rank, self.slots, self.fields, self.head_words = rank, slots, fields, head_words
        self.slot_bytes = slot_bytes

    def release(self):
        """Let go of the regions (their memory goes once nothing else holds it): every later
        call raises ValueError but ``wait``, which returns True, and a ``wait`` under way
        keeps them until it returns, which it does at its next look."""
        self._regions = None
        ar_store_release(&self._released, 1)

    cdef inline int _check(self, int64_t seq) except -1:
        if self._regions is None:
            raise ValueError("this mailbox was released")
        if seq < 0:
            raise ValueError(f"no operation has the sequence number {seq}")
        return 0

    def __dealloc__(self):
        free(self._words)
        free(self._data)
        free(self._parts)

    cdef inline Py_ssize_t _base(self, int64_t seq) noexcept nogil:
        return self.head_words + (seq % self.slots) * self.fields

    def publish(self, int64_t seq, object header, object data):
        """Write ``data`` (a contiguous buffer or None) and ``header`` (48 bytes) into this
        rank's slot for ``seq``, then its stamp."""
        cdef Py_buffer view
        self._check(seq)
        cdef int64_t *words = self._words[self.rank] + self._base(seq)
        if data is not None:
            PyObject_GetBuffer(data, &view, PyBUF_ANY_CONTIGUOUS)
            try:
                if view.len > self.slot_bytes:
                    raise ValueError(f"{view.len} bytes do not fit a {self.slot_bytes}-byte slot")
                memcpy(self._data[self.rank] + (seq % self.slots) * self.slot_bytes, view.buf,
                       view.len)
            finally:
                PyBuffer_Release(&view)
        PyObject_GetBuffer(header, &view, PyBUF_ANY_CONTIGUOUS)
        try:
            if view.len != _HEADER_BYTES:
                raise ValueError(f"a header is {_HEADER_BYTES} bytes, not {view.len}")
            memcpy(words + 1, view.buf, _HEADER_BYTES)
        finally:
            PyBuffer_Release(&view)
        ar_store_release(words, seq + 1)

    cdef inline bint _stamped(self, Py_ssize_t base, int64_t stamp) noexcept nogil:
        cdef int r
        for r in range(self.world):
            if r != self.rank and ar_load_acquire(self._words[r] + base) != stamp:
                return False
        return True

    def state(self, int64_t seq, object header):
        """0 (waiting) while a peer has not published ``seq``; 1 (agreed) if every peer's
        header is ``header``; 2 (different) otherwise."""
        return self._collect(seq, header, None)

    def collect(self, int64_t seq, object header, object out):
        """``state``, and where every peer agrees, ``out`` = every rank's contribution folded
        in rank order (then divided by the world size for ``avg``), the element type and
        reduction read from ``header``; 3 instead of 1 for a type or reduction this module
        does not fold, ``out`` untouched."""
        return self._collect(seq, header, out)

    cdef int _collect(self, int64_t seq, object header, object out) except -1:
        cdef Py_buffer view
        cdef Py_ssize_t base = self._base(seq)
        cdef const int64_t *mine
        cdef int r, state = 1
        self._check(seq)
        if not self._stamped(base, seq + 1):
            return 0
        PyObject_GetBuffer(header, &view, PyBUF_ANY_CONTIGUOUS)
        try:
            if view.len != _HEADER_BYTES:
                raise ValueError(f"a header is {_HEADER_BYTES} bytes, not {view.len}")
            for r in range(self.world):
                if r != self.rank and memcmp(self._words[r] + base + 1, view.buf,
                                             _HEADER_BYTES) != 0:
                    return 2
            mine = <const int64_t *>view.buf
            if out is not None and not self._fold(seq, out, <int>mine[2], <int>mine[3]):
                state = 3
        finally:
            PyBuffer_Release(&view)
        return state

    def wait(self, int64_t seq, double seconds):
        """Until every peer has stamped ``seq`` (True) or ``seconds`` have passed (False),
        yielding the core between looks (sleeping between them after the first
        200 us), without the GIL; True once released, before it or
        while it waits (the lane closed: its waiter looks again and finds its request
        failed)."""
        cdef Py_ssize_t base = self._base(seq)
        cdef int64_t stamp = seq + 1
        cdef bint there
        cdef double end
        cdef object regions = self._regions  # alive until this returns, released or not
        if regions is None:
            return True  # released (the lane closed): nothing to wait for, look again
        self._check(seq)
        cdef double now, naps_from
        with nogil:
            now = ar_now()
            end, naps_from = now + seconds, now + AR_SPIN_BEFORE_NAPS
            there = self._stamped(base, stamp)
            while not there and not ar_load_acquire(&self._released) and now < end:
                ar_pause(now, naps_from)
                there = self._stamped(base, stamp)
                now = ar_now()
        return there or self._released != 0

    cdef bint _fold(self, int64_t seq, object out, int dtype_code, int op) except -1:
        """``out`` = every rank's contribution to ``seq`` folded in rank order, then divided
        by the world size for ``avg`` (``dtype_code``, ``op``: reduction.py's codes). False,
        with ``out`` untouched, for an element type or reduction this module does not fold."""
        cdef Py_buffer view
        cdef Py_ssize_t slot = (seq % self.slots) * self.slot_bytes
        cdef int r, done
        PyObject_GetBuffer(out, &view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if view.len > self.slot_bytes:
                raise ValueError(f"{view.len} bytes do not fit a {self.slot_bytes}-byte slot")
            for r in range(self.world):
                self._parts[r] = self._data[r] + slot
            done = ar_fold(dtype_code, op, view.buf, self._parts, self.world, view.len)
        finally:
            PyBuffer_Release(&view)
        return done != 0
