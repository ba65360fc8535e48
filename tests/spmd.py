"""Run one test body on several real processes that talk over real sockets.

``run_ranks(n, body, *args)`` spawns n processes; each joins a communicator through the TCP
store on 127.0.0.1 and calls ``body(comm, *args)``. The bodies' return values come back in
rank order; an exception on any rank fails the test with that rank's traceback; a rank that
does not finish within ``timeout`` seconds fails the test (a hang never stalls the suite).
``expect_dead`` names ranks that are allowed to die without reporting (fault injection).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar

_CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    n: int,
    port: int,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    env: dict[str, str],
    connect: bool = True,
) -> None:
    os.environ["ASYNCREDUCE_TEST_RANK"] = str(rank)
    os.environ.update(env)
    try:
        if connect and env.get("ASYNCREDUCE_TEST_BACKEND") == "torch":
            result = _over_torch(rank, n, port, body, args)
        elif connect:
            with ar.init(rank, n, "127.0.0.1", port, timeout=30) as comm:
                result = body(comm, *args)
        else:
            result = body(rank, n, port, *args)
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _over_torch(rank: int, n: int, port: int, body: Callable[..., Any], args: tuple) -> Any:
    """``body`` on a communicator over a torch.distributed Gloo job (backend="torch")."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        with ar.init(backend="torch", timeout=30) as comm:
            return body(comm, *args)
    finally:
        dist.destroy_process_group()


