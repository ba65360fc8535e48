# cython: language_level=3, boundscheck=False, wraparound=False
"""A direct run's wait for its partner's frame, in C (the issue's "small native helper"):
``take`` reads a TCP stream until it holds one expected frame whole, spinning without the
GIL and yielding the core between looks; ``swap`` first sends this rank's frame of the same
step (a step of recursive doubling), and ``swaps`` makes every step of an operation so, one
after the other, in one call. ``TcpTransport.take_frame``, ``TcpTransport.swap`` and
``TcpTransport.swaps`` are their callers; the Python path (``send_now``, then a look with
MSG_PEEK and the same bytes dropped with MSG_TRUNC) is the reference, which the tests also
run (ASYNCREDUCE_NATIVE=0).

One receive per look, not two: the bytes are taken off the stream into the connection's
staging buffer, where the reader would have put them. If they are the frame (its header and
name byte for byte), it is folded from there and the reader never sees it; if they are
anything else (another frame, a beat, a goodbye) the caller hands them to the reader as
received, and the loop judges them as if it had read them itself.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uintptr_t
from libc.string cimport memcmp, memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len


cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        iovec *msg_iov
        size_t msg_iovlen
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef extern from "../kernels/_fold.h" nogil:
    int ar_combine(int dtype, int op, void *acc, const void *incoming, Py_ssize_t nbytes,
                   int incoming_first)
    int ar_itemsize(int dtype)


cdef enum:  # what ``take`` found: the frame (room[:whole]), nothing yet (nothing taken),
    _FRAME, _NOTHING, _OTHER, _END, _PART, _UNSENT, _COMBINED  # other bytes (room[:n]
    # taken: the reader's now), the end (nothing taken), the frame's first n bytes (taken:
    # the caller's, to go on from); ``swap`` also: its own frame did not leave whole
    # (nothing taken), or the frame, combined into the buffer

FRAME, NOTHING, OTHER, END, PART, UNSENT, COMBINED = (
    _FRAME, _NOTHING, _OTHER, _END, _PART, _UNSENT, _COMBINED
)


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _take(int fd, const unsigned char *expected, Py_ssize_t hl, unsigned char *into,
               Py_ssize_t whole, double seconds, Py_ssize_t *taken) noexcept nogil:
    """``take``'s loop, from the ``taken[0]`` bytes already in ``into``: what it found, or
    an errno negated; ``taken[0]``: the bytes taken in all."""
    cdef Py_ssize_t n = taken[0], seen
    cdef ssize_t got
    cdef int found = _NOTHING
    cdef double end = _now() + seconds
    while True:
        got = recv(fd, into + n, <size_t>(whole - n), MSG_DONTWAIT)
        if got > 0:
            n += got
            seen = n if n < hl else hl
            if memcmp(into, expected, <size_t>seen) != 0:
                found = _OTHER
                break
            if n == whole:
                found = _FRAME
                break
        elif got == 0:
            found = _OTHER if n else _END
            break
        elif errno != EAGAIN and errno != EINTR:
            found = -errno
            break
        if _now() >= end:
            found = _PART if n else _NOTHING
            break
        sched_yield()
    taken[0] = n
    return found


def _check_room(Py_ssize_t hl, Py_ssize_t room, Py_ssize_t whole, Py_ssize_t offset):
    if whole > room or hl > whole or not 0 <= offset < whole:
        raise ValueError(f"a {whole}-byte frame with a {hl}-byte header does not fit "
                         f"{room} bytes of room")


def take(int fd, const unsigned char[::1] head, unsigned char[::1] room, Py_ssize_t whole,
         double seconds, Py_ssize_t offset=0):
    """Read ``fd`` (non-blocking) into ``room`` until it holds ``whole`` bytes that start
    with ``head``, for at most ``seconds`` (one look at least), going on after the first
    ``offset`` bytes of it (a PART before): (what it found, the bytes taken in all). Bytes
    that start otherwise are OTHER: the caller gives them to the reader. An error is its
    errno, negated (with what was taken before it, for the reader)."""
    cdef Py_ssize_t hl = head.shape[0], n = offset
    cdef int found
    _check_room(hl, room.shape[0], whole, offset)
    with nogil:
        found = _take(fd, &head[0], hl, &room[0], whole, seconds, &n)
    return found, n


def combines(int dtype, int op):
    """Whether ``swap`` combines ``dtype`` with ``op`` in C (reduction.py's codes)."""
    return ar_combine(dtype, op, NULL, NULL, 0, 0) != 0


cdef inline bint _aligned(const void *a, const void *b, int dtype) noexcept nogil:
    """Both at a multiple of the element size (a named operation's header is of any length,
    a caller's array may start anywhere): the C loops read and write whole elements."""
    cdef uintptr_t size = <uintptr_t>ar_itemsize(dtype)
    return size != 0 and ((<uintptr_t>a) | (<uintptr_t>b)) % size == 0


cdef int _swap_one(int fd, const unsigned char *head, Py_ssize_t hl,
                   const unsigned char *payload, Py_ssize_t size, unsigned char *room,
                   double seconds, bint combine, unsigned char *target, int dtype, int op,
                   int incoming_first, ssize_t *sent, Py_ssize_t *n) noexcept nogil:
    """One ``swap`` (see it), without the GIL: what it found; ``sent[0]`` and ``n[0]``: the
    bytes sent (an errno, negated, on an error) and taken. ``combine``: into ``target``
    (NULL for an empty payload, which is then COMBINED as it is)."""
    cdef iovec parts[2]
    cdef msghdr msg
    cdef int found = _UNSENT
    memset(&msg, 0, sizeof(msg))
    parts[0].iov_base = <void *>head
    parts[0].iov_len = <size_t>hl
    parts[1].iov_base = <void *>payload
    parts[1].iov_len = <size_t>size
    msg.msg_iov = parts
    msg.msg_iovlen = 2
    n[0] = 0
    sent[0] = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
    if sent[0] < 0:
        sent[0] = 0 if errno == EAGAIN or errno == EINTR else -errno
    elif sent[0] == hl + size:
        found = _take(fd, head, hl, room, hl + size, seconds, n)
        if found == _FRAME and combine and (size == 0 or _aligned(target, room + hl, dtype)):
            if size:
                ar_combine(dtype, op, target, room + hl, size, incoming_first)
            found = _COMBINED
    return found


cdef unsigned char *_target(unsigned char *into, Py_ssize_t length, Py_ssize_t size,
                            int dtype, int op) except? NULL:
    """Where a swap combines a ``size``-byte payload: ``into`` (``length`` bytes), checked;
    NULL for an empty payload."""
    if length != size or not combines(dtype, op):
        raise ValueError(f"cannot combine a {size}-byte payload into {length} "
                         f"bytes of dtype {dtype} by reduction {op}")
    return into if size else NULL


def swap(int fd, const unsigned char[::1] head, const unsigned char[::1] payload,
         unsigned char[::1] room, double seconds, unsigned char[::1] into=None, int dtype=0,
         int op=0, bint incoming_first=False):
    """One step of a symmetric exchange (a direct run's recursive doubling): send ``head``
    and ``payload`` in one ``sendmsg`` (non-blocking), then, if they left whole, ``take``
    the partner's frame, which starts with the same ``head`` and is as long: (what it
    found, the bytes sent, the bytes taken). UNSENT where the frame did not leave whole
    (nothing taken); the bytes sent are then an errno, negated, on an error. Given ``into``
    (as long as the payload), the partner's payload is also combined into it as
    ``reduction.combine`` does (``dtype``, ``op``: reduction.py's codes; ``combines``), and
    a FRAME is COMBINED: the step's reduction too, all in one call into C, without the GIL
    (where both lie at a multiple of the element size; else the FRAME is the caller's to
    combine)."""
    cdef Py_ssize_t hl = head.shape[0], size = payload.shape[0], n = 0
    cdef ssize_t sent = 0
    cdef int found
    cdef unsigned char *target = NULL
    cdef bint combine = into is not None
    if combine:
        target = _target(&into[0] if into.shape[0] else NULL, into.shape[0], size, dtype, op)
    _check_room(hl, room.shape[0], hl + size, 0)
    with nogil:
        found = _swap_one(fd, &head[0], hl, &payload[0] if size else NULL, size, &room[0],
                          seconds, combine, target, dtype, op, incoming_first, &sent, &n)
    return found, sent, n


cdef enum:
    _MAX_SWAPS = 32  # steps of one ``swaps`` call (a world of 2**32 ranks)
    _MAX_HEAD = 48 + 1024  # a header and the longest name (frame.py; pairs.py checks)

MAX_HEAD = _MAX_HEAD  # the longest header and name ``swaps`` takes


def swaps(tuple fds, tuple rooms, tuple steps, tuple firsts, head, Py_ssize_t step_at,
          payload, double seconds, into=None, int dtype=0, int op=0):
    """``swap`` for every step of a direct run in a row, one call into C for all of them:
    step ``i`` over connection ``fds[i]`` with its staging room ``rooms[i]``, its header
    ``head`` but for the step, ``steps[i]`` (written as 4 little-endian bytes at
    ``step_at``), the partner's operand first where ``firsts[i]``. Each goes on only if the
    one before ended well: COMBINED where ``into`` is given, else (empty messages) FRAME.
    (how many ended well, then what the next one found, sent and took, as ``swap`` says;
    (COMBINED or FRAME, 0, 0) after them all). A header longer than ``MAX_HEAD`` is
    refused. The buffers are taken by the buffer protocol, not as typed memoryviews: this is
    called for every small allreduce."""
    cdef Py_ssize_t count = len(fds), i, taken = 0, n = 0
    cdef ssize_t sent = 0
    cdef int found = _FRAME, done = 0, well = _FRAME
    cdef bint combine = into is not None
    cdef int cfds[_MAX_SWAPS]
    cdef unsigned int csteps[_MAX_SWAPS]
    cdef int cfirsts[_MAX_SWAPS]
    cdef Py_buffer croom[_MAX_SWAPS]
    cdef Py_buffer chead, cpayload, cinto
    cdef unsigned char hbuf[_MAX_HEAD]
    cdef unsigned char *target = NULL
    if not (count == len(rooms) == len(steps) == len(firsts)) or count > _MAX_SWAPS:
        raise ValueError(f"{count} swaps: as many connections, rooms, steps and orders "
                         f"(at most {_MAX_SWAPS}) are needed")
    PyObject_GetBuffer(head, &chead, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(payload, &cpayload, PyBUF_SIMPLE)
        try:
            if into is not None:
                PyObject_GetBuffer(into, &cinto, PyBUF_WRITABLE)
            try:
                if into is not None:
                    target = _target(<unsigned char *>cinto.buf, cinto.len, cpayload.len,
                                     dtype, op)
                    well = _COMBINED
                if chead.len > _MAX_HEAD or not 0 <= step_at <= chead.len - 4:
                    raise ValueError(f"a {chead.len}-byte header with its step at {step_at}")
                memcpy(hbuf, chead.buf, <size_t>chead.len)
                while taken < count:
                    PyObject_GetBuffer(rooms[taken], &croom[taken], PyBUF_WRITABLE)
                    taken += 1
                    _check_room(chead.len, croom[taken - 1].len, chead.len + cpayload.len, 0)
                for i in range(count):
                    cfds[i], csteps[i], cfirsts[i] = fds[i], steps[i], bool(firsts[i])
                with nogil:
                    for i in range(count):
                        hbuf[step_at] = csteps[i] & 0xFF
                        hbuf[step_at + 1] = (csteps[i] >> 8) & 0xFF
                        hbuf[step_at + 2] = (csteps[i] >> 16) & 0xFF
                        hbuf[step_at + 3] = (csteps[i] >> 24) & 0xFF
                        found = _swap_one(cfds[i], hbuf, chead.len,
                                          <const unsigned char *>cpayload.buf, cpayload.len,
                                          <unsigned char *>croom[i].buf, seconds,
                                          combine, target, dtype, op, cfirsts[i], &sent,
                                          &n)
                        if found != well:
                            break
                        done += 1
                        sent = n = 0
            finally:
                for i in range(taken):
                    PyBuffer_Release(&croom[i])
                if into is not None:
                    PyBuffer_Release(&cinto)
        finally:
            PyBuffer_Release(&cpayload)
    finally:
        PyBuffer_Release(&chead)
    return done, found, sent, n

