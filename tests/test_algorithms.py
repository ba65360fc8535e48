"""Sans-IO tests of the collective algorithms: every rank in one process, random delivery.

Each test builds one state machine per rank and hands them to a ``Network``, which plays the
wire: ranks start at random moments (messages for a rank that has not started yet are held, as
the engine's unexpected queue holds them), messages are delivered one at a time in an order
drawn from a hypothesis seed, a payload is read when it is delivered (as a zero-copy transport
would) after checking it is still the bytes that were sent, and a receive may be split: its
buffer is asked for, other messages are handled, and only later is it written and consumed.

Expected results are computed independently with numpy from the original inputs. Inputs are
small integers, so every order of combining gives the same exact value and a result can be
compared for equality; every rank must also end bitwise identical to every other.

The regression tests near the end pin down bugs found while writing this file, all fixed now:
each is named after what the spec says, and its docstring says what used to go wrong.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from asyncreduce.algorithms import (
    DTYPES,
    REDUCTIONS,
    SEGMENT_BYTES,
    SMALL_ALLREDUCE_BYTES,
    Barrier,
    Collective,
    DirectAllreduce,
    DType,
    PeerMemory,
    ProtocolError,
    RecursiveDoubling,
    Ring,
    RunsDirectly,
    Send,
    SharedAllreduce,
    TreeBroadcast,
    WindowMemory,
    build,
    combine,
    finalize,
    reduction_refused,
    segments,
    split,
)
from asyncreduce.bootstrap.samehost import _unreadable
from asyncreduce.kernels import reduction
from asyncreduce.kernels.pool import CorePool
from asyncreduce.samehost import cma
from asyncreduce.samehost.cma import CrossMemory
from network import Network, quiet_floats  # the fake wire

DTYPE_NAMES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16", "int8",
               "int16", "bool", "complex64", "complex128"]  # fmt: skip
COUNTS = [0, 1, 13, 1009]
BIG = 1_000_003


def fast(max_examples: int) -> settings:
    """``max_examples`` drawn alike in every run (CI stays reproducible), or new ones each run
    where ASYNCREDUCE_FUZZ=1 (the search for new failures: README, "Tests")."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=not os.environ.get("ASYNCREDUCE_FUZZ"),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )



# --------------------------------------------------------------------------------------------
# Data and independent expectations


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of values that bfloat16 represents exactly."""
    wide = np.asarray(values, dtype=np.float32)
    assert np.array_equal(wide, np.asarray(values, dtype=np.float64))
    bits = (wide.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(bf16_value(bits), wide), "not exactly representable in bfloat16"
    return bits


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round finite float64 to bfloat16 (8 significant bits), ties to even, by arithmetic."""
    mantissa, exponent = np.frexp(np.asarray(x, dtype=np.float64))
    return bf16_bits(np.ldexp(np.round(mantissa * 256), exponent - 8))


def to_storage(values: np.ndarray, dtype_name: str, wrap: bool = False) -> np.ndarray:
    """Exact integer values as the bytes an algorithm works on (``wrap``: integers may wrap,
    as bitwise results of negative int64 inputs do into a narrower type)."""
    if dtype_name == "bfloat16":
        return bf16_bits(values)
    out = np.asarray(values).astype(DTYPES[dtype_name].storage)
    if not wrap:
        assert np.array_equal(out, np.asarray(values)), "not exactly representable"
    return out


def same_values(got: np.ndarray, want: np.ndarray, dtype_name: str) -> bool:
    if dtype_name == "bfloat16":  # compare values, so -0 equals +0 as for the other floats
        return np.array_equal(bf16_value(got), bf16_value(want))
    return got.dtype == want.dtype and np.array_equal(got, want)


def value_range(dtype_name: str, op: str) -> tuple[int, int]:
    """Inputs whose reduction over up to 9 ranks is exact in every order (uint8 wraps)."""
    if dtype_name == "bool":
        return (0, 1)
    if dtype_name == "int8":
        return {"prod": (-1, 1), "sum": (-14, 14)}.get(op, (-128, 127))
    if dtype_name == "int16" and op in ("max", "min", "band", "bor", "bxor"):
        return (-(2**15), 2**15 - 1)
    if dtype_name == "uint8":
        return (0, 3) if op == "prod" else (0, 255)
    if op == "prod":
        return (-2, 2)
    if op in ("sum", "avg"):
        return {"float16": (-100, 100), "bfloat16": (-28, 28)}.get(dtype_name, (-1000, 1000))
    return {"float16": (-2048, 2048), "bfloat16": (-256, 256)}.get(dtype_name, (-(10**6), 10**6))


def make_inputs(seed: int, n: int, count: int, dtype_name: str, op: str) -> list[np.ndarray]:
    if reduction_refused(DTYPES[dtype_name], op) is not None:
        assume(False)  # the communicator refuses it before any algorithm runs
    lo, hi = value_range(dtype_name, op)
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=count, endpoint=True, dtype=np.int64) for _ in range(n)]


def reduce_expected(inputs: list[np.ndarray], dtype_name: str, op: str, n: int) -> np.ndarray:
    """What an allreduce of integer-valued ``inputs`` must produce, in storage form."""
    stack = np.stack(inputs) if inputs else np.zeros((0, 0), dtype=np.int64)
    if dtype_name == "bool":  # torch's meaning: sum, max, bor "or"; prod, min, band "and"
        truth = stack.astype(bool)
        if op in ("sum", "max", "bor"):
            return truth.any(axis=0)
        if op in ("prod", "min", "band"):
            return truth.all(axis=0)
        return np.logical_xor.reduce(truth, axis=0)
    if op in ("band", "bor", "bxor"):
        ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        return to_storage(ufunc.reduce(stack, axis=0), dtype_name, wrap=True)
    if op in ("sum", "avg"):
        total = stack.sum(axis=0)
    elif op == "max":
        total = stack.max(axis=0)
    elif op == "min":
        total = stack.min(axis=0)
    else:
        total = stack.prod(axis=0)
    if dtype_name == "uint8":
        total = total % 256  # unsigned arithmetic wraps
    if op != "avg":
        return to_storage(total, dtype_name)
    quotient = total / n
    if dtype_name == "bfloat16":
        return bf16_round(quotient)
    if DTYPES[dtype_name].is_integral:
        return np.trunc(quotient).astype(DTYPES[dtype_name].storage)  # toward zero
    return quotient.astype(DTYPES[dtype_name].storage)


def check_allreduce(buffers: list[np.ndarray], want: np.ndarray, dtype_name: str) -> None:
    for rank, buf in enumerate(buffers):
        assert same_values(buf, want, dtype_name), f"rank {rank}: {buf[:8]} != {want[:8]}"
    first = buffers[0].tobytes()
    assert all(b.tobytes() == first for b in buffers), "ranks differ bitwise"