def mpi_available() -> bool:
    import importlib.util
    import shutil

    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def _run_under_mpirun(
    n: int, body: Callable[..., Any], args: tuple[Any, ...], timeout: float,
    env: dict[str, str], expect_dead: frozenset[int],
) -> dict[int, Any]:  # fmt: skip
    """``body`` on n ranks started by a real mpirun, each over ar.init(backend="mpi")."""
    import pickle  # (test harness only: files between this process and its children)
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "job"), "wb") as f:
            pickle.dump((body, args), f)
        cmd = ["mpirun", "-n", str(n), "--allow-run-as-root", "--oversubscribe",
               "--mca", "btl_tcp_if_include", "lo", sys.executable,
               os.path.join(os.path.dirname(__file__), "mpi_rank.py"), tmp]  # fmt: skip
        full_env = {**os.environ, **env, "ASYNCREDUCE_BACKEND": "mpi",
                    "PYTHONPATH": os.path.dirname(__file__)}  # fmt: skip
        try:
            done = subprocess.run(cmd, env=full_env, timeout=timeout, capture_output=True,
                                  text=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise AssertionError(f"mpirun did not finish within {timeout} s") from None
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for r in range(n):
            path = os.path.join(tmp, f"out.{r}")
            if not os.path.exists(path):
                if r not in expect_dead:
                    errors[r] = f"no result (mpirun said {done.returncode}):\n{done.stderr[-3000:]}"
                continue
            with open(path, "rb") as f:
                ok, value = pickle.load(f)
            (results if ok else errors)[r] = value
    if errors:
        raise AssertionError(
            "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    return results


def run_ranks(
    n: int,
    body: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    expect_dead: frozenset[int] = frozenset(),
    ranks: range | None = None,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    daemon: bool = True,
    connect: bool = True,
    backend: str = "native",
) -> dict[int, Any]:
    """Run ``body`` on ranks 0..n-1 (or only ``ranks``); return {rank: result}.

    ``env`` is set in every rank before it joins (e.g. ASYNCREDUCE_SHM=0 for TCP only), then
    ``rank_env[rank]`` in that rank only. ``daemon=False`` lets ranks start processes of
    their own (multiprocessing refuses that to daemons); they are killed at the deadline
    either way. ``connect=False``: no communicator is made; ``body(rank, n, port, *args)``
    joins however it likes (``port`` is free for its store). ``backend``: "native", "torch"
    (a Gloo job, then ar.init(backend="torch")) or "mpi" (a real mpirun, backend="mpi")."""
    if backend == "mpi":
        return _run_under_mpirun(n, body, args, timeout, env or {}, expect_dead)
    if backend == "torch":
        env = {**(env or {}), "ASYNCREDUCE_TEST_BACKEND": "torch"}
    port = free_port()
    out = _CTX.Queue()
    started = ranks if ranks is not None else range(n)
    procs = {
        r: _CTX.Process(
            target=_rank_main,
            args=(r, n, port, body, args, out, {**(env or {}), **(rank_env or {}).get(r, {})},
                  connect),
            daemon=daemon,
        )
        for r in started
    }
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + timeout
    try:
        results, errors = collect(procs, out, timeout, expect_dead)
    except BaseException:
        deadline = 0.0  # a rank died or did not finish: the others are not waited for
        raise
    finally:
        for p in procs.values():
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
    if errors:
        raise AssertionError(
            "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    return results


def collect(
    procs: dict[int, Any], out: Any, timeout: float, expect_dead: frozenset[int] = frozenset()
) -> tuple[dict[int, Any], dict[int, str]]:
    """What the ranks of ``procs`` (rank -> started process) put on ``out`` as ``(rank, ok,
    value)``, as (results, errors) by rank, once every rank not in ``expect_dead`` has put
    one. Fails at once, naming the rank and its exit code, when one of them has exited without
    putting its own (a crash, a signal, an error outside the body) rather than waiting out
    ``timeout`` for it; fails after ``timeout`` seconds if one has not finished by then."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    wanted = set(procs) - expect_dead
    deadline = time.monotonic() + timeout
    while wanted - set(results) - set(errors):
        left = deadline - time.monotonic()
        try:
            rank, ok, value = out.get(timeout=max(0.01, min(0.2, left)))
        except queue.Empty:
            _check_alive(procs, out, results, errors, wanted)
            if time.monotonic() >= deadline:
                missing = sorted(wanted - set(results) - set(errors))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s") from None
            continue
        (results if ok else errors)[rank] = value
    return results, errors


def _check_alive(
    procs: dict[int, Any], out: Any, results: dict[int, Any], errors: dict[int, str],
    wanted: set[int],
) -> None:  # fmt: skip
    """AssertionError for a rank of ``wanted`` that exited without a result; what its queue
    still holds is read first (a rank's put reaches the pipe before its process exits)."""
    dead = {r: procs[r].exitcode for r in wanted - set(results) - set(errors)
            if procs[r].exitcode is not None}  # fmt: skip
    if not dead:
        return
    try:
        while True:
            rank, ok, value = out.get(timeout=0.1)
            (results if ok else errors)[rank] = value
    except queue.Empty:
        pass
    lost = {r: code for r, code in dead.items() if r not in results and r not in errors}
    if lost:
        rank, code = min(lost.items())
        others = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"rank {rank} died (exit code {code}) without a result; "
                             f"ranks {sorted(results)} reported one{others}")  # fmt: skip


def shuffled_in_threads(
    rank: int, ops: int, threads: int, work: Callable[[list[int]], None]
) -> None:
    """Call ``work`` on ``threads`` threads, each with its share of 0..ops-1 in an order
    shuffled per rank (so ranks post named operations in different orders); the first error
    of any thread is raised here."""
    order = list(range(ops))
    random.Random(1000 + rank).shuffle(order)
    in_threads(*(functools.partial(work, order[t::threads]) for t in range(threads)))


def in_threads(*calls: Callable[[], object]) -> None:
    """Run each call on a thread of its own, all at once; the first error of any is raised
    here once all have ended."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def survive_the_death_of_rank_2(comm: ar.Communicator, x: Any, delay: float) -> str:
    """Rank 2 SIGKILLs itself ``delay`` seconds into an allreduce of ``x``; every other rank
    allreduces ``x`` until that fails, within 10 s, and returns the BrokenError's message."""
    comm.barrier()
    if comm.rank == 2:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        comm.allreduce(x)
        time.sleep(30)
    start = time.monotonic()
    try:
        for _ in range(100):
            comm.allreduce(x)
    except ar.BrokenError as exc:
        assert time.monotonic() - start < 10, time.monotonic() - start
        return str(exc)
    raise AssertionError("100 allreduces went through without rank 2")


def shm_files(pid: int | None = None) -> list[str]:
    """asyncreduce's files in /dev/shm (of process ``pid`` only, if given): none may be left."""
    prefix = "asyncreduce-" if pid is None else f"asyncreduce-{pid}-"
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def shm_segments() -> list[str]:
    """The shared memory this process still holds: files in /dev/shm, and the anonymous
    segments (memfd) it maps or keeps open, where a leak shows now that segments are unnamed."""
    return shm_files() + sorted(_memfd_segments(os.getpid()))


def _memfd_segments(pid: int) -> set[str]:
    """The asyncreduce memfd segments process ``pid`` maps or holds a descriptor of."""
    mark, held = "/memfd:asyncreduce-", set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        held |= {" ".join(line.split()[4:]) for line in maps if mark in line}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                held |= {target} if target.startswith(mark) else set()
    return held


def window_against_ordinary(comm: ar.Communicator, count: int) -> str:
    """Rank 0 allreduces ``count`` float32 in a shared window, the others an ordinary array:
    every rank must fail it (MismatchError, or BrokenError caused by one); returns the root
    cause's message."""
    window = comm.shared_empty(count, np.float32)  # collective: every rank makes one
    x = window if comm.rank == 0 else np.empty(count, np.float32)
    x[:] = 1
    with pytest.raises((ar.MismatchError, ar.BrokenError)) as info:
        comm.allreduce(x, name="w", timeout=20)
    error = info.value
    while isinstance(error, ar.BrokenError) and error.__cause__ is not None:
        error = error.__cause__
    return str(error)


def _cross_memory_on(comm: ar.Communicator) -> bool:
    return comm.data_plane.cross_memory


@functools.cache
def cross_memory_permitted() -> bool:
    """Whether ranks here may read each other's memory (process_vm_readv between sibling
    processes: no Yama ptrace_scope 1+, or CAP_SYS_PTRACE); asked once, of a real job."""
    return all(run_ranks(2, _cross_memory_on).values())
