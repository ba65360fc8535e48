# The C both same-host helpers (_mailbox_core.pyx, _named_core.pyx) call, declared once: the
# atomics, clock and a waiter's pause between looks (_spin.h), and the fold (kernels/_fold.h).

from libc.stdint cimport int64_t, uint8_t


cdef extern from "_spin.h":
    void ar_store_release(int64_t *p, int64_t v) nogil
    int64_t ar_load_acquire(const int64_t *p) nogil
    double ar_now() nogil
    void ar_pause(double now, double naps_from) nogil
    double AR_SPIN_BEFORE_NAPS


cdef extern from "../kernels/_fold.h":
    int ar_fold(int dtype, int op, void *out, uint8_t **parts, int world, Py_ssize_t nbytes) nogil