def nsegs(size: int, segment_bytes: int, dtype: DType) -> int:
    seg_elems = max(1, segment_bytes // dtype.itemsize)
    return max(1, math.ceil(size / seg_elems))


def allreduce(
    make: Callable[[int, np.ndarray], Collective],
    n: int,
    count: int,
    dtype_name: str,
    op: str,
    seed: int,
) -> Network:
    inputs = make_inputs(seed, n, count, dtype_name, op)
    want = reduce_expected(inputs, dtype_name, op, n)
    buffers = [to_storage(x, dtype_name) for x in inputs]
    net = Network([make(r, buffers[r]) for r in range(n)], seed).run()
    check_allreduce(buffers, want, dtype_name)
    return net


# --------------------------------------------------------------------------------------------
# Allreduce


ops = st.sampled_from(REDUCTIONS)
dtype_names = st.sampled_from(DTYPE_NAMES)
seeds = st.integers(0, 2**32 - 1)


@fast(250)
@given(
    n=st.integers(1, 9), count=st.sampled_from(COUNTS), op=ops, dtype_name=dtype_names, seed=seeds
)
def test_allreduce_through_build(n: int, count: int, op: str, dtype_name: str, seed: int) -> None:
    dtype = DTYPES[dtype_name]
    allreduce(
        lambda r, buf: build("allreduce", r, n, buf, dtype, op), n, count, dtype_name, op, seed
    )


@pytest.mark.parametrize("algorithm", ["build", "doubling"])
@fast(4)
@given(n=st.integers(2, 9), op=ops, dtype_name=dtype_names, seed=seeds)
def test_allreduce_about_a_million(
    algorithm: str, n: int, op: str, dtype_name: str, seed: int
) -> None:
    dtype = DTYPES[dtype_name]

    def make(r: int, buf: np.ndarray) -> Collective:
        if algorithm == "doubling":
            return RecursiveDoubling(r, n, buf, dtype, op)
        machine = build("allreduce", r, n, buf, dtype, op)
        assert isinstance(machine, Ring), "a million elements should take the ring"
        return machine

    allreduce(make, n, BIG, dtype_name, op, seed)


#: Allreduces over world sizes, counts, segment sizes (down to one byte), reductions, dtypes.
segmented_allreduces = given(
    n=st.integers(1, 9),
    count=st.sampled_from(COUNTS),
    segment_bytes=st.sampled_from([1, 64, 4096, SEGMENT_BYTES]),
    op=ops,
    dtype_name=dtype_names,
    seed=seeds,
)


@fast(250)
@segmented_allreduces
def test_ring_allreduce(
    n: int, count: int, segment_bytes: int, op: str, dtype_name: str, seed: int
) -> None:
    dtype = DTYPES[dtype_name]
    net = allreduce(
        lambda r, buf: Ring(r, n, buf, dtype, op, True, segment_bytes=segment_bytes),
        n,
        count,
        dtype_name,
        op,
        seed,
    )
    # Per rank: reduce-scatter sends every chunk but its own, allgather every chunk but its
    # right neighbour's, each as one message per segment; the right neighbour receives them.
    sizes = [b - a for a, b in split(count, n)]
    for r in range(n):
        rs = sum(nsegs(sizes[c], segment_bytes, dtype) for c in range(n) if c != r)
        ag = sum(nsegs(sizes[c], segment_bytes, dtype) for c in range(n) if c != (r + 1) % n)
        want = 0 if n == 1 else rs + ag
        assert net.sent_by[r] == want, (r, net.sent_by, want)
        assert net.received_by[(r + 1) % n] == want, (r, net.received_by, want)


def doubling_sends(n: int) -> list[int]:
    """Messages each rank sends in recursive doubling over n ranks."""
    p = 1 << (n.bit_length() - 1)
    extra, rounds = n - p, p.bit_length() - 1
    return [1 if r < 2 * extra and r % 2 == 0 else rounds + (r < 2 * extra) for r in range(n)]


@fast(200)
@given(
    n=st.integers(1, 9), count=st.sampled_from(COUNTS), op=ops, dtype_name=dtype_names, seed=seeds
)
def test_recursive_doubling_allreduce(
    n: int, count: int, op: str, dtype_name: str, seed: int
) -> None:
    dtype = DTYPES[dtype_name]
    net = allreduce(
        lambda r, buf: RecursiveDoubling(r, n, buf, dtype, op), n, count, dtype_name, op, seed
    )
    assert net.sent_by == doubling_sends(n)
    assert net.received_by == doubling_sends(n)


@pytest.mark.parametrize("n", range(1, 10))
def test_message_counts_follow_the_cost_model(n: int) -> None:
    """A regression to a chattier schedule fails here."""
    dtype = DTYPES["float32"]
    count = 1009  # one segment per chunk at the default segment size
    ring = allreduce(
        lambda r, buf: Ring(r, n, buf, dtype, "sum", True), n, count, "float32", "sum", n
    )
    assert ring.sent_by == [2 * (n - 1)] * n

    doubling = allreduce(
        lambda r, b: RecursiveDoubling(r, n, b, dtype, "sum"), n, count, "float32", "sum", n
    )
    p = 1 << (n.bit_length() - 1)
    log_p = p.bit_length() - 1
    if n == p:
        assert doubling.sent_by == [log_p] * n
    assert doubling.delivered == p * log_p + 2 * (n - p)
    assert max(doubling.sent_by) <= log_p + 1

    gather = Network(
        [build("allgather", r, n, np.zeros(n * 3, np.float32), dtype) for r in range(n)], n
    ).run()
    assert gather.sent_by == [n - 1] * n
    scatter = Network(
        [build("reduce_scatter", r, n, np.zeros(n * 3, np.float32), dtype) for r in range(n)], n
    )
    assert scatter.run().sent_by == [n - 1] * n
    barrier = Network([Barrier(r, n) for r in range(n)], n).run()
    assert barrier.sent_by == [math.ceil(math.log2(n))] * n


def test_build_picks_by_size() -> None:
    dtype = DTYPES["float32"]
    small = np.zeros(SMALL_ALLREDUCE_BYTES // 4, np.float32)
    large = np.zeros(SMALL_ALLREDUCE_BYTES // 4 + 1, np.float32)
    assert isinstance(build("allreduce", 0, 4, small, dtype, "sum"), RecursiveDoubling)
    assert isinstance(build("allreduce", 0, 4, large, dtype, "sum"), Ring)
    with pytest.raises(ValueError):
        build("alltoall", 0, 4, small, dtype)
    with pytest.raises(ValueError):
        build("allreduce", 4, 4, small, dtype)


@pytest.mark.torch
@fast(60)
@given(
    n=st.integers(1, 9),
    count=st.sampled_from(COUNTS),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
    algorithm=st.sampled_from(["ring", "doubling"]),
    seed=seeds,
)
def test_bfloat16_allreduce_matches_torch(
    n: int, count: int, op: str, algorithm: str, seed: int
) -> None:
    torch = pytest.importorskip("torch")
    dtype = DTYPES["bfloat16"]
    inputs = make_inputs(seed, n, count, "bfloat16", op)
    tensors = [torch.tensor(x, dtype=torch.bfloat16) for x in inputs]
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op](
            acc, t
        )
    if op == "avg":
        acc = acc / n
    want = acc.view(torch.int16).numpy().view(np.uint16).copy()

    buffers = [to_storage(x, "bfloat16") for x in inputs]
    if algorithm == "ring":
        machines: list[Collective] = [
            Ring(r, n, buffers[r], dtype, op, True, segment_bytes=64) for r in range(n)
        ]
    else:
        machines = [RecursiveDoubling(r, n, buffers[r], dtype, op) for r in range(n)]
    Network(machines, seed).run()
    check_allreduce(buffers, want, "bfloat16")


@pytest.mark.parametrize("n", [12, 16, 17, 33])
def test_larger_worlds(n: int) -> None:
    """Beyond 9 ranks: more levels, and more ranks sitting out of recursive doubling."""
    d = DTYPES["int64"]
    net = allreduce(lambda r, b: RecursiveDoubling(r, n, b, d, "sum"), n, 13, "int64", "sum", n)
    assert net.sent_by == doubling_sends(n)
    ring = allreduce(
        lambda r, b: Ring(r, n, b, d, "max", True, segment_bytes=16), n, 101, "int64", "max", n
    )
    per_chunk = [nsegs(stop - start, 16, d) for start, stop in split(101, n)]
    assert ring.delivered == 2 * (n - 1) * sum(per_chunk)
    assert Network([Barrier(r, n) for r in range(n)], n).run().sent_by == [(n - 1).bit_length()] * n
    root = n // 3
    bufs = [np.full(50, r) for r in range(n)]
    tree = Network([TreeBroadcast(r, n, bufs[r], root, segment_bytes=64) for r in range(n)], n)
    tree.must_start = lambda rank: {root}
    tree.run()
    assert all((b == root).all() for b in bufs)
    assert tree.delivered == (n - 1) * 7


# --------------------------------------------------------------------------------------------
# Broadcast, allgather, reduce-scatter


def storage_noise(rng: np.random.Generator, count: int, dtype_name: str) -> np.ndarray:
    """Arbitrary bytes: the algorithms must move them exactly, whatever they mean."""
    storage = DTYPES[dtype_name].storage
    return rng.integers(0, 256, size=count * storage.itemsize, dtype=np.uint8).view(storage)


@fast(150)
@given(
    n=st.integers(1, 9),
    data=st.data(),
    count=st.sampled_from(COUNTS),
    segment_bytes=st.sampled_from([1, 16, 64, 4096, SEGMENT_BYTES]),
    dtype_name=dtype_names,
    seed=seeds,
)
def test_tree_broadcast(
    n: int, data: st.DataObject, count: int, segment_bytes: int, dtype_name: str, seed: int
) -> None:
    root = data.draw(st.integers(0, n - 1), label="root")
    rng = np.random.default_rng(seed)
    buffers = [storage_noise(rng, count, dtype_name) for _ in range(n)]
    original = buffers[root].copy()
    machines = [
        TreeBroadcast(r, n, buffers[r], root, segment_bytes=segment_bytes) for r in range(n)
    ]
    net = Network(machines, seed)
    net.must_start = lambda rank: {root}
    net.run()
    for r, buf in enumerate(buffers):
        assert buf.tobytes() == original.tobytes(), f"rank {r} (root {root})"
    segs = nsegs(count, segment_bytes, DTYPES[dtype_name])
    assert net.received_by == [0 if r == root else segs for r in range(n)]
    assert net.delivered == (n - 1) * segs


@pytest.mark.parametrize("n", range(1, 10))
def test_broadcast_through_build_every_root(n: int) -> None:
    dtype = DTYPES["float64"]
    for root in range(n):
        buffers = [np.full(13, float(r), dtype=np.float64) for r in range(n)]
        net = Network(
            [build("broadcast", r, n, buffers[r], dtype, root=root) for r in range(n)], root
        )
        net.must_start = lambda rank, root=root: {root}
        net.run()
        assert all(np.array_equal(b, np.full(13, float(root))) for b in buffers)
        assert net.delivered == n - 1


@fast(150)
@given(
    n=st.integers(1, 9),
    count=st.sampled_from([0, 1, 13, 1009, 4 * 9 * 7]),
    dtype_name=dtype_names,
    seed=seeds,
)
def test_allgather_through_build(n: int, count: int, dtype_name: str, seed: int) -> None:
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    size = count // n
    blocks = [storage_noise(rng, size, dtype_name) for _ in range(n)]
    buffers = []
    for r in range(n):
        buf = storage_noise(rng, count, dtype_name)  # garbage everywhere...
        buf[r * size : (r + 1) * size] = blocks[r]  # ...but this rank's own block
        buffers.append(buf)
    tails = [b[n * size :].copy() for b in buffers]
    net = Network([build("allgather", r, n, buffers[r], dtype) for r in range(n)], seed).run()
    want = np.concatenate(blocks).tobytes() if blocks else b""
    for r, buf in enumerate(buffers):
        assert buf[: n * size].tobytes() == want, f"rank {r}"
        assert buf[n * size :].tobytes() == tails[r].tobytes(), f"rank {r} touched the remainder"
    assert net.sent_by == [n - 1] * n


@fast(150)
@given(
    n=st.integers(1, 9),
    count=st.sampled_from([0, 1, 13, 1009, 4 * 9 * 7]),
    op=ops,
    dtype_name=dtype_names,
    seed=seeds,
)
def test_reduce_scatter_through_build(
    n: int, count: int, op: str, dtype_name: str, seed: int
) -> None:
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(seed, n, count, dtype_name, op)
    buffers = [to_storage(x, dtype_name) for x in inputs]
    originals = [b.copy() for b in buffers]
    net = Network(
        [build("reduce_scatter", r, n, buffers[r], dtype, op) for r in range(n)], seed
    ).run()
    size = count // n
    for r, buf in enumerate(buffers):
        block = slice(r * size, (r + 1) * size)
        want = reduce_expected([x[block] for x in inputs], dtype_name, op, n)
        assert same_values(buf[block], want, dtype_name), (
            f"rank {r}: {buf[block][:8]} != {want[:8]}"
        )
        assert buf[n * size :].tobytes() == originals[r][n * size :].tobytes(), "remainder touched"
    assert net.sent_by == [n - 1] * n


# --------------------------------------------------------------------------------------------
# Barrier


@fast(60)
@given(n=st.integers(1, 9), seed=seeds)
def test_barrier_completes(n: int, seed: int) -> None:
    net = Network([Barrier(r, n) for r in range(n)], seed).run()  # checks: none done early
    assert net.sent_by == [(n - 1).bit_length()] * n


@fast(80)
@given(n=st.integers(2, 9), data=st.data(), seed=seeds)
def test_barrier_waits_for_every_rank(n: int, data: st.DataObject, seed: int) -> None:
    late = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1), label="late")
    machines = [Barrier(r, n) for r in range(n)]
    net = Network(machines, seed)
    for r in range(n):
        if r not in late:
            net.start(r)
    net.quiet()  # everything the early ranks can exchange among themselves
    assert not any(m.done for m in machines), "a rank left the barrier before all entered"
    # Some early rank's successor is late, so at least one message waits for a late rank.
    assert any(net.held[r] for r in late)
    for r in sorted(late):
        net.start(r)
    net.quiet()
    assert all(m.done for m in machines)


