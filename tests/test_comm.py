"""Collectives across real processes over real TCP sockets (see spmd.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from spmd import (
    cross_memory_permitted,
    run_ranks,
    shm_files,
    shuffled_in_threads,
    survive_the_death_of_rank_2,
)

WORLDS = [2, 3, 4]


def _expected_sum(n: int, count: int, dtype: type, base: int = 0) -> np.ndarray:
    return sum(np.arange(count, dtype=dtype) * (r + 1) + base + r for r in range(n))


# ---- every collective, every world size ---------------------------------------------------------


def body_collectives(comm: ar.Communicator) -> dict[str, bytes]:
    r, n = comm.rank, comm.world_size
    digests = {}
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
        for count in (0, 1, 13, 5000, 300_001):
            if dtype in (np.float16, np.uint8) and count > 13:
                continue  # keep sums exact and small
            x = np.arange(count, dtype=dtype) * (r + 1) + r
            y = comm.allreduce(x, name=f"sum-{np.dtype(dtype).name}-{count}")
            assert y is x
            np.testing.assert_array_equal(x, _expected_sum(n, count, dtype).astype(dtype))
            digests[f"{np.dtype(dtype).name}-{count}"] = hashlib.sha256(x.tobytes()).digest()
    for op, fold in (("max", np.maximum), ("min", np.minimum), ("prod", np.multiply)):
        x = np.array([r + 1.0, -(r + 1.0), 2.0, float(n - r)], dtype=np.float64)
        others = [np.array([q + 1.0, -(q + 1.0), 2.0, float(n - q)]) for q in range(n)]
        expect = others[0]
        for o in others[1:]:
            expect = fold(expect, o)
        np.testing.assert_array_equal(comm.allreduce(x, op), expect)
    avg = comm.allreduce(np.full(100_000, float(r), np.float32), "avg")
    assert np.all(avg == np.float32(sum(range(n)) / n))
    for root in range(n):
        b = comm.broadcast(np.full(70_000, r, np.int64), root=root)
        assert np.all(b == root)
    g = comm.allgather(np.array([[r, 10 * r]], dtype=np.int32))
    assert g.shape == (n, 1, 2)
    np.testing.assert_array_equal(g[:, 0, 1], np.arange(n) * 10)
    x = np.arange(n * 6, dtype=np.float64).reshape(n * 3, 2) + r
    rs = comm.reduce_scatter(x)
    full = sum(np.arange(n * 6, dtype=np.float64).reshape(n * 3, 2) + q for q in range(n))
    np.testing.assert_array_equal(rs, full[r * 3 : (r + 1) * 3])
    comm.barrier()
    return digests


# Every engine test below runs on each data plane: "cma" (the default on one host: arenas,
# and large allreduces read the peers' buffers by cross-memory attach), "shm" (arenas only:
# the ring), "tcp" (no shared memory at all).
TRANSPORTS = {
    "cma": {"ASYNCREDUCE_SHM": "1"},
    "shm": {"ASYNCREDUCE_SHM": "1", "ASYNCREDUCE_CMA": "0"},
    "tcp": {"ASYNCREDUCE_SHM": "0"},
}


def body_transport_in_use(comm: ar.Communicator) -> tuple[list[bool], bool]:
    peers = comm._engine.transport._peers  # type: ignore[union-attr]
    shared = [peers[p].arena_out is not None for p in sorted(peers)]
    comm.barrier()  # nobody closes (and drops its connections) before every rank has looked
    return shared, comm._cross is not None


def body_nodelay(comm: ar.Communicator) -> list[int]:
    peers = comm._engine.transport._peers  # type: ignore[union-attr]
    flags = [
        peers[p].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for p in sorted(peers)
    ]
    comm.barrier()
    return flags


def test_every_data_connection_sends_without_delay() -> None:
    """Dialled and accepted sides alike set TCP_NODELAY. A regression left the accepted side
    Nagled: a small frame behind an unacknowledged one waited for the peer's delayed ACK
    (40 ms), so allreduces took 45 ms now and then."""
    results = run_ranks(3, body_nodelay)
    assert all(all(flags) for flags in results.values()), results


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_ranks_on_one_host_share_memory_unless_told_not_to(transport: str) -> None:
    results = run_ranks(3, body_transport_in_use, env=TRANSPORTS[transport])
    want = ([transport != "tcp"] * 2, transport == "cma" and cross_memory_permitted())
    assert all(r == want for r in results.values()), results


def body_data_plane(comm: ar.Communicator) -> tuple[str, bool, bool, bool]:
    plane = comm.data_plane
    comm.barrier()
    return plane.engine, plane.shared_memory, plane.cross_memory, plane.windows


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_data_plane_says_which_memory_the_operations_use(transport: str) -> None:
    results = run_ranks(2, body_data_plane, env=TRANSPORTS[transport])
    cross = transport == "cma" and cross_memory_permitted()
    want = ("native", transport != "tcp", cross, transport != "tcp")
    assert all(r == want for r in results.values()), results


def test_a_world_of_one_has_no_data_plane_to_speak_of() -> None:
    with ar.Communicator(0, 1, None) as comm:
        plane = comm.data_plane
    assert (plane.engine, plane.shared_memory, plane.cross_memory, plane.windows) == (
        "local", False, False, False
    )


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", WORLDS)
def test_collectives_are_exact_and_identical_on_every_rank(n: int, transport: str) -> None:
    results = run_ranks(n, body_collectives, env=TRANSPORTS[transport])
    assert all(results[r] == results[0] for r in range(n))


def _sockets() -> int:
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return sum(os.readlink(fd).startswith("socket:") for fd in fds if os.path.exists(fd))


def exchange_checks(comm: ar.Communicator) -> None:
    """reduce (every root), gather, scatter, alltoall and tagged point-to-point around a
    ring, each checked against what it must give (the ordered backends run it too)."""
    r, n = comm.rank, comm.world_size
    for root in range(n):
        for op, fold in (("sum", np.add), ("max", np.maximum), ("prod", np.multiply)):
            x = np.array([r + 1.0, -(r + 2.0)])
            mine = x.copy()
            comm.reduce(x, op, root)
            want = mine if r != root else fold.reduce([np.array([q + 1.0, -(q + 2.0)])
                                                       for q in range(n)])  # fmt: skip
            np.testing.assert_array_equal(x, want)
        big = np.arange(3 << 18, dtype=np.int64) + r  # 6 MiB: several segments each way
        g = comm.gather(big, root=root)
        if r == root:
            assert g.shape == (n, big.size)
            assert all(np.array_equal(g[q], big - r + q) for q in range(n))
        else:
            assert g is None
        out = np.zeros(5, np.float32)
        source = np.arange(n * 5, dtype=np.float32).reshape(n, 5) if r == root else None
        comm.scatter(out, source, root=root)
        np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32) + 5 * r)
    a = np.repeat(np.arange(n) + 100 * r, 1 << 16).astype(np.float32)
    got = comm.alltoall(a).reshape(n, -1)
    assert all(np.all(got[q] == r + 100 * q) for q in range(n))
    # point-to-point around a ring: two tags, posted interleaved, received tag 1 first
    right, left = (r + 1) % n, (r - 1) % n
    sends = [comm.isend(np.full(4, 10 * i + t + r, np.int32), right, tag=t)
             for i in range(3) for t in (0, 1)]  # fmt: skip
    got_t = {t: [comm.recv(np.zeros(4, np.int32), left, tag=t)[0] for _ in range(3)]
             for t in (1, 0)}  # fmt: skip
    ar.wait_all(sends, timeout=30)
    assert got_t == {t: [10 * i + t + left for i in range(3)] for t in (1, 0)}, got_t


def body_exchanges(comm: ar.Communicator) -> dict[str, object]:
    """reduce, gather, scatter, alltoall, send/recv with tags, every dtype, and groups."""
    r, n = comm.rank, comm.world_size
    exchange_checks(comm)
    # the dtypes torch reduces
    flags = comm.allreduce(np.array([r == 0, True, False]), "sum")
    np.testing.assert_array_equal(flags, [True, True, False])
    assert comm.allreduce(np.array([r == 0, True]), "prod").tolist() == [n == 1, True]
    bits = comm.allreduce(np.array([1 << r, 7], np.int8), "bor")
    assert bits.tolist() == [(1 << n) - 1, 7]
    assert comm.allreduce(np.array([r + 1], np.int16), "bxor")[0] == np.bitwise_xor.reduce(
        np.arange(1, n + 1))
    z = comm.allreduce(np.full(3, (r + 1) * (1 - 2j), np.complex128), "avg")
    assert np.all(z == (n + 1) / 2 * (1 - 2j))
    # groups: no new sockets, their own numbering, keys apart from the world's
    before = _sockets()
    groups = [comm.group(members) for members in ([*range(n)][::-1], [*range(n)]) * 4]
    evens = [q for q in range(n) if q % 2 == 0]
    sub = comm.group(evens) if r in evens else None
    assert _sockets() == before, "groups opened sockets"
    for g_ in groups:
        x = np.full(3, float(g_.rank))
        g_.allreduce(x, name="same-name")
        assert np.all(x == sum(range(n)))
    comm.allreduce(np.ones(2), name="same-name")  # the world's own key of that name
    if sub is not None:
        y = np.full(2, float(r))
        sub.allreduce(y)
        assert np.all(y == sum(evens)) and sub.world_size == len(evens)
        nested = sub.group([sub.rank])
        assert nested.allreduce(np.full(1, 5.0))[0] == 5.0 and nested.world_size == 1
    ranks_seen = [g_.rank for g_ in groups[:2]]
    for g_ in groups:
        g_.close()
    comm.barrier()
    return {"group_ranks": ranks_seen}


@pytest.mark.parametrize(("n", "transport"), [(2, "cma"), (3, "cma"), (4, "cma"), (3, "shm"),
                                              (3, "tcp")])  # fmt: skip
def test_reduce_gather_scatter_alltoall_p2p_dtypes_and_groups(n: int, transport: str) -> None:
    results = run_ranks(n, body_exchanges, env=TRANSPORTS[transport], timeout=90)
    assert [results[r]["group_ranks"] for r in range(n)] == [[n - 1 - r, r] for r in range(n)]


def body_mismatched_p2p(comm: ar.Communicator) -> str:
    """Rank 0 sends 5 floats, rank 1 expects 4. The receive fails with MismatchError; the
    send may complete first (a send is done once sent, as in MPI), but the communicator of
    both breaks, so the sender's next operation fails, caused by the same MismatchError."""
    try:
        if comm.rank == 0:
            comm.send(np.ones(5, np.float32), 1, timeout=20)
            comm.barrier(name="after", timeout=20)  # rank 1 never joins: it broke
        else:
            comm.recv(np.zeros(4, np.float32), 0, timeout=20)
    except (ar.MismatchError, ar.BrokenError) as exc:
        cause = exc.__cause__ if isinstance(exc, ar.BrokenError) and exc.__cause__ else exc
        return type(cause).__name__
    return "no error"


