"""Where a rank's time goes: the CPU each of its threads used and the bytes its link carried.

The scaling benchmark's ``_measure`` takes a ``Usage`` snapshot at the start and at the end of
its timed window; ``window`` turns the two into the window's totals for this rank. The CPU is
split four ways: the training thread (the caller's, ``time.thread_time``), asyncreduce's
progress threads (named ``asyncreduce-engine-<rank>``, read from ``/proc``), everything else
(the process's CPU less those two: Gloo's threads for DDP, callbacks, the watchdog) and the
process total (``time.process_time``). All four come from the scheduler's run time in
nanoseconds (``thread_time``, ``process_time`` and ``/proc/.../schedstat`` read the same
counter), so the difference "other" is not the noise of 10 ms ticks; ``/proc/.../stat``'s ticks
are the fallback where schedstat is missing. ``schedstat``'s second field, the time a thread
spent runnable and waiting for a core (``thread_waited_s``), is read for the training and the
progress threads: with more ranks than cores, it is how long each was ready and not running,
which no CPU figure shows. The link's bytes are the interface counters under
``/sys/class/net`` of every interface but ``lo``: inside an emulated host (``ip netns exec``
mounts that namespace's ``/sys``) that is the host's one link. This module needs no cluster
(the tests call it directly); of asyncreduce it takes only the progress thread's name.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from asyncreduce.engine import THREAD_PREFIX

__all__ = [
    "ENGINE_PREFIX",
    "NET",
    "USAGE_FIELDS",
    "Usage",
    "engine_native_ids",
    "interface_bytes",
    "link_bytes",
    "thread_cpu_s",
    "thread_ticks_s",
    "thread_waited_s",
    "window",
]

ENGINE_PREFIX = THREAD_PREFIX  # asyncreduce.engine names its progress thread so
NET = Path("/sys/class/net")
USAGE_FIELDS = (  # what ``window`` returns, in this order
    "train_cpu_s",
    "progress_cpu_s",
    "other_cpu_s",
    "process_cpu_s",
    "train_waited_s",
    "progress_waited_s",
    "tx_bytes",
    "rx_bytes",
    "window_s",
)


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) that thread ``native_id`` of this process has used so far.

    ``schedstat``'s first field is the scheduler's run time in ns, the counter that
    ``time.thread_time`` reads for the calling thread; where the kernel has no schedstat,
    ``thread_ticks_s``. 0.0 for a thread that has exited (its time is in the process's)."""
    ran = _schedstat_s(native_id, 0)
    return thread_ticks_s(native_id) if ran is None else ran  # (0.0 too once it exited)


def thread_waited_s(native_id: int) -> float:
    """Seconds thread ``native_id`` of this process has spent runnable but not running,
    waiting for a core (``schedstat``'s second field), so far; NaN where the kernel keeps no
    schedstat, 0.0 for a thread that has exited."""
    waited = _schedstat_s(native_id, 1)
    if waited is None:
        return math.nan if Path(f"/proc/self/task/{native_id}").exists() else 0.0
    return waited


def _schedstat_s(native_id: int, field: int) -> float | None:
    """Field ``field`` of thread ``native_id``'s ``schedstat`` (nanoseconds), in seconds;
    None where it cannot be read (no schedstat, or the thread is gone)."""
    try:
        text = Path(f"/proc/self/task/{native_id}/schedstat").read_text()
        return int(text.split()[field]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def thread_ticks_s(native_id: int) -> float:
    """The same from ``stat``'s utime + stime, whole clock ticks (``SC_CLK_TCK``, usually
    10 ms each): coarser, and sampled at the tick, but in every kernel. 0.0 once it exited."""
    try:
        text = Path(f"/proc/self/task/{native_id}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    # fields[0] is field 3 (state), so utime (field 14) and stime (15) are fields[11] and [12]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_native_ids() -> list[int]:
    """Kernel thread ids of the live asyncreduce progress threads of this process."""
    return [
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith(ENGINE_PREFIX) and t.native_id is not None
    ]


def interface_bytes(name: str, net: Path = NET) -> tuple[int, int]:
    """(tx, rx) bytes interface ``name`` has sent and received since it came up."""
    stats = net / name / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def link_bytes(net: Path = NET) -> tuple[int, int]:
    """(tx, rx) bytes of every interface but ``lo`` together: in an emulated host, its link."""
    tx = rx = 0
    for entry in sorted(net.iterdir()) if net.is_dir() else []:
        if entry.name != "lo":
            sent, received = interface_bytes(entry.name, net)
            tx, rx = tx + sent, rx + received
    return tx, rx


@dataclass(frozen=True)
class Usage:
    """One snapshot of the calling thread's, the progress threads' and the process's CPU
    seconds, and of the link's bytes; ``now`` must be called on the training thread."""

    train_cpu_s: float
    progress_cpu_s: dict[int, float]  # per progress thread (native id)
    process_cpu_s: float
    train_waited_s: float  # runnable, waiting for a core (NaN: not known here)
    progress_waited_s: dict[int, float]
    tx_bytes: int
    rx_bytes: int
    at_s: float  # time.perf_counter()

    @classmethod
    def now(cls) -> Usage:
        tx, rx = link_bytes()
        engines = engine_native_ids()
        return cls(
            train_cpu_s=time.thread_time(),
            progress_cpu_s={tid: thread_cpu_s(tid) for tid in engines},
            process_cpu_s=time.process_time(),
            train_waited_s=thread_waited_s(threading.get_native_id()),
            progress_waited_s={tid: thread_waited_s(tid) for tid in engines},
            tx_bytes=tx,
            rx_bytes=rx,
            at_s=time.perf_counter(),
        )


def _grown(before: dict[int, float], after: dict[int, float]) -> float:
    """How much the threads alive at both snapshots added up."""
    return sum(after[tid] - before[tid] for tid in before.keys() & after.keys())


def window(before: Usage, after: Usage) -> dict[str, float]:
    """The totals between two snapshots: CPU seconds of the training thread, the progress
    threads (those alive at both ends), the other threads (the process's less those two, not
    below 0: the snapshots read the process last) and the process; the seconds the training
    and the progress threads waited for a core; link bytes each way and the
    window's length in seconds: ``USAGE_FIELDS``."""
    train = after.train_cpu_s - before.train_cpu_s
    progress = _grown(before.progress_cpu_s, after.progress_cpu_s)
    process = after.process_cpu_s - before.process_cpu_s
    return {
        "train_cpu_s": train,
        "progress_cpu_s": progress,
        "other_cpu_s": max(0.0, process - train - progress),
        "process_cpu_s": process,
        "train_waited_s": after.train_waited_s - before.train_waited_s,
        "progress_waited_s": _grown(before.progress_waited_s, after.progress_waited_s),
        "tx_bytes": float(after.tx_bytes - before.tx_bytes),
        "rx_bytes": float(after.rx_bytes - before.rx_bytes),
        "window_s": after.at_s - before.at_s,
    }