# --------------------------------------------------------------------------------------------
# Protocol errors


def _machines(kind: str, n: int, count: int, seed: int) -> list[Collective]:
    dtype = DTYPES["float32"]
    bufs = [np.arange(count, dtype=np.float32) + r for r in range(n)]
    if kind == "ring":
        return [Ring(r, n, bufs[r], dtype, "sum", True, segment_bytes=16) for r in range(n)]
    if kind == "doubling":
        return [RecursiveDoubling(r, n, bufs[r], dtype, "sum") for r in range(n)]
    if kind == "broadcast":
        return [TreeBroadcast(r, n, bufs[r], seed % n, segment_bytes=16) for r in range(n)]
    if kind == "barrier":
        return [Barrier(r, n) for r in range(n)]
    return [build(kind, r, n, bufs[r], dtype, "max") for r in range(n)]


KINDS = ["ring", "doubling", "broadcast", "barrier", "allgather", "reduce_scatter"]


@fast(200)
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(2, 9),
    count=st.sampled_from([0, 1, 13, 40]),
    seed=seeds,
)
def test_malformed_messages_are_refused(kind: str, n: int, count: int, seed: int) -> None:
    """Before each delivery: wrong size, source, step or segment raise ProtocolError; after
    it: the same message again (a duplicate) does; once done, any message does."""
    machines = _machines(kind, n, count, seed)
    net = Network(machines, seed, probe=True)  # every rank, the doubling's sitting-out ones too
    if kind == "broadcast":
        net.must_start = lambda rank: {seed % n}
    net.run()
    for f in net.log:
        with pytest.raises(ProtocolError):
            machines[f.dst].recv_buffer(f.src, f.step, f.seg, len(f.sent))