def test_a_send_and_recv_of_different_sizes_break_both_ranks() -> None:
    results = run_ranks(2, body_mismatched_p2p, timeout=60)
    assert results == {0: "MismatchError", 1: "MismatchError"}


# ---- threads, shuffled named operations ---------------------------------------------------------


def body_threads(comm: ar.Communicator, ops: int, threads: int) -> dict[int, str]:
    r, n = comm.rank, comm.world_size
    sizes = [random.Random(i).choice([1, 7, 1000, 20_000, 150_000, 600_000]) for i in range(ops)]
    results: dict[int, str] = {}

    def work(mine: list[int]) -> None:
        reqs = []
        for i in mine:
            x = np.arange(sizes[i], dtype=np.float64) * (r + 1) + i
            reqs.append((i, x, comm.iallreduce(x, name=f"op{i}", priority=i % 3)))
        for i, x, req in reqs:
            assert req.wait(timeout=60) is x
            expect = sum(np.arange(sizes[i], dtype=np.float64) * (q + 1) + i for q in range(n))
            np.testing.assert_array_equal(x, expect)
            results[i] = hashlib.sha256(x.tobytes()).hexdigest()

    shuffled_in_threads(r, ops, threads, work)
    assert sorted(results) == list(range(ops))
    return results


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", WORLDS)
def test_eight_threads_post_100_named_operations_in_shuffled_orders(n: int, transport: str) -> None:
    results = run_ranks(n, body_threads, 100, 8, timeout=120, env=TRANSPORTS[transport])
    for r in range(1, n):
        assert results[r] == results[0], "results differ between ranks"


