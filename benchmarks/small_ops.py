"""Small ops: where a small allreduce's time goes (the floor, the protocol, the call, the whole).

Issue 15 asks why a 4 KiB allreduce costs tens of microseconds here when Open MPI's costs a
few. This benchmark takes one apart, on one host over TCP, each part measured on its own:

* **floor**: two Python processes sending the payload back and forth over a loopback TCP
  connection, nothing else: busy-polling non-blocking reads, and blocking reads (each one a
  wake-up). No
  engine written in Python on TCP can be faster than the first.
* **lane alone**: the same-host lane's whole calls, in one thread: two communicators over
  mailboxes in plain memory take turns (one posts with ``iallreduce`` and waits, the other
  makes the blocking ``allreduce``, which runs on its thread: ``Lane.run_waiting``), so nothing
  waits for another core: what our Python costs per rank per operation on that path; with the C
  mailbox (where it was built) and with the Python one.
* **protocol**: our protocol alone, in one thread: two ``Session`` objects post the allreduce,
  hand each other their frames (packed and parsed headers) and complete it. No socket, no
  thread: the CPU the protocol itself costs per rank per operation (the operations are built
  before the clock starts: that is the call's part).
* **call**: the posting thread's part, ``iallreduce`` up to the engine's queue (the engine's
  ``submit`` replaced by one that completes the request at once, after the real runs).
* **whole**: ``allreduce`` in a loop on N real ranks (``asyncreduce run``): the latency, and the
  CPU each rank's process used per operation (all its threads), through the same-host lane
  (the default: shared-memory mailboxes, no frame), through the engine with the progress
  thread's busy-poll (``ASYNCREDUCE_LANE=0``: a blocking one runs on its caller's thread,
  its frames straight through the sockets, around the protocol's events: ``Engine.run_direct``),
  and through the engine without it (``ASYNCREDUCE_SPIN_US=0``, which turns the lane off
  too: every operation goes through the protocol and the progress thread).

Run: ``asyncreduce bench small_ops [--size 4K] [--nprocs 2,4] [--json FILE]``. The numbers are
medians of ``--repeats`` runs; absolute values differ several-fold between machines, so read
the parts against each other and against ``bench allreduce``'s Open MPI columns.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

_ROUNDS = 2000  # operations per measurement
_WARMUP = 200
_MARK = "SMALL_OPS "  # prefixes the one line a rank of ``whole`` reports
_PATHS = (  # the whole allreduce's paths: variables, key, label
    ({}, "lane", "same-host lane"),
    ({"ASYNCREDUCE_LANE": "0"}, "spin", "engine, busy-polling"),
    ({"ASYNCREDUCE_SPIN_US": "0"}, "sleep", "engine, sleeping, SPIN_US=0"),
)


def floor_us(nbytes: int, busy: bool) -> float:
    """Microseconds per round trip of ``nbytes`` each way between two processes over TCP:
    this process sends and then receives, the other receives and then sends back."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the peer: answer every message, as many as the parent sends
        server.close()
        peer = socket.create_connection(("127.0.0.1", port))
        _round_trips(peer, nbytes, busy, _WARMUP + _ROUNDS, answer=True)
        os._exit(0)
    conn, _ = server.accept()
    server.close()
    _round_trips(conn, nbytes, busy, _WARMUP, answer=False)
    start = time.perf_counter()
    _round_trips(conn, nbytes, busy, _ROUNDS, answer=False)
    elapsed = time.perf_counter() - start
    conn.close()
    os.waitpid(pid, 0)
    return elapsed / _ROUNDS * 1e6