def _first_message(machines: list[Collective]) -> tuple[int, Send]:
    for src, m in enumerate(machines):
        sends = m.start()
        if sends:
            return src, sends[0]
    raise AssertionError("nobody sends")


@pytest.mark.parametrize("kind", KINDS)
def test_each_protocol_error_by_hand(kind: str) -> None:
    machines = _machines(kind, 4, 13, seed=1)
    src, send = _first_message(machines)
    dst, nbytes = machines[send.dst], send.payload.nbytes
    with pytest.raises(ProtocolError):
        dst.recv_buffer(src, send.step, send.seg, nbytes + 4)  # wrong size
    stranger = next(r for r in range(4) if r not in (src, send.dst))
    with pytest.raises(ProtocolError):
        dst.recv_buffer(stranger, send.step, send.seg, nbytes)  # wrong source
    with pytest.raises(ProtocolError):
        dst.recv_buffer(src, send.step + 100, send.seg, nbytes)  # wrong step
    with pytest.raises(ProtocolError):
        dst.recv_buffer(src, send.step, send.seg + 100, nbytes)  # wrong segment
    target = dst.recv_buffer(src, send.step, send.seg, nbytes)
    target.reshape(-1).view(np.uint8)[:] = np.frombuffer(send.payload.tobytes(), dtype=np.uint8)
    dst.on_message(src, send.step, send.seg, target)
    with pytest.raises(ProtocolError):
        dst.recv_buffer(src, send.step, send.seg, nbytes)  # duplicate


def test_constructors_refuse_bad_ranks() -> None:
    dtype = DTYPES["float32"]
    buf = np.zeros(4, np.float32)
    for bad in (-1, 3):
        with pytest.raises(ValueError):
            Ring(bad, 3, buf, dtype, "sum", True)
        with pytest.raises(ValueError):
            Barrier(bad, 3)
        with pytest.raises(ValueError):
            TreeBroadcast(0, 3, buf, root=bad)


# --------------------------------------------------------------------------------------------
# split and segments


@fast(200)
@given(count=st.integers(0, 10**6), parts=st.integers(1, 64))
def test_split_covers_evenly(count: int, parts: int) -> None:
    ranges = split(count, parts)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [b - a for a, b in ranges]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == count


@fast(200)
@given(start=st.integers(0, 10**6), length=st.integers(0, 10**5), seg=st.integers(1, 10**4))
def test_segments_cover_exactly(start: int, length: int, seg: int) -> None:
    stop = start + length
    pieces = segments(start, stop, seg)
    if length == 0:
        assert pieces == [(start, start)]
        return
    assert pieces[0][0] == start and pieces[-1][1] == stop
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(b - a == seg for a, b in pieces[:-1])
    assert 0 < pieces[-1][1] - pieces[-1][0] <= seg
    assert len(pieces) == math.ceil(length / seg)


@fast(50)
@given(start=st.integers(0, 100), stop_minus=st.integers(0, 100), seg=st.integers(1, 10))
def test_segments_of_an_empty_range_is_one_empty_segment(
    start: int, stop_minus: int, seg: int
) -> None:
    assert segments(start, start - stop_minus, seg) == [(start, start)]


# --------------------------------------------------------------------------------------------
# bfloat16 rounding against PyTorch


def _is_bf16_nan(bits: np.ndarray) -> np.ndarray:
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)


def _torch_bits(torch, t) -> np.ndarray:  # type: ignore[no-untyped-def]
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _assert_same_bf16(got: np.ndarray, want: np.ndarray, context: object) -> None:
    """Bitwise equal, except that any NaN matches any NaN (PyTorch's own NaN bits differ
    between its scalar and vector paths)."""
    nan_got, nan_want = _is_bf16_nan(got), _is_bf16_nan(want)
    assert np.array_equal(nan_got, nan_want), context
    bad = ~nan_want & (got != want)
    assert not bad.any(), (context, got[bad][:5], want[bad][:5])


# Float32 bit patterns that stress rounding: exact ties (even and odd), just either side of a
# tie, the largest finite values (which round to infinity), subnormals, infinities, NaNs
# (quiet, signalling, negative, with payload only in the low half).
_SPECIAL_F32_BITS = [
    0x3F808000,
    0x3F818000,
    0x3F80_7FFF,
    0x3F80_8001,
    0xBF808000,
    0xBF818000,
    0x7F7F_FFFF,
    0x7F7F_8000,
    0x7F7E_8000,
    0xFF7F_FFFF,
    0x0000_0001,
    0x0000_8000,
    0x0001_8000,
    0x807F_FFFF,
    0x0000_0000,
    0x8000_0000,
    0x7F80_0000,
    0xFF80_0000,
    0x7FC0_0000,
    0xFFC0_0000,
    0x7F80_0001,
    0x7FBF_FFFF,
    0xFF80_0001,
    0x7FFF_FFFF,
    0xFFFF_FFFF,
]


@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_fold_quietly_overflows_to_inf_without_a_warning_and_leaves_the_callers_settings(
    op: str,
) -> None:
    """The lane folds on the caller's thread: no RuntimeWarning there (overflow is the data's,
    as on the progress thread), and the caller's own settings are back after the call."""
    big = np.full(4, 3e38, np.float32)
    out = np.empty_like(big)
    with np.errstate(over="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        reduction.fold_quietly(DTYPES["float32"], op, [big.view(np.uint8)] * 3, out, 3)
        assert np.isinf(out).all() and np.geterr()["over"] == "raise"
        with pytest.raises(FloatingPointError, match="overflow"):
            big * big


@pytest.mark.torch
@fast(60)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    floats=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=64),
    ties=st.lists(st.tuples(st.integers(0, 0x1FF), st.integers(0, 0x7F)), max_size=32),
)
def test_bf16_rounding_matches_torch(
    bits: list[int], floats: list[float], ties: list[tuple[int, int]]
) -> None:
    torch = pytest.importorskip("torch")
    tie_bits = [(sign_exp << 23) | (mant << 16) | 0x8000 for sign_exp, mant in ties]
    raw = np.array(bits + tie_bits + _SPECIAL_F32_BITS, dtype=np.uint32)
    values = np.concatenate([raw.view(np.float32), np.array(floats, dtype=np.float32)])
    ours = np.empty(values.size, dtype=np.uint16)
    with quiet_floats():
        reduction._f32_to_bf16(values.copy(), ours)  # the rounding step, white-box
    want = _torch_bits(torch, torch.from_numpy(values.copy()).to(torch.bfloat16))
    _assert_same_bf16(ours, want, "float32 -> bfloat16")


_bf16_bits = st.integers(0, 0xFFFF)


