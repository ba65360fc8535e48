"""Nothing named in /dev/shm outlives its creator: a rank killed while it sets up shared memory
(a window, the lane's mailbox, an arena) leaves no file behind.

Launchers kill the other ranks (SIGTERM, or SIGKILL) when one fails, and those are often the
ranks waiting for the failed one in exactly these collective steps, before they could unlink
what they made. Each test kills a rank while it waits there and then looks in /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

import asyncreduce as ar
from spmd import free_port, shm_files

_CTX = mp.get_context("spawn")


def _memfds(pid: int) -> list[str]:
    """The anonymous shared-memory files ``pid`` holds open (see samehost/shm.py)."""
    found = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/memfd:asyncreduce"):
                found.append(target)
    except OSError:
        pass
    return found


def _wait_until_made(pid: int, seconds: float = 20.0) -> None:
    """Until ``pid`` has made its segment (a file in /dev/shm, or an anonymous one)."""
    deadline = time.monotonic() + seconds
    while not shm_files(pid) and not _memfds(pid):
        assert time.monotonic() < deadline, "the rank never made its shared memory"
        time.sleep(0.02)


def _kill(proc: Any, how: signal.Signals) -> None:
    os.kill(proc.pid, how)
    proc.join(10)
    assert proc.exitcode == -how, proc.exitcode


def _clean(pid: int) -> list[str]:
    """What ``pid`` left in /dev/shm; removed, so a failing run leaves nothing either."""
    left = shm_files(pid)
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    return left


def _window_rank(rank: int, port: int, out: Any) -> None:
    with ar.init(rank, 2, "127.0.0.1", port, timeout=30) as comm:
        out.put(rank)
        if rank == 0:  # waits for rank 1, which never makes the window, until it is killed
            comm.shared_empty(1 << 18, timeout=60)
        time.sleep(60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_rank_killed_while_it_waits_in_shared_empty_leaves_nothing_in_dev_shm(
    how: signal.Signals,
) -> None:
    port, out = free_port(), _CTX.Queue()
    ranks = [_CTX.Process(target=_window_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in ranks:
        p.start()
    victim = ranks[0]
    try:
        assert sorted([out.get(timeout=40), out.get(timeout=40)]) == [0, 1]
        _wait_until_made(victim.pid)
        named = shm_files(victim.pid)  # what rank 0 made for the window, by name
        _kill(victim, how)
        left = _clean(victim.pid)
        assert not left, f"rank 0 was killed ({how.name}) in shared_empty and left {left}"
        assert not named, f"a window was named in /dev/shm while it was made: {named}"
    finally:
        _clean(victim.pid)
        for p in ranks:
            p.kill()
            p.join()


def _arena_rank(port: int, out: Any) -> None:
    """Rank 0 of 2 in the arena step: rank 1 is on this host but never comes (it exited)."""
    from asyncreduce.bootstrap.samehost import identity, share_memory
    from asyncreduce.rendezvous import TCPStore

    store = TCPStore("127.0.0.1", port, is_server=False, timeout=30, secret=None)
    out.put(os.getpid())
    me = identity()
    share_memory(store, 0, 2, [me, me], time.monotonic() + 60)


@pytest.mark.timeout(60)
def test_a_rank_killed_while_it_waits_in_the_arena_step_leaves_nothing_in_dev_shm() -> None:
    from asyncreduce.rendezvous import TCPStore

    out = _CTX.Queue()
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=30, secret=None) as store:
        victim = _CTX.Process(target=_arena_rank, args=(store.port, out), daemon=True)
        victim.start()
        try:
            assert out.get(timeout=40) == victim.pid
            store.get("shm/0/1", timeout=20)  # its arena for rank 1 is made and announced
            named = shm_files(victim.pid)
            _kill(victim, signal.SIGTERM)
            left = _clean(victim.pid)
            assert not left, f"rank 0 was killed (SIGTERM) in share_memory and left {left}"
            assert not named, f"an arena was named in /dev/shm while it was made: {named}"
        finally:
            _clean(victim.pid)
            victim.kill()
            victim.join()
