/* What the C helpers that wait on shared memory share (_mailbox_core.pyx and _named_core.pyx,
   next to it): stores with release and loads with acquire order (plain moves on x86-64), a
   monotonic clock in seconds, and a waiter's pause between two looks. */
#ifndef ASYNCREDUCE_SPIN_H
#define ASYNCREDUCE_SPIN_H

#include <sched.h>
#include <stdint.h>
#include <time.h>

static inline void ar_store_release(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int64_t ar_load_acquire(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline double ar_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Yield the core until naps_from, then sleep 20 us between looks: a peer that is not running
   (four ranks on two cores) gets the core, where a yield alone (CFS: the yielding spinner may
   well be picked again) left it waiting for a time slice. */
#define AR_SPIN_BEFORE_NAPS 200e-6
static inline void ar_pause(double now, double naps_from)
{
    if (now < naps_from) {
        sched_yield();
    } else {
        struct timespec nap = {0, 20000};
        nanosleep(&nap, NULL);
    }
}

#endif