@st.composite
def bf16_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Operand pairs: arbitrary bit patterns, and pairs whose exact sum is a rounding tie."""
    size = draw(st.integers(0, 48))
    a = draw(st.lists(_bf16_bits, min_size=size, max_size=size))
    b = draw(st.lists(_bf16_bits, min_size=size, max_size=size))
    for _ in range(draw(st.integers(0, 16))):
        exp = draw(st.integers(9, 0xF0))
        sign = draw(st.integers(0, 1)) << 15
        a.append(sign | (exp << 7) | draw(st.integers(0, 0x7F)))
        b.append(sign | ((exp - 8) << 7))  # half a unit in the last place of a
    return a, b


@pytest.mark.torch
@fast(60)
@given(pair=bf16_pairs(), op=st.sampled_from(["sum", "prod", "max", "min"]))
def test_bf16_combine_matches_torch(pair: tuple[list[int], list[int]], op: str) -> None:
    torch = pytest.importorskip("torch")
    a = np.array(pair[0], dtype=np.uint16)
    b = np.array(pair[1], dtype=np.uint16)
    ta = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    tb = torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16)
    fn = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[op]
    want = _torch_bits(torch, fn(ta, tb))
    acc = a.copy()
    with quiet_floats():
        combine(DTYPES["bfloat16"], op, acc, b.copy())
    if op in ("max", "min"):  # which zero max(+0, -0) returns is not specified: compare values
        zeros = (bf16_value(acc) == 0) & (bf16_value(want) == 0)
        acc, want = acc[~zeros], want[~zeros]
    _assert_same_bf16(acc, want, (op, a[:4], b[:4]))


@pytest.mark.torch
@fast(40)
@given(values=st.lists(_bf16_bits, max_size=64), n=st.integers(1, 9))
def test_bf16_finalize_avg_matches_torch(values: list[int], n: int) -> None:
    torch = pytest.importorskip("torch")
    bits = np.array(values, dtype=np.uint16)
    want = _torch_bits(torch, torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16) / n)
    got = bits.copy()
    with quiet_floats():
        finalize(DTYPES["bfloat16"], "avg", got, n)
    _assert_same_bf16(got, want, n)
    for op in ("sum", "max", "min", "prod"):  # only avg does anything at the end
        same = bits.copy()
        finalize(DTYPES["bfloat16"], op, same, n)
        assert same.tobytes() == bits.tobytes()


@fast(60)
@given(
    dtype_name=st.sampled_from(["float16", "float32", "float64", "int32", "int64", "uint8"]),
    n=st.integers(1, 9),
    seed=seeds,
)
def test_finalize_avg_divides_once(dtype_name: str, n: int, seed: int) -> None:
    total = make_inputs(seed, 1, 64, dtype_name, "sum")[0] * n
    if dtype_name == "uint8":
        total %= 256
    got = to_storage(total, dtype_name)
    finalize(DTYPES[dtype_name], "avg", got, n)
    assert same_values(got, reduce_expected([total], dtype_name, "avg", n), dtype_name)


# --------------------------------------------------------------------------------------------
# Regressions: bugs found while writing this file, fixed since (each docstring says what the
# bug was; the names say what the spec requires).


def test_doubling_refuses_a_duplicate_at_a_rank_that_sits_out() -> None:
    """When n is not a power of two, an even rank r < 2*extra sits out and later receives the
    result (last step) from r+1; a second copy of that message is a ProtocolError. The bug
    (fixed in doubling.py, ``recv_buffer``'s ``fresh`` now checks ``done``): ``fresh`` only
    checked ``self._early`` and ``self._step``, which a sitting-out rank never updates, so the
    duplicate overwrote the finished result and turned ``done`` False again."""
    n, dtype = 3, DTYPES["float32"]
    bufs = [np.arange(4, dtype=np.float32) * (r + 1) for r in range(n)]
    machines = [RecursiveDoubling(r, n, bufs[r], dtype, "sum") for r in range(n)]
    net = Network(machines, seed=0, split_recv=False).run()
    (result,) = [f for f in net.log if f.dst == 0]  # rank 0 sits out; rank 1 sends it the result
    assert machines[0].done and np.array_equal(bufs[0], np.arange(4) * 6)
    with pytest.raises(ProtocolError):
        machines[0].recv_buffer(result.src, result.step, result.seg, len(result.sent))


@pytest.mark.parametrize(
    ("op", "dtype_name", "a", "b"),
    [
        ("max", "float32", -0.0, 0.0),
        ("min", "float64", 0.0, -0.0),
        ("max", "float16", -0.0, 0.0),
        ("max", "bfloat16", -0.0, 0.0),
        ("sum", "float32", float("nan"), float("nan")),  # payloads set below
    ],
)
def test_doubling_leaves_every_rank_bitwise_equal(
    op: str, dtype_name: str, a: float, b: float
) -> None:
    """Every rank ends bitwise identical, even where a reduction is commutative in value only:
    np.maximum/np.minimum return one operand or the other for +0 vs -0 depending on the order,
    and x86 propagates the first operand's NaN payload in a sum. The bug (fixed: both partners
    now combine the lower rank's operand first, doubling.py and reduction.py's ``combine``):
    each partner computed own (op) other, so with two ranks holding [-0.0] and [+0.0] max left
    -0.0 on one and +0.0 on the other (also min, float16/float64, bfloat16, NaN payloads)."""
    dtype = DTYPES[dtype_name]
    if dtype_name == "bfloat16":
        bufs = [np.array([0x8000] * 3, np.uint16), np.array([0x0000] * 3, np.uint16)]
    elif op == "sum":
        bufs = [
            np.array([0x7FC00001] * 3, np.uint32).view(np.float32),
            np.array([0x7FC00002] * 3, np.uint32).view(np.float32),
        ]
    else:
        bufs = [np.array([a] * 3, dtype.storage), np.array([b] * 3, dtype.storage)]
    machines = [build("allreduce", r, 2, bufs[r], dtype, op) for r in range(2)]
    Network(machines, seed=0).run()
    assert bufs[0].tobytes() == bufs[1].tobytes(), [buf.tobytes().hex() for buf in bufs]


def test_int64_avg_is_exact_above_2_to_53() -> None:
    """Integer ``avg`` is exact (rounding toward zero, as ``finalize`` says): two ranks holding
    2**61 + 1 sum to 2**62 + 2, whose average is 2**61 + 1 = 2305843009213693953. The bug
    (fixed in reduction.py's ``finalize``, which now divides integers as integers): it divided
    with np.divide, in float64, so sums above 2**53 lost their low bits (2**61 came back)."""
    n, dtype = 2, DTYPES["int64"]
    bufs = [np.array([2**61 + 1, 2**62 - 1], np.int64) for _ in range(n)]
    bufs[1][1] = 2**62 - 3  # sum 2**63 - 4 still fits; average 2**62 - 2
    machines = [build("allreduce", r, n, bufs[r], dtype, "avg") for r in range(n)]
    Network(machines, seed=0).run()
    assert bufs[0].tolist() == [2**61 + 1, 2**62 - 2]


# --------------------------------------------------------------------------------------------
# Allreduce over shared windows


class LateInput(SharedAllreduce):
    """Its buffer holds garbage until the rank starts: reading a peer before READY shows."""

    def __init__(self, *args: object, data: np.ndarray) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.data = data

    def start(self) -> list[Send]:
        self.buffer[:] = self.data
        return super().start()


@dataclass
class ReleasingNetwork(Network):
    """A rank's caller scribbles over its buffer the moment the rank is done (as a caller
    may), keeping a copy of the result: a peer still reading it afterwards gets garbage."""

    results: dict[int, np.ndarray] = field(default_factory=dict)

    def _settled(self, rank: int) -> None:
        super()._settled(rank)
        machine = self.machines[rank]
        assert isinstance(machine, SharedAllreduce)
        if machine.done and rank not in self.results:
            self.results[rank] = machine.buffer.copy()
            machine.buffer.view(np.uint8)[:] = 0x5A


def shared_machines(
    n: int,
    data: list[np.ndarray],
    dtype: DType,
    op: str,
    rng: np.random.Generator,
    segment_bytes: int = SEGMENT_BYTES,
    memory: str = "window",
    pool: CorePool | None = None,
) -> list[SharedAllreduce]:
    """One rank each, its buffer at a random aligned offset of a larger window. ``memory``:
    how the peers read it, in the window (``WindowMemory``) or by cross-memory attach
    (``CrossMemory``, reading this very process, in random small pieces)."""
    itemsize = data[0].itemsize
    windows, placed = [], []
    for r in range(n):
        offset = int(rng.integers(0, 4)) * itemsize
        window = np.full(offset + data[r].nbytes + int(rng.integers(0, 9)), 0xA5, np.uint8)
        windows.append(window)
        placed.append((offset, window[offset : offset + data[r].nbytes].view(data[r].dtype)))
    piece = int(rng.choice([8, 24, 4096, cma.PIECE_BYTES]))
    pids = {p: os.getpid() for p in range(n)}

    def peers(r: int, offset: int, buf: np.ndarray) -> tuple[int, PeerMemory]:
        if memory == "window":
            return offset, WindowMemory({p: windows[p] for p in range(n) if p != r})
        return CrossMemory.announce(buf), CrossMemory(pids, piece)

    return [
        LateInput(r, n, buf, dtype, op, *peers(r, offset, buf), pool, segment_bytes,
                  data=data[r])  # fmt: skip
        for r, (offset, buf) in enumerate(placed)
    ]


@fast(250)
@segmented_allreduces
def test_shared_allreduce(
    n: int, count: int, segment_bytes: int, op: str, dtype_name: str, seed: int
) -> None:
    check_shared_allreduce(n, count, segment_bytes, op, dtype_name, seed, "window")


@fast(150)
@segmented_allreduces
def test_cross_memory_allreduce(
    n: int, count: int, segment_bytes: int, op: str, dtype_name: str, seed: int
) -> None:
    """The same algorithm reading the peers' buffers with process_vm_readv (of this process)."""
    check_shared_allreduce(n, count, segment_bytes, op, dtype_name, seed, "cma")