# ---- one connection per pair --------------------------------------------------------------------


def _tcp_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def body_socket_count(comm: ar.Communicator) -> tuple[int, int]:
    before = _tcp_sockets()
    reqs = [comm.iallreduce(np.ones(50_000, np.float32), name=f"s{i}") for i in range(64)]
    during = _tcp_sockets()
    ar.wait_all(reqs, timeout=60)
    assert all(np.all(r.result() == comm.world_size) for r in reqs)
    return before, during


def test_operations_in_flight_share_one_connection_per_peer() -> None:
    results = run_ranks(3, body_socket_count)
    for before, during in results.values():
        assert during == before


# ---- mismatches ---------------------------------------------------------------------------------


def body_mismatch(comm: ar.Communicator, field: str) -> str:
    r = comm.rank
    count, dtype = 1000, np.float32
    if r == 1 and field == "count":
        count = 1200
    if r == 1 and field == "dtype":
        dtype = np.float64
    op = "max" if (field == "op" and r == 2) else "sum"
    start = time.monotonic()
    # a rank that posts after the others found the mismatch is already broken by it
    with pytest.raises((ar.MismatchError, ar.BrokenError)):
        comm.allreduce(np.ones(count, dtype), op, name="w", timeout=20)
    assert time.monotonic() - start < 5
    with pytest.raises(ar.BrokenError) as later:  # failure is sticky: the cause is chained
        comm.allreduce(np.ones(10, np.float32), name="after")
    assert isinstance(later.value.__cause__, ar.MismatchError), repr(later.value.__cause__)
    return str(later.value.__cause__)


