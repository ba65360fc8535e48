# cython: language_level=3, boundscheck=False, wraparound=False
"""A direct run's wait for its partner's frame, in C (the issue's "small native helper"):
``take`` reads a TCP stream until it holds one expected frame whole, spinning without the
GIL and yielding the core between looks. ``TcpTransport.take_frame`` is its one caller; its
Python path (a look with MSG_PEEK, then the same bytes dropped with MSG_TRUNC) is the
reference, which the tests also run (ASYNCREDUCE_NATIVE=0).

One receive per look, not two: the bytes are taken off the stream into the connection's
staging buffer, where the reader would have put them. If they are the frame (its header and
name byte for byte), it is folded from there and the reader never sees it; if they are
anything else (another frame, a beat, a goodbye) the caller hands them to the reader as
received, and the loop judges them as if it had read them itself.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.string cimport memcmp
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_DONTWAIT


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef enum:  # what ``take`` found: the frame (room[:whole]), nothing yet (nothing taken),
    _FRAME, _NOTHING, _OTHER, _END, _PART  # other bytes (room[:n] taken: the reader's now),
    # the end (nothing taken), the frame's first n bytes (taken: the caller's, to go on from)

FRAME, NOTHING, OTHER, END, PART = _FRAME, _NOTHING, _OTHER, _END, _PART


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


def take(int fd, const unsigned char[::1] head, unsigned char[::1] room, Py_ssize_t whole,
         double seconds, Py_ssize_t offset=0):
    """Read ``fd`` (non-blocking) into ``room`` until it holds ``whole`` bytes that start
    with ``head``, for at most ``seconds`` (one look at least), going on after the first
    ``offset`` bytes of it (a PART before): (what it found, the bytes taken in all). Bytes
    that start otherwise are OTHER: the caller gives them to the reader. An error is its
    errno, negated (with what was taken before it, for the reader)."""
    cdef Py_ssize_t hl = head.shape[0], n = offset, seen
    cdef ssize_t got
    cdef int err = 0, found = _NOTHING
    cdef double end
    if whole > room.shape[0] or hl > whole or not 0 <= offset < whole:
        raise ValueError(f"a {whole}-byte frame with a {hl}-byte header does not fit "
                         f"{room.shape[0]} bytes of room")
    cdef const unsigned char *expected = &head[0]
    cdef unsigned char *into = &room[0]
    with nogil:
        end = _now() + seconds
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
                err = errno
                break
            if _now() >= end:
                found = _PART if n else _NOTHING
                break
            sched_yield()
    return (-err if err else found), n