def check_shared_allreduce(
    n: int, count: int, segment_bytes: int, op: str, dtype_name: str, seed: int, memory: str
) -> None:
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(seed, n, count, dtype_name, op)
    want = reduce_expected(inputs, dtype_name, op, n)
    data = [to_storage(x, dtype_name) for x in inputs]
    rng = np.random.default_rng(seed)
    machines = shared_machines(n, data, dtype, op, rng, segment_bytes, memory)
    net = ReleasingNetwork(machines, seed).run()  # type: ignore[arg-type]
    for r, m in enumerate(machines):
        net.results.setdefault(r, m.buffer.copy())  # a world of one is done at once
    check_allreduce([net.results[r] for r in range(n)], want, dtype_name)
    # READY and RELEASED to every peer, and one REDUCED per segment of its own chunk
    sizes = [b - a for a, b in split(count, n)]
    sent = [(n - 1) * (2 + nsegs(sizes[r], segment_bytes, dtype)) for r in range(n)]
    assert net.sent_by == sent, (net.sent_by, sent)


@pytest.mark.parametrize("memory", ["window", "cma"])
@pytest.mark.parametrize(("dtype_name", "op"), [("float32", "sum"), ("bfloat16", "avg"),
                                                ("float64", "max"), ("int64", "prod")])
def test_shared_allreduce_is_bitwise_the_same_whatever_the_pool(
    memory: str, dtype_name: str, op: str
) -> None:
    """Issue 38: the same allreduce (4 ranks, segments of 4 KiB) with no pool and with pools
    of 1 and 3 threads cutting each segment into pieces of 64 bytes: the same bits on every
    rank in every case, and the pool really took pieces (its threads ran some)."""
    count, n, seed = 5003, 4, 11
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(seed, n, count, dtype_name, op)
    data = [to_storage(x, dtype_name) for x in inputs]
    results = {}
    for size in (0, 1, 3):
        pool = CorePool(size, min_piece_bytes=64) if size else None
        seen: set[str] = set()
        if pool is not None:
            run = pool.run

            def counting(work: Any, a: int, b: int, itemsize: int, run: Any = run,
                         seen: set[str] = seen) -> None:  # fmt: skip
                run(lambda x, y: (seen.add(threading.current_thread().name), work(x, y)),
                    a, b, itemsize)  # fmt: skip

            pool.run = counting  # type: ignore[method-assign]
        machines = shared_machines(n, data, dtype, op, np.random.default_rng(seed), 4096,
                                   memory, pool)  # fmt: skip
        net = ReleasingNetwork(machines, seed).run()  # type: ignore[arg-type]
        results[size] = [net.results[r].tobytes() for r in range(n)]
        assert len(set(results[size])) == 1, f"ranks differ with a pool of {size}"
        if pool is not None:
            assert any(name.startswith("asyncreduce-core") for name in seen), seen
            pool.close()
    assert results[0] == results[1] == results[3]


@pytest.mark.parametrize(("dtype_name", "op"), [("float32", "sum"), ("bfloat16", "avg")])
def test_the_ring_is_bitwise_the_same_whatever_the_pool(dtype_name: str, op: str) -> None:
    """The ring (the arenas' and TCP's large allreduce) with pools of 0, 1 and 3 threads
    taking 64-byte pieces of each 4 KiB segment it combines: the same bits everywhere."""
    n, count, seed = 5, 3001, 5
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(seed, n, count, dtype_name, op)
    results = {}
    for size in (0, 1, 3):
        pool = CorePool(size, min_piece_bytes=64) if size else None
        buffers = [to_storage(x, dtype_name) for x in inputs]
        machines: list[Collective] = [
            Ring(r, n, buffers[r], dtype, op, True, segment_bytes=4096, pool=pool)
            for r in range(n)
        ]
        Network(machines, seed).run()
        results[size] = [b.tobytes() for b in buffers]
        assert len(set(results[size])) == 1
        if pool is not None:
            pool.close()
    assert results[0] == results[1] == results[3]


def test_the_pool_cuts_a_range_into_whole_pieces_and_passes_errors_on() -> None:
    pool = CorePool(3, min_piece_bytes=1024)
    try:
        assert pool.pieces(0, 100, 8) == [(0, 100)]  # 800 bytes: no piece to lend
        assert pool.pieces(10, 1010, 8) == [(10, 260), (260, 510), (510, 760), (760, 1010)]
        assert pool.pieces(0, 300, 8) == [(0, 150), (150, 300)]  # 2400 bytes: 2 pieces
        done = np.zeros(1000, np.int64)
        pool.run(lambda a, b: done.__setitem__(slice(a, b), done[a:b] + 1), 0, 1000, 8)
        assert (done == 1).all()  # every element once

        def fail(a: int, b: int) -> None:
            if a > 0:
                raise ValueError(f"piece {a}")

        with pytest.raises(ValueError, match="piece"):
            pool.run(fail, 0, 1000, 8)
    finally:
        pool.close()
    assert CorePool(0).pieces(0, 10**6, 8) == [(0, 10**6)]


def test_build_takes_the_shared_window_when_given() -> None:
    buf, windows = np.zeros(4, np.float32), WindowMemory({1: np.zeros(16, np.uint8)})
    machine = build("allreduce", 0, 2, buf, DTYPES["float32"], "sum", shared=(0, windows))
    assert isinstance(machine, SharedAllreduce)
    assert isinstance(build("allreduce", 0, 2, buf, DTYPES["float32"], "sum"), RecursiveDoubling)


@pytest.mark.parametrize("offset", [16, 2, 2**63])
def test_shared_allreduce_refuses_a_buffer_outside_the_peers_window(offset: int) -> None:
    """A READY naming bytes past the end of the peer's window, or misaligned, is refused."""
    dtype = DTYPES["float32"]
    machine = SharedAllreduce(0, 2, np.zeros(4, np.float32), dtype, "sum", 0,
                              WindowMemory({1: np.zeros(24, np.uint8)}))  # fmt: skip
    machine.start()
    target = machine.recv_buffer(1, 0, 0, 8)
    target[:] = np.frombuffer(np.array([offset], "<u8").tobytes(), np.uint8)
    with pytest.raises(ProtocolError, match="window"):
        machine.on_message(1, 0, 0, target)


