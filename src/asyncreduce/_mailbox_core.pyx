# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The mailboxes' hot steps in C (the issue's "small native helper"): a lane operation's
publish, its look at the peers' slots, the fold of every rank's contribution, and a wait for
the peers' stamps that spins without the GIL. mailbox.py's ``Mailbox`` is the reference: the
layout, the meaning and the results are its own (``NativeMailbox`` there uses this module
where it was built; the tests run both).

Stamps are stored with release and loaded with acquire order, so a reader that sees a stamp
sees the slot written before it on any CPU; on x86-64 both are plain moves, as in Python.

The fold takes float32, float64, int8, int16, int32, int64 and uint8 with every reduction
that the communicator accepts for them; ``fold`` returns False for anything else (bool,
float16, bfloat16, complex), which mailbox.py then folds with numpy. Each element is combined
left to right in rank order as numpy's ufuncs do it (``a + b``, NaN kept by max and min, as
``np.maximum``), integers wrap (built with -fwrapv) and nothing is contracted into fused
multiply-adds (-ffp-contract=off), so every rank that folds the same parts gets the same bits.
"""

from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef extern from *:
    """
    static inline void ar_store_release(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline int64_t ar_load_acquire(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    #include <sched.h>
    """
    void ar_store_release(int64_t *p, int64_t v) nogil
    int64_t ar_load_acquire(const int64_t *p) nogil
    int sched_yield() nogil


ctypedef fused number:
    float
    double
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t

cdef enum:  # reduction.REDUCTION_CODES
    _SUM = 1
    _AVG = 2
    _MAX = 3
    _MIN = 4
    _PROD = 5
    _BAND = 6
    _BOR = 7
    _BXOR = 8

cdef enum:
    _HEADER_BYTES = 48  # state and the five descriptor fields, after the stamp

cdef enum:  # reduction.DTYPES' codes of the types folded here
    _FLOAT32 = 2
    _FLOAT64 = 3
    _INT32 = 4
    _INT64 = 5
    _UINT8 = 6
    _INT8 = 8
    _INT16 = 12


cdef inline bint _is_nan(number x) noexcept nogil:
    return x != x


cdef void _fold(number *out, uint8_t **parts, int world, Py_ssize_t count, int op) noexcept nogil:
    """out = parts[0] (op) parts[1] (op) ..., element by element, left to right (``op``
    checked by the caller: a bitwise one only for integers)."""
    cdef Py_ssize_t i
    cdef int r
    cdef number a, b
    cdef number *first = <number *>parts[0]
    cdef number *part
    for i in range(count):
        out[i] = first[i]
    for r in range(1, world):
        part = <number *>parts[r]
        if op == _SUM or op == _AVG:
            for i in range(count):
                out[i] = out[i] + part[i]
        elif op == _PROD:
            for i in range(count):
                out[i] = out[i] * part[i]
        elif op == _MAX:
            for i in range(count):
                a, b = out[i], part[i]
                out[i] = a if (a >= b or _is_nan(a)) else b
        elif op == _MIN:
            for i in range(count):
                a, b = out[i], part[i]
                out[i] = a if (a <= b or _is_nan(a)) else b
        elif op == _BAND:
            for i in range(count):
                out[i] = <number>(<int64_t>out[i] & <int64_t>part[i])
        elif op == _BOR:
            for i in range(count):
                out[i] = <number>(<int64_t>out[i] | <int64_t>part[i])
        else:
            for i in range(count):
                out[i] = <number>(<int64_t>out[i] ^ <int64_t>part[i])
    if op == _AVG and world > 1:
        for i in range(count):
            out[i] = out[i] / <number>world


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Core:
    """Every rank's region of one mailbox, in rank order, as raw addresses (``regions``:
    flat uint8 numpy arrays, kept alive here, so no spinning waiter can outlive the memory it
    reads), and the layout mailbox.py defines (``head_words``: the word where slot 0's header
    starts; ``fields``: words per header; ``data``: the byte offset of slot 0's data)."""

    cdef object _regions
    cdef int64_t **_words
    cdef uint8_t **_data
    cdef uint8_t **_parts
    cdef int world, rank, slots, fields, head_words
    cdef Py_ssize_t slot_bytes

    def __cinit__(self, int rank, list regions, int slots, int fields, int head_words,
                  Py_ssize_t data, Py_ssize_t slot_bytes):
        cdef int r
        cdef uintptr_t address
        self.world = len(regions)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of {self.world} regions")
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
        """Let go of the regions (their memory goes once nothing else holds it); every later
        call raises ValueError, and a ``wait`` under way keeps them until it returns."""
        self._regions = None

    cdef inline int _check(self) except -1:
        if self._regions is None:
            raise ValueError("this mailbox was released")
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
        self._check()
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
        cdef Py_buffer view
        cdef Py_ssize_t base = self._base(seq)
        cdef int r
        self._check()
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
        finally:
            PyBuffer_Release(&view)
        return 1

    def wait(self, int64_t seq, double seconds):
        """Until every peer has stamped ``seq`` (True) or ``seconds`` have passed (False),
        yielding the core between looks, without the GIL."""
        cdef Py_ssize_t base = self._base(seq)
        cdef int64_t stamp = seq + 1
        cdef bint there
        cdef double end
        cdef object regions = self._regions  # alive until this returns, released or not
        self._check()
        with nogil:
            end = _now() + seconds
            there = self._stamped(base, stamp)
            while not there and _now() < end:
                sched_yield()
                there = self._stamped(base, stamp)
        return there

    def fold(self, int64_t seq, object out, int dtype_code, int op):
        """``out`` = every rank's contribution to ``seq`` folded in rank order, then divided
        by the world size for ``avg`` (``dtype_code``, ``op``: reduction.py's codes). False,
        with ``out`` untouched, for an element type or reduction this module does not fold."""
        cdef Py_buffer view
        cdef Py_ssize_t slot = (seq % self.slots) * self.slot_bytes
        cdef int r
        cdef bint floating = dtype_code == _FLOAT32 or dtype_code == _FLOAT64
        if not (floating or dtype_code == _INT32 or dtype_code == _INT64 or dtype_code == _UINT8
                or dtype_code == _INT8 or dtype_code == _INT16):
            return False
        if not (_SUM <= op <= _BXOR) or (floating and op >= _BAND) or (op == _AVG and not floating):
            return False
        self._check()
        PyObject_GetBuffer(out, &view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if view.len > self.slot_bytes:
                raise ValueError(f"{view.len} bytes do not fit a {self.slot_bytes}-byte slot")
            for r in range(self.world):
                self._parts[r] = self._data[r] + slot
            if dtype_code == _FLOAT32:
                _fold(<float *>view.buf, self._parts, self.world, view.len // 4, op)
            elif dtype_code == _FLOAT64:
                _fold(<double *>view.buf, self._parts, self.world, view.len // 8, op)
            elif dtype_code == _INT32:
                _fold(<int32_t *>view.buf, self._parts, self.world, view.len // 4, op)
            elif dtype_code == _INT64:
                _fold(<int64_t *>view.buf, self._parts, self.world, view.len // 8, op)
            elif dtype_code == _INT16:
                _fold(<int16_t *>view.buf, self._parts, self.world, view.len // 2, op)
            elif dtype_code == _INT8:
                _fold(<int8_t *>view.buf, self._parts, self.world, view.len, op)
            else:
                _fold(<uint8_t *>view.buf, self._parts, self.world, view.len, op)
        finally:
            PyBuffer_Release(&view)
        return True