@pytest.mark.parametrize(("field", "both"), [
    ("count", ("float32[1000]", "float32[1200]")),
    ("dtype", ("float32[1000]", "float64[1000]")),
    ("op", ("sum", "max")),
])  # fmt: skip
def test_mismatch_fails_on_every_rank_naming_both_sides(field: str, both: tuple[str, str]) -> None:
    messages = run_ranks(3, body_mismatch, field)
    for rank, message in messages.items():
        assert all(side in message for side in both), f"rank {rank}: {message}"
        assert "'w'" in message


# ---- a rank dies --------------------------------------------------------------------------------


def body_victim(comm: ar.Communicator) -> str:
    message = survive_the_death_of_rank_2(comm, np.ones(16 << 20, np.float32), 0.05)
    with pytest.raises(ar.BrokenError):
        comm.allreduce(np.ones(4, np.float32))  # the communicator stays broken
    return message


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_killed_rank_is_named_by_both_survivors(transport: str) -> None:
    messages = run_ranks(3, body_victim, expect_dead=frozenset({2}), env=TRANSPORTS[transport])
    assert set(messages) == {0, 1}
    for message in messages.values():
        assert "rank 2" in message
    assert not shm_files()


# ---- a rank never joins -------------------------------------------------------------------------


def body_never_reached(comm: ar.Communicator) -> None:  # pragma: no cover - init must fail first
    raise AssertionError("init should not have succeeded")