def test_shared_allreduce_refuses_malformed_messages() -> None:
    dtype = DTYPES["float32"]
    windows = WindowMemory({1: np.zeros(16, np.uint8), 2: np.zeros(16, np.uint8)})
    machine = SharedAllreduce(0, 3, np.zeros(4, np.float32), dtype, "sum", 0, windows)
    machine.start()
    bad = [(0, 0, 0, 8), (3, 0, 0, 8), (1, 3, 0, 0), (1, 0, 1, 8), (1, 0, 0, 7), (1, 1, 0, 4),
           (1, 1, 1, 0), (1, 2, 1, 0)]  # fmt: skip
    for src, step, seg, nbytes in bad:
        with pytest.raises(ProtocolError):
            machine.recv_buffer(src, step, seg, nbytes)
    machine.on_message(1, 1, 0, machine.recv_buffer(1, 1, 0, 0))
    with pytest.raises(ProtocolError, match="twice"):
        machine.recv_buffer(1, 1, 0, 0)


# --------------------------------------------------------------------------------------------
# Cross-memory attach


_HOLDER = """
import sys
import numpy as np
token = np.frombuffer(bytes.fromhex(sys.argv[1]), np.uint8).copy()
print(token.ctypes.data, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def holding(token: bytes) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A child process that holds ``token`` in its memory: (the process, the address)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, token.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        yield holder, int(holder.stdout.readline())
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
        holder.stdout.close()


def test_cross_memory_reads_another_process_and_refuses_what_it_cannot() -> None:
    """probe/read_into on a real child process: its token reads back; a wrong token, a dead
    process or an address it does not map is refused, never a crash."""
    token = os.urandom(16)
    with holding(token) as (holder, address):
        assert cma.probe(holder.pid, address, token) is None
        assert "other bytes" in str(cma.probe(holder.pid, address, os.urandom(16)))
        assert cma.probe(holder.pid, 8, token) is not None  # the zero page: not mapped
        assert cma.owned_by_me(holder.pid) and not cma.owned_by_me(os.getpid())
        out = np.zeros(16, np.uint8)
        with pytest.raises(OSError):
            cma.read_into(holder.pid, out.ctypes.data, 8, 16)
    assert cma.probe(holder.pid, address, token) is not None  # it is gone


def test_the_cross_memory_check_refuses_a_peer_that_names_another_process() -> None:
    """At init a rank reads back the challenge it sent each peer, from the pid that peer
    announced: only a process that got the challenge holds it; our own pid, a repeated pid, a
    process of nobody or one that holds other bytes are refused, naming the peer."""
    challenge = os.urandom(16)
    me = os.getpid()
    with holding(challenge) as (holder, address):
        at = [b"", struct.pack("<Q", address)]  # rank 1 says: my challenges start there
        assert _unreadable(0, {0: me, 1: holder.pid}, at, [b"", challenge]) is None
        wrong = _unreadable(0, {0: me, 1: holder.pid}, at, [b"", os.urandom(16)])
        assert wrong is not None and "rank 1" in wrong
        assert "same process" in str(_unreadable(0, {0: me, 1: me}, at, [b"", challenge]))
        gone = _unreadable(0, {0: me, 1: 2**22 + 12345}, at, [b"", challenge])
        assert gone is not None and "rank 1" in gone


def test_cross_memory_refuses_a_misaligned_or_unknown_buffer() -> None:
    memory = CrossMemory({1: os.getpid()})
    like = np.zeros(4, np.float32)
    with pytest.raises(ProtocolError):
        memory.buffer(1, CrossMemory.announce(like) + 2, like)
    with pytest.raises(ProtocolError):
        memory.buffer(2, CrossMemory.announce(like), like)


# --------------------------------------------------------------------------------------------
# Direct exchange (gather, scatter, all-to-all, point-to-point) and groups


@fast(150)
@given(
    n=st.integers(1, 9),
    sizes=st.lists(st.integers(0, 300), min_size=81, max_size=81),
    segment_bytes=st.sampled_from([1, 64, SEGMENT_BYTES]),
    seed=seeds,
)
def test_exchange_delivers_every_buffer_whole(
    n: int, sizes: list[int], segment_bytes: int, seed: int
) -> None:
    """An all-to-all-v: rank i sends sizes[i*9+j] float32 to rank j, each value naming its
    source, destination and index; random delivery order, segments down to one byte."""
    from asyncreduce.algorithms import exchange

    def payload(i: int, j: int) -> np.ndarray:
        count = sizes[i * 9 + j]
        return (i * 1_000_000 + j * 1000 + np.arange(count)).astype(np.float32)

    inboxes = [{j: np.zeros(sizes[j * 9 + i], np.float32) for j in range(n) if j != i}
               for i in range(n)]  # fmt: skip
    original = exchange.SEGMENT_BYTES
    exchange.SEGMENT_BYTES = segment_bytes
    try:
        machines = [
            exchange.Exchange(i, n, {j: payload(i, j) for j in range(n) if j != i}, inboxes[i])
            for i in range(n)
        ]
        Network(machines, seed).run()  # (every source names its segments alike: no probe)
    finally:
        exchange.SEGMENT_BYTES = original
    for i in range(n):
        assert all(m.done for m in machines)
        for j, got in inboxes[i].items():
            assert np.array_equal(got, payload(j, i)), f"rank {i} from {j}"


@pytest.mark.parametrize(("sent", "expected"), [(3, 5), (5, 3), (5, 4)])
def test_exchange_of_another_size_is_a_protocol_error(sent: int, expected: int) -> None:
    """The receiver learns at the first segment that disagrees, never waits for more."""
    from asyncreduce.algorithms import exchange

    original = exchange.SEGMENT_BYTES
    exchange.SEGMENT_BYTES = 8  # two float32 a segment
    try:
        sender = exchange.Exchange(0, 2, {1: np.zeros(sent, np.float32)}, {})
        receiver = exchange.Exchange(1, 2, {}, {0: np.zeros(expected, np.float32)})
        with pytest.raises(ProtocolError):
            for s in sender.start():
                target = receiver.recv_buffer(0, s.step, s.seg, s.payload.nbytes)
                target[...] = s.payload.view(target.dtype)
                receiver.on_message(0, s.step, s.seg, target)
            if not receiver.done:  # every segment came, and it still waits: the sizes differ
                raise ProtocolError("incomplete")
    finally:
        exchange.SEGMENT_BYTES = original


@fast(80)
@given(world=st.integers(2, 9), data=st.data(), op=ops, seed=seeds)
def test_a_group_allreduce_over_the_ranks_of_a_bigger_world(
    world: int, data: st.DataObject, op: str, seed: int
) -> None:
    """A group of some ranks (in any order) runs its algorithms in its own numbering; the
    wire between the members sees only the world's ranks."""
    from asyncreduce.algorithms import Translated

    members = data.draw(st.permutations(range(world)).map(lambda p: p[: max(1, len(p) // 2)]))
    n = len(members)
    inputs = make_inputs(seed, n, 13, "float64", op)
    buffers = [to_storage(x, "float64") for x in inputs]
    machines: list[Collective | None] = [None] * world
    for g, member in enumerate(members):
        inner = build("allreduce", g, n, buffers[g], DTYPES["float64"], op)
        machines[member] = Translated(inner, members, member, world)
    idle = [m for m in range(world) if m not in members]
    for m in idle:  # ranks outside the group take no part: stand-ins that expect nothing
        machines[m] = Barrier(0, 1)
    net = Network([m for m in machines if m is not None], seed)
    net.must_start = lambda rank: set(members)  # the idle ranks need not have started
    net.run()
    check_allreduce(buffers, reduce_expected(inputs, "float64", op, n), "float64")
    for m in idle:
        assert net.sent_by[m] == 0 and net.received_by[m] == 0


def _run_directly(
    algos: list[RunsDirectly],
    streams: dict[tuple[int, int], list[tuple[int, np.ndarray]]] | None = None,
    started: bool = False,
) -> tuple[list[set[int]], list[set[int]]]:
    """Every rank's algorithm run as ``Engine.run_direct`` runs it: sends in order on FIFO streams,
    each rank reading only the stream of the message it awaits, and only when that message
    is the stream's next (else it would hand the run to the engine). Returns the ranks each
    received from and sent to. ``started``: the algorithms went on from swaps, whose
    messages in flight are on ``streams`` ((from, to): [(step, payload), ...])."""
    n = len(algos)
    streams = {} if streams is None else streams
    got: list[set[int]] = [set() for _ in range(n)]
    sent: list[set[int]] = [set() for _ in range(n)]

    def post(src: int, sends: list[Send]) -> None:
        for s in sends:
            assert s.seg == 0 and s.payload.nbytes == algos[src].message_bytes
            streams.setdefault((src, s.dst), []).append((s.step, s.payload.copy()))
            sent[src].add(s.dst)

    for r in range(n):
        if not started:
            post(r, algos[r].start())
    while any(a.awaited is not None for a in algos):
        moved = False
        for r, algo in enumerate(algos):
            if algo.awaited is None:
                continue
            peer, step = algo.awaited
            stream = streams.get((peer, r))
            if stream:
                head_step, payload = stream.pop(0)
                assert head_step == step, (r, peer, head_step, step)  # the next is the awaited
                got[r].add(peer)
                post(r, algo.on_view(peer, step, 0, memoryview(payload).cast("B")))
                moved = True
        assert moved, "no rank could go on: a direct run would wait for ever"
    assert not any(streams.values()), "a message nobody read"
    return got, sent


@pytest.mark.parametrize("n", range(2, 10))
def test_direct_runs_read_only_the_awaited_streams_and_complete(n: int) -> None:
    """The contract ``Engine.run_direct`` relies on (``RunsDirectly``): each rank's next message is
    the next one on the awaited stream, every rank completes, ``sources`` are the ranks it
    reads and ``partners`` those and the ranks it sends to; a sum comes out exact."""
    f32 = DTYPES["float32"]
    doubling = [RecursiveDoubling(r, n, np.full(5, r + 1.0, np.float32), f32, "sum")
                for r in range(n)]  # fmt: skip
    stand_ins = [DirectAllreduce(r, n, np.full(5, r + 1.0, np.float32), f32, "sum")
                 for r in range(n)]  # fmt: skip
    for algos in ([Barrier(r, n) for r in range(n)], doubling, stand_ins):
        got, sent = _run_directly(algos)
        for r, algo in enumerate(algos):
            assert algo.done and algo.sources == got[r], (type(algo).__name__, r)
            assert algo.partners == got[r] | sent[r], (type(algo).__name__, r)
    for algo in doubling + stand_ins:
        assert np.all(algo.buffer == n * (n + 1) / 2)


def _swaps_then_directly(algos: list[RunsDirectly], done: int) -> list[RunsDirectly]:
    """Every rank runs the first ``done`` of its ``swaps`` as ``Engine._exchange`` does (in
    lockstep here: each swap sends the buffer as it is, and combines the partner's as it
    was), sends the next swap's message, says ``swapped(done)``, and goes on message by
    message (``_run_directly``)."""
    streams: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
    for i in range(done):
        sent = [np.array(a.combining.into).copy() if a.combining else None for a in algos]
        for r, algo in enumerate(algos):
            peer, step, incoming_first = algo.swaps[i]
            assert algos[peer].swaps[i][:2] == (r, step), "swaps are not pairwise"
            if algo.combining is not None:
                assert incoming_first == (peer < r)  # (the lower rank's operand first)
                c, acc = algo.combining, algo.buffer
                incoming = np.frombuffer(sent[peer].tobytes(), acc.dtype)
                combine(algo.dtype, algo.reduce_op, acc, incoming, incoming_first)
                assert c.dtype == algo.dtype.code and c.into.nbytes == acc.nbytes
    for r, algo in enumerate(algos):
        if done < len(algo.swaps):
            peer, step, _ = algo.swaps[done]
            payload = np.array(algo.combining.into).copy() if algo.combining else np.empty(0)
            streams.setdefault((r, peer), []).append((step, payload))
        assert algo.swapped(done) == []
    _run_directly(algos, streams, started=True)
    return algos


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_swaps_then_messages_agree_bitwise_with_messages_alone(n: int, op: str) -> None:
    """A direct run's swaps (``RunsDirectly.swaps``, a power of two ranks), stopped after any
    number of them (the rest taken over message by message, as when a swap's partner is not
    there yet), give the bits of the algorithm run message by message alone, with random
    floats whose sums depend on the order of operations; so does a barrier's."""
    rng = np.random.default_rng(n)
    f32 = DTYPES["float32"]
    inputs = [(rng.standard_normal(33) * 10.0 ** rng.integers(-3, 4, 33)).astype(np.float32)
              for _ in range(n)]  # fmt: skip
    alone = [RecursiveDoubling(r, n, inputs[r].copy(), f32, op) for r in range(n)]
    _run_directly(alone)  # type: ignore[arg-type]
    rounds = n.bit_length() - 1
    for done in range(rounds + 1):
        swapped = [RecursiveDoubling(r, n, inputs[r].copy(), f32, op) for r in range(n)]
        assert all(len(a.swaps) == rounds for a in swapped)
        _swaps_then_directly(swapped, done)  # type: ignore[arg-type]
        for r in range(n):
            assert swapped[r].done
            assert swapped[r].buffer.tobytes() == alone[r].buffer.tobytes(), (done, r)
        barriers = _swaps_then_directly([Barrier(r, n) for r in range(n)], done)
        assert all(b.done for b in barriers)
        stand_ins = [DirectAllreduce(r, n, inputs[r].copy(), f32, op) for r in range(n)]
        _swaps_then_directly(stand_ins, done)  # type: ignore[arg-type]
        for r, stand_in in enumerate(stand_ins):  # the algorithm made only where swaps stop
            assert stand_in.done and (stand_in._algorithm is None) == (done == rounds)
            assert stand_in.buffer.tobytes() == alone[r].buffer.tobytes(), (done, r)
            made = stand_in.algorithm  # (asked for after all: done, nothing combined again)
            assert made.done and made.awaited is None and made.pending_sources == set()
            assert stand_in.buffer.tobytes() == alone[r].buffer.tobytes(), (done, r)


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_only_a_power_of_two_ranks_swap(n: int) -> None:
    """Elsewhere a rank sits out or sends one way: message by message only."""
    f32 = DTYPES["float32"]
    for r in range(n):
        algo = RecursiveDoubling(r, n, np.ones(4, np.float32), f32, "sum")
        assert algo.swaps is None and Barrier(r, n).swaps is None
        with pytest.raises(ProtocolError):
            algo.swapped(0)
    assert Barrier(0, 1).swaps is None
    assert RecursiveDoubling(0, 1, np.ones(1, np.float32), f32, "sum").swaps is None