def _round_trips(sock: socket.socket, nbytes: int, busy: bool, count: int, answer: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(not busy)
    out, into = memoryview(bytes(nbytes)), memoryview(bytearray(nbytes))
    for _ in range(count):
        if not answer:
            _send_all(sock, out)
        got = 0
        while got < nbytes:
            try:
                n = sock.recv_into(into[got:])
            except BlockingIOError:
                continue
            if n == 0:
                raise ConnectionError("the peer of the TCP floor closed early")
            got += n
        if answer:
            _send_all(sock, out)


def _send_all(sock: socket.socket, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            continue


def protocol_us(nbytes: int, world: int = 2) -> float:
    """CPU microseconds per rank per allreduce of our protocol alone (see the docstring): the
    operations are built before the clock starts (that is the posting call's part)."""
    from asyncreduce.algorithms import build
    from asyncreduce.buffers import as_buffer
    from asyncreduce.flight import FlightRecorder
    from asyncreduce.plans import Plan
    from asyncreduce.protocol import Operation, Session, Settings
    from asyncreduce.protocol.commands import FINISH, SEND
    from asyncreduce.protocol.wire import describe
    from asyncreduce.request import CallbackRunner, Request
    from asyncreduce.transport.frame import HEADER, parse_header

    runner = CallbackRunner("small-ops")
    sessions = [
        Session(r, world, Settings(), FlightRecorder(r, world, 1000, describe), time.monotonic())
        for r in range(world)
    ]
    buffers = [as_buffer(np.ones(nbytes // 4, np.float32), "x") for _ in range(world)]

    def operation(r: int, i: int) -> Operation:
        buf = buffers[r]  # reduced with max: the values stay 1.0 however often
        plan = Plan("allreduce", buf, lambda: None, "max", 0)
        algo = build("allreduce", r, world, buf.flat, buf.dtype, "max", 0)
        request: Request[Any] = Request(f"allreduce #{i}", runner)
        return Operation((b"", i), "allreduce", plan.descriptor(0, buf.dtype.code), request,
                         plan.result, None, algo)  # fmt: skip

    def deliver(src: int, command: tuple[Any, ...]) -> None:
        _, dst, head, payload, _, token, _ = command
        name_len, header = parse_header(memoryview(head)[: HEADER.size])
        header.name = bytes(head[HEADER.size : HEADER.size + name_len])
        peer, now = sessions[dst], time.monotonic()
        if not peer.on_view(src, header, payload, now):
            target = peer.buffer_for(src, header) or memoryview(bytearray(len(payload)))
            target[:] = payload
            peer.on_frame(src, header, target, now)
        sessions[src].sent(token)

    def one(ops: list[Operation]) -> None:
        for session, op in zip(sessions, ops, strict=True):
            session.post(op, time.monotonic())
        moved = True
        while moved:
            moved = False
            for r, session in enumerate(sessions):
                while session.commands:
                    command, moved = session.commands.pop(0), True
                    if command[0] == SEND:
                        deliver(r, command)
                    elif command[0] == FINISH:
                        command[1].request.set_result(command[2])

    rounds = [[operation(r, i) for r in range(world)] for i in range(_WARMUP + _ROUNDS)]
    for ops in rounds[:_WARMUP]:
        one(ops)
    start = time.process_time()
    for ops in rounds[_WARMUP:]:
        one(ops)
    elapsed = time.process_time() - start
    runner.close()
    return elapsed / _ROUNDS / world * 1e6


class _NoEngine:
    """What a communicator over the lane asks of its engine when nothing fails: nothing."""

    lane = None
    flight = None  # (nothing recorded)

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def refusal(self, label: str, goodbyes: bool = True, key: object = None) -> None:
        return None

    def nudge(self) -> None:
        pass

    def take_lane(self, lane: object) -> None:
        self.lane = lane

    def close(self) -> None:
        pass


def lane_us(nbytes: int, world: int = 2, native: bool = True) -> float:
    """CPU microseconds per rank per allreduce through the same-host lane, the whole calls,
    in one thread: ``world`` communicators over mailboxes in plain memory take turns (every
    rank but 0 posts with ``iallreduce``, rank 0's blocking ``allreduce`` completes on its
    thread, which ``Lane.run_waiting`` does where the peers are there, the others wait), so
    no core waits for another and nothing but our Python is timed. ``native``: with the C
    mailbox where it was built (else, and with False, the Python one)."""
    from asyncreduce.backends.native import NativeBackend
    from asyncreduce.comm import Communicator
    from asyncreduce.samehost.mailbox import native_wanted, open_mailbox, region_bytes
    from asyncreduce.samehost.planes import SharedPlanes

    regions = [np.zeros(region_bytes(), np.uint8) for _ in range(world)]
    comms = []
    for r in range(world):
        backend = NativeBackend(_NoEngine(r, world), r, world, SharedPlanes(False, None))  # type: ignore[arg-type]
        peers = {p: regions[p] for p in range(world) if p != r}
        backend.open_lane(open_mailbox(r, regions[r], peers, native and native_wanted()))
        comms.append(Communicator(r, world, backend))
    xs = [np.ones(nbytes // 4, np.float32) for _ in range(world)]

    def one() -> None:
        posted = [comm.iallreduce(x, "max") for comm, x in zip(comms[1:], xs[1:], strict=True)]
        comms[0].allreduce(xs[0], "max")
        for request in posted:
            request.wait()

    for _ in range(_WARMUP):
        one()
    start = time.process_time()
    for _ in range(_ROUNDS):
        one()
    elapsed = time.process_time() - start
    for comm in comms:
        comm.close()
    return elapsed / _ROUNDS / world * 1e6


def whole(nbytes: int, nprocs: int, setting: dict[str, str], call: bool) -> dict[str, float]:
    """Latency and CPU per rank per operation from N real ranks under ``asyncreduce run``
    with the variables ``setting``; with ``call``, also the posting call alone (rank 0,
    afterwards)."""
    env = {**os.environ, **setting}
    command = [sys.executable, "-m", "asyncreduce", "run", "-n", str(nprocs), __file__,
               "--rank", str(nbytes)] + (["--call"] if call else [])  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if _MARK in x]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")
    return dict(json.loads(lines[0].split(_MARK, 1)[1]))


def rank_main(nbytes: int, call: bool) -> None:
    """One rank of ``whole``: allreduce in a loop, then (rank 0, with ``call``) the posting
    call alone, with the engine's ``submit`` replaced by one that completes at once."""
    import asyncreduce as ar

    with ar.init(timeout=120) as comm:
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(_WARMUP):
            comm.allreduce(x, "max")
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(_ROUNDS):
            comm.allreduce(x, "max")
        latency = (time.perf_counter() - start) / _ROUNDS * 1e6
        result = {"latency_us": latency, "cpu_us": (time.process_time() - cpu) / _ROUNDS * 1e6}
        comm.barrier()
        if comm.rank != 0:
            time.sleep(0.5)  # rank 0 may still time the call; its engine is not told we left
            os._exit(0)
        if call:
            engine = comm._backend.engine
            assert engine is not None
            engine.submit = lambda op: op.request.set_result(None)  # type: ignore[method-assign]
            start = time.perf_counter()
            for _ in range(_ROUNDS):
                comm.iallreduce(x, "max", name="call")
            result["call_us"] = (time.perf_counter() - start) / _ROUNDS * 1e6
        print(_MARK + json.dumps(result), flush=True)
        os._exit(0)  # the engine no longer runs what is posted: do not close in order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncreduce bench small_ops", description=__doc__
                                     .splitlines()[0])  # fmt: skip
    parser.add_argument("--size", type=harness.parse_size, default=4096,
                        help="payload (bytes, or 4K, 64K, ...; default 4K)")  # fmt: skip
    parser.add_argument("--nprocs", type=harness.nprocs_list, default=[2, 4],
                        help="world sizes for the whole allreduce (default 2,4)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="runs per part (median)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a worker: nbytes
    parser.add_argument("--call", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.call)
        return 0
    began, nbytes = time.perf_counter(), args.size
    machine = {**harness.machine_info(), "library": harness.library_state()}
    load = harness.LoadWatch()
    rows: list[tuple[str, str, float]] = []  # (key, label, microseconds)

    def median(fn: Any, *a: Any) -> float:
        return statistics.median(fn(*a) for _ in range(args.repeats))

    rows.append(("floor_busy", "floor: Python TCP round trip, busy-polling",
                 median(floor_us, nbytes, True)))  # fmt: skip
    rows.append(("floor_blocking", "floor: Python TCP round trip, blocking reads",
                 median(floor_us, nbytes, False)))  # fmt: skip
    rows.append(("protocol_cpu", "protocol alone, CPU per rank (2 Sessions, 1 thread)",
                 median(protocol_us, nbytes)))  # fmt: skip
    rows.append(("lane_cpu", "same-host lane, whole call, CPU per rank (2 ranks, 1 thread)",
                 median(lane_us, nbytes)))  # fmt: skip
    rows.append(("lane_python_cpu", "  the same with the Python mailbox (ASYNCREDUCE_NATIVE=0)",
                 median(lane_us, nbytes, 2, False)))  # fmt: skip
    for n in args.nprocs:
        for setting, tag, what in _PATHS:
            call = n == args.nprocs[0] and tag == "spin"  # the call once: it has no peers
            runs = [whole(nbytes, n, setting, call) for _ in range(args.repeats)]
            for key, label in (("latency_us", "latency"), ("cpu_us", "CPU per rank")):
                rows.append((f"n{n}_{tag}_{key[:-3]}", f"whole allreduce N={n}, {what}: {label}",
                             statistics.median(r[key] for r in runs)))  # fmt: skip
            if call:
                rows.append(("call", "posting call (iallreduce up to the engine's queue)",
                             statistics.median(r["call_us"] for r in runs)))  # fmt: skip
    machine.update(load.ended())
    print(harness.machine_line(machine))
    print(f"where a {harness.format_size(nbytes)} float32 allreduce's time goes (one host; the "
          f"engine over loopback TCP; median of {args.repeats})")  # fmt: skip
    width = max(len(label) for _, label, _ in rows)
    print(f"{'part':<{width}}  {'us':>8}")
    for _, label, value in rows:
        print(f"{label:<{width}}  {value:8.1f}")
    if args.json:
        document = harness.json_head("small_ops", argv, time.perf_counter() - began, machine)
        document.update(bytes=nbytes, repeats=args.repeats,
                        us={key: value for key, _, value in rows})  # fmt: skip
        harness.save_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