def _init_alone(rank: int, port: int) -> str:
    start = time.monotonic()
    try:
        ar.init(rank, 3, "127.0.0.1", port, timeout=3)
    except TimeoutError as exc:
        elapsed = time.monotonic() - start
        assert elapsed < 8, elapsed
        return str(exc)
    raise AssertionError("init did not time out")


def test_init_names_the_rank_that_never_joined() -> None:
    from spmd import free_port

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        messages = list(pool.map(_init_alone, [0, 1], [port, port]))
    for message in messages:
        assert "rank 2 never joined (world_size=3)" in message, message


# ---- close() with requests pending --------------------------------------------------------------


def body_close_pending(comm: ar.Communicator) -> tuple[int, int]:
    if comm.rank == 1:
        comm.barrier(name="first")
        time.sleep(1.0)  # stay until rank 0 has closed
        return 0, 0
    comm.barrier(name="first")
    reqs = [comm.iallreduce(np.ones(1000, np.float32), name=f"never{i}") for i in range(5)]
    time.sleep(0.2)
    comm.close()
    for req in reqs:
        with pytest.raises(ar.ClosedError, match="closed"):
            req.wait(timeout=5)
    with pytest.raises(ar.ClosedError):
        comm.iallreduce(np.ones(3, np.float32))
    leftover_threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncreduce")]
    assert leftover_threads == []
    return _tcp_sockets(), len(reqs)


def test_close_fails_pending_requests_and_leaves_no_thread_or_socket() -> None:
    results = run_ranks(2, body_close_pending)
    sockets_left, failed = results[0]
    assert failed == 5
    assert sockets_left == 0


def body_broadcast_after_a_goodbye(comm: ar.Communicator) -> list[float]:
    """Rank 0 takes its part in rank 2's broadcast and closes; rank 1 posts the broadcast
    only after rank 0's goodbye (DDP's Join: the first to finish leaves first)."""
    model = np.arange(4, dtype=np.float32) + 1 if comm.rank == 2 else np.zeros(4, np.float32)
    if comm.rank == 1:
        time.sleep(1.5)
    comm.broadcast(model, root=2, timeout=20)
    if comm.rank == 0:
        comm.close()
    elif comm.rank == 1:
        with pytest.raises(ar.BrokenError, match="had data for rank 0, but rank 0 has closed"):
            comm.isend(np.ones(2, np.float32), dst=0, timeout=20).wait(20)
        with pytest.raises(ar.BrokenError, match="rank 0 has closed"):  # (and it broke the job)
            comm.broadcast(np.zeros(4, np.float32), root=0, timeout=20)  # rank 0 never posted it
    return model.tolist()


def test_a_broadcast_posted_after_a_rank_closed_completes_on_what_it_sent() -> None:
    results = run_ranks(3, body_broadcast_after_a_goodbye, timeout=60)
    assert all(results[r] == [1.0, 2.0, 3.0, 4.0] for r in range(3)), results


# ---- per-call timeout ---------------------------------------------------------------------------


def body_timeout(comm: ar.Communicator) -> str:
    if comm.rank == 0:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            comm.allreduce(np.ones(5, np.float32), name="lonely", timeout=0.5)
        assert 0.45 < time.monotonic() - start < 3
        return str(info.value)
    time.sleep(2.0)  # rank 0 timed out meanwhile and told this rank: it is broken too
    with pytest.raises(ar.BrokenError) as broken:
        comm.allreduce(np.ones(5, np.float32), name="lonely", timeout=10)
    assert isinstance(broken.value.__cause__, TimeoutError), repr(broken.value.__cause__)
    return str(broken.value.__cause__)


def test_per_call_timeout_fails_the_operation_on_every_rank() -> None:
    check_timeout(run_ranks(2, body_timeout))


def check_timeout(messages: dict[int, str]) -> None:
    """What body_timeout must see (test_engines checks it over every backend too)."""
    assert "0.5 s" in messages[0] and "rank 1" in messages[0]
    assert "reported by rank 0" in messages[1]


# ---- requests are futures -----------------------------------------------------------------------


def _outcome(call: Callable[..., object], *args: object) -> str:
    """What ``call(*args)`` did, for the test to see: "returned", or "<error type>: <message>"."""
    try:
        call(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def body_request_api(comm: ar.Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if comm.rank == 1:
        time.sleep(0.3)
    x = np.ones(10, np.float32)
    req = comm.iallreduce(x, name="late")
    if comm.rank == 0:  # rank 1 posts 0.3 s later: not done yet
        out["test_before"] = req.test()
        out["short_wait"] = _outcome(lambda: req.wait(timeout=0.05))
        out["cancel"] = req.cancel()
    seen: list[str] = []
    ready = threading.Event()
    req.add_done_callback(lambda f: (seen.append(threading.current_thread().name), ready.set()))
    out["wait_returns_the_buffer"] = req.wait(timeout=10) is x
    out["test_after"] = req.test()
    out["callback_ran"] = ready.wait(5)
    out["callback_thread"] = seen[0] if seen else ""
    reqs = [comm.iallreduce(np.full(3, float(i)), name=f"f{i}") for i in range(5)]
    out["as_completed"] = sorted(
        float(f.result()[0]) for f in concurrent.futures.as_completed(reqs, timeout=10)
    )
    index, value = ar.wait_any([comm.iallreduce(np.ones(2), name="any")], timeout=10)
    out["wait_any"] = (index, float(value[0]))

    async def main() -> float:
        return float((await comm.iallreduce(np.ones(1), name="aio"))[0])

    out["await"] = asyncio.run(main())
    results = ar.wait_all(
        [comm.iallreduce(np.full(2, 1.0), name=f"all{i}") for i in range(3)], timeout=10
    )
    out["wait_all"] = [float(v[0]) for v in results]
    return out


def test_request_is_a_future_with_mpi_spellings() -> None:
    check_request_api(run_ranks(2, body_request_api))


def check_request_api(results: dict[int, dict[str, Any]]) -> None:
    """What body_request_api must see (test_engines checks it over every backend too)."""
    n = 2
    first = results[0]
    assert first["test_before"] is False and first["cancel"] is False, first
    assert first["short_wait"].startswith("TimeoutError: "), first
    assert "goes on" in first["short_wait"], first
    for rank, out in results.items():
        assert out["wait_returns_the_buffer"] and out["test_after"], (rank, out)
        assert out["callback_ran"], (rank, out)
        assert out["callback_thread"] and not out["callback_thread"].startswith(
            "asyncreduce-engine"
        ), (rank, out)  # callbacks never run on the progress thread
        assert out["as_completed"] == [i * n for i in range(5)], (rank, out)
        assert out["wait_any"] == (0, n), (rank, out)
        assert out["await"] == n, (rank, out)
        assert out["wait_all"] == [n] * 3, (rank, out)


# ---- usage errors leave the communicator usable -------------------------------------------------


USAGE_ERRORS: list[tuple[Callable[[ar.Communicator], object], str]] = [
    (lambda comm: comm.iallreduce(np.ones((4, 4))[:, 0]), "contiguous"),
    (lambda comm: comm.iallreduce([1.0, 2.0]), "numpy array"),
    (lambda comm: comm.iallreduce(b"abcd"), "read-only"),
    (lambda comm: comm.iallreduce(np.ones(3), op="mean"), "sum, avg"),
    (lambda comm: comm.iallreduce(np.ones(3, np.int32), op="avg"), "floating"),
    (lambda comm: comm.iallreduce(np.ones(3, np.uint32)), "supported"),
    (lambda comm: comm.iallreduce(np.ones(3, np.complex64), op="max"), "no order"),
    (lambda comm: comm.iallreduce(np.ones(3), op="band"), "integers or bool"),
    (lambda comm: comm.igather(np.ones(3), root=-1), "root"),
    (lambda comm: comm.isend(np.ones(3), comm.rank), "another rank"),
    (lambda comm: comm.irecv(np.ones(3), 0, tag=-1) if comm.rank else comm.isend(
        np.ones(3), 1, tag=-1), "tag"),
    (lambda comm: comm.group([0, 0]), "distinct"),
    (lambda comm: comm.ibroadcast(np.ones(3), root=7), "root"),
    (lambda comm: comm.ireduce_scatter(np.ones(3)), "divisible"),
    (lambda comm: comm.iallreduce(np.ones(3), name=""), "name"),
    (lambda comm: comm.iallreduce(np.ones(3), timeout=-1), "timeout"),
]  # (a wrong call, words its UsageError must contain)


def body_usage(comm: ar.Communicator) -> dict[str, Any]:
    outcomes = [_outcome(call, comm) for call, _ in USAGE_ERRORS]
    return {"outcomes": outcomes, "then": comm.allreduce(np.ones(3)).tolist()}


def test_usage_errors_are_clear_and_leave_the_communicator_usable() -> None:
    check_usage(run_ranks(2, body_usage))


def check_usage(results: dict[int, dict[str, Any]]) -> None:
    """What body_usage must see (test_engines checks it over every backend too)."""
    for rank, out in results.items():
        for (_, words), outcome in zip(USAGE_ERRORS, out["outcomes"], strict=True):
            assert outcome.startswith("UsageError: ") and re.search(words, outcome), (
                rank, words, outcome
            )  # fmt: skip
        # nothing was numbered: unnamed operations still line up across ranks
        assert out["then"] == [2.0] * 3, (rank, out)


# ---- input and output types ---------------------------------------------------------------------


def body_types(comm: ar.Communicator) -> dict[str, Any]:
    import array

    import torch

    out: dict[str, Any] = {}
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out["tensor"] = (comm.allreduce(t) is t, t.tolist())
    bf = torch.full((5,), 1.5, dtype=torch.bfloat16)
    comm.allreduce(bf)
    out["bfloat16"] = (str(bf.dtype), bf.float().tolist())
    g = comm.allgather(torch.tensor([comm.rank], dtype=torch.bfloat16))
    out["allgather"] = (type(g).__name__, str(g.dtype), g.flatten().float().tolist())
    p = torch.ones(3, requires_grad=True)
    result = comm.allreduce(p, inplace=False)
    out["out_of_place_tensor"] = (result.tolist(), p.tolist())
    ba = bytearray([1, 2, 3])
    out["bytearray"] = (comm.allreduce(ba) is ba, list(ba))
    arr = array.array("d", [1.0, 2.0])
    out["array"] = (comm.allreduce(arr) is arr, list(arr))
    x = np.ones(4)
    y = comm.allreduce(x, inplace=False)
    out["numpy_out_of_place"] = (x.tolist(), y.tolist())
    return out


def test_numpy_torch_and_buffers_keep_their_type() -> None:
    pytest.importorskip("torch")
    check_types(run_ranks(2, body_types))


def check_types(results: dict[int, dict[str, Any]]) -> None:
    """What body_types must see (test_engines checks it over every backend too)."""
    n = 2
    for rank, out in results.items():
        assert out["tensor"] == (True, [[0.0, n, 2.0 * n], [3.0 * n, 4.0 * n, 5.0 * n]]), out
        assert out["bfloat16"] == ("torch.bfloat16", [1.5 * n] * 5), (rank, out)
        assert out["allgather"] == ("Tensor", "torch.bfloat16", [0.0, 1.0]), (rank, out)
        assert out["out_of_place_tensor"] == ([n] * 3, [1.0] * 3), (rank, out)  # p untouched
        assert out["bytearray"] == (True, [n, 2 * n, 3 * n]), (rank, out)
        assert out["array"] == (True, [n, 2.0 * n]), (rank, out)
        assert out["numpy_out_of_place"] == ([1.0] * 4, [n] * 4), (rank, out)  # x untouched


# ---- a name reused every iteration --------------------------------------------------------------


def body_reused_name(comm: ar.Communicator) -> list[float]:
    values = []
    for step in range(20):
        x = np.full(1000, float(step + comm.rank))
        reqs = [comm.iallreduce(x, name="grad")]
        if comm.rank == 0:
            time.sleep(0.001 * (step % 3))
        values.append(float(reqs[0].wait(timeout=10)[0]))
    return values


def test_a_name_reused_every_iteration_matches_by_count() -> None:
    results = run_ranks(2, body_reused_name)
    assert results[0] == results[1] == [float(2 * s + 1) for s in range(20)]


# ---- a frozen peer -------------------------------------------------------------------------


def body_frozen(comm: ar.Communicator) -> str:
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its sockets stay open, it says nothing
    start = time.monotonic()
    with pytest.raises(ar.BrokenError) as info:  # a silent peer: broken, not a wait run out
        comm.allreduce(np.ones(1000, np.float32), name="stuck")
    elapsed = time.monotonic() - start
    assert isinstance(info.value.__cause__, TimeoutError), repr(info.value.__cause__)
    assert 1.5 <= elapsed < 5.0, elapsed  # the peer timeout is 2 s, heartbeats every 0.5 s
    return str(info.value)


def test_a_frozen_peer_fails_pending_operations_naming_it() -> None:
    env = {"ASYNCREDUCE_PEER_TIMEOUT": "2"}
    messages = run_ranks(2, body_frozen, expect_dead=frozenset({1}), env=env, timeout=60)
    assert "rank 1 sent nothing for 2 s" in messages[0], messages


# ---- completion means the caller's buffer is free -----------------------------------------------


def body_reuse_after_broadcast(comm: ar.Communicator) -> bool:
    x = np.full(16 << 20, 1.0 if comm.rank == 0 else 2.0, np.float32)  # 64 MiB: many segments
    comm.broadcast(x, root=0, name="big")  # most still queued after the first has left
    if comm.rank == 0:
        x[:] = 0  # the root's request completed: its buffer is the caller's again
    comm.barrier()
    return bool(np.all(x == 1)) if comm.rank else True


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_completed_broadcast_no_longer_reads_the_roots_buffer(transport: str) -> None:
    results = run_ranks(3, body_reuse_after_broadcast, env=TRANSPORTS[transport])
    assert all(results.values()), results


# ---- a bug in the progress thread -----------------------------------------------------------


def body_crash(comm: ar.Communicator) -> tuple[str, float]:
    comm.barrier()
    start = time.monotonic()
    if comm.rank == 0:
        engine = comm._engine
        assert engine is not None

        def bug(now: float) -> None:
            raise ZeroDivisionError("injected")

        engine.session.tick = bug  # type: ignore[method-assign]  # the next loop turn crashes
        engine.transport.wakeup()
        while engine.broken is None:  # else a busy-polling thread may finish the next
            time.sleep(0.001)  # allreduce in the same turn, before it crashes
    with pytest.raises(ar.BrokenError) as info:
        comm.allreduce(np.ones(4, np.float32), name="after-crash", timeout=20)
    closing = time.monotonic()
    comm.close()  # the crashed thread waits for close(), then closes its sockets
    assert time.monotonic() - closing < 5
    return str(info.value), time.monotonic() - start


def test_a_crashed_progress_thread_fails_everything_and_closes() -> None:
    results = run_ranks(2, body_crash, timeout=60)
    assert "progress thread crashed" in results[0][0], results[0]
    assert "rank 0" in results[1][0], results[1]
    assert all(elapsed < 5 for _, elapsed in results.values()), results
