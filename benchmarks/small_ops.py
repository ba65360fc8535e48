"""Small ops: where a small allreduce's time goes (the floor, the protocol, the call, the whole).

Issue 15 asks why a 4 KiB allreduce costs tens of microseconds here when Open MPI's costs a
few. This benchmark takes one apart, on one host over TCP, each part measured on its own:

* **floor**: two Python processes exchanging the payload over a loopback TCP connection, with
  nothing else: busy-polling non-blocking reads, and blocking reads (each one a wake-up). No
  engine written in Python on TCP can be faster than the first.
* **protocol**: our protocol alone, in one thread: two ``Session`` objects post the allreduce,
  hand each other their frames (packed and parsed headers) and complete it. No socket, no
  thread: the CPU the protocol itself costs per rank per operation.
* **call**: the posting thread's part, ``iallreduce`` up to the engine's queue (the engine's
  ``submit`` replaced by one that completes the request at once, after the real runs).
* **whole**: ``allreduce`` in a loop on N real ranks (``asyncreduce run``): the latency, and the
  CPU each rank's process used per operation (all its threads), with the progress thread's
  busy-poll (``ASYNCREDUCE_SPIN_US`` default) and without it (0).

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

_ROUNDS = 2000  # operations per measurement


def floor_us(nbytes: int, busy: bool) -> float:
    """Microseconds per exchange of ``nbytes`` each way between two processes over TCP."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the peer: echo back, forever until the parent closes
        server.close()
        peer = socket.create_connection(("127.0.0.1", port))
        _exchanges(peer, nbytes, busy, _ROUNDS + 200)
        os._exit(0)
    conn, _ = server.accept()
    server.close()
    _exchanges(conn, nbytes, busy, 200)
    start = time.perf_counter()
    _exchanges(conn, nbytes, busy, _ROUNDS)
    elapsed = time.perf_counter() - start
    conn.close()
    os.waitpid(pid, 0)
    return elapsed / _ROUNDS * 1e6


def _exchanges(sock: socket.socket, nbytes: int, busy: bool, count: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(not busy)
    out, into = memoryview(bytes(nbytes)), memoryview(bytearray(nbytes))
    for _ in range(count):
        sock.sendall(out) if not busy else _send_all(sock, out)
        got = 0
        while got < nbytes:
            try:
                got += sock.recv_into(into[got:])
            except BlockingIOError:
                continue


def _send_all(sock: socket.socket, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            continue


def protocol_us(nbytes: int, world: int = 2) -> float:
    """CPU microseconds per rank per allreduce of our protocol alone (see the docstring)."""
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

    def one(i: int) -> None:
        for r, session in enumerate(sessions):
            buf = buffers[r]
            buf.flat[:] = 1.0
            plan = Plan("allreduce", buf, lambda: None, "sum", 0)
            algo = build("allreduce", r, world, buf.flat, buf.dtype, "sum", 0)
            request: Request[Any] = Request(f"allreduce #{i}", runner)
            op = Operation((b"", i), "allreduce", plan.descriptor(0, buf.dtype.code), algo,
                           request, plan.result)  # fmt: skip
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

    for i in range(200):
        one(i)
    start = time.process_time()
    for i in range(200, 200 + _ROUNDS):
        one(i)
    runner.close()
    return (time.process_time() - start) / _ROUNDS / world * 1e6


def whole(nbytes: int, nprocs: int, spin: str | None) -> dict[str, float]:
    """Latency, CPU per rank per operation and the posting call, from N real ranks."""
    env = dict(os.environ)
    if spin is not None:
        env["ASYNCREDUCE_SPIN_US"] = spin
    out = subprocess.run(
        [sys.executable, "-m", "asyncreduce", "run", "-n", str(nprocs), __file__,
         "--rank", str(nbytes)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if '"latency_us"' in x)
    return dict(json.loads(line[line.index("{") :]))


def rank_main(nbytes: int) -> None:
    """One rank of ``whole``: allreduce in a loop, then (rank 0) the posting call alone."""
    import asyncreduce as ar

    with ar.init(timeout=120) as comm:
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(300):
            comm.allreduce(x)
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(_ROUNDS):
            comm.allreduce(x)
        latency = (time.perf_counter() - start) / _ROUNDS * 1e6
        cpu = (time.process_time() - cpu) / _ROUNDS * 1e6
        result = {"latency_us": latency, "cpu_us": cpu}
        comm.barrier()
        if comm.rank == 0:
            engine = comm._backend.engine
            assert engine is not None
            engine.submit = lambda op: op.request.set_result(None)  # type: ignore[method-assign]
            start = time.perf_counter()
            for _ in range(_ROUNDS):
                comm.iallreduce(x, name="call")
            result["call_us"] = (time.perf_counter() - start) / _ROUNDS * 1e6
            print(json.dumps(result), flush=True)
            os._exit(0)  # the engine no longer runs what is posted: do not close in order
        time.sleep(0.5)
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncreduce bench small_ops", description=__doc__
                                     .splitlines()[0])  # fmt: skip
    parser.add_argument("--size", default="4K", help="payload (bytes, K or M suffix)")
    parser.add_argument("--nprocs", default="2,4", help="world sizes for the whole allreduce")
    parser.add_argument("--repeats", type=int, default=3, help="runs per part (median)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a worker: nbytes
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank)
        return 0
    nbytes = _bytes(args.size)
    rows: list[tuple[str, str, float]] = []  # (key, label, microseconds)

    def median(fn: Any, *a: Any) -> float:
        return statistics.median(fn(*a) for _ in range(args.repeats))

    rows.append(("floor_busy", "floor: Python TCP exchange, busy-polling",
                 median(floor_us, nbytes, True)))  # fmt: skip
    rows.append(("floor_blocking", "floor: Python TCP exchange, blocking reads",
                 median(floor_us, nbytes, False)))  # fmt: skip
    rows.append(("protocol_cpu", "protocol alone, CPU per rank (2 Sessions, 1 thread)",
                 median(protocol_us, nbytes)))  # fmt: skip
    for n in [int(v) for v in args.nprocs.split(",")]:
        paths = ((None, "spin", "busy-polling"), ("0", "sleep", "sleeping, SPIN_US=0"))
        for spin, tag, what in paths:
            runs = [whole(nbytes, n, spin) for _ in range(args.repeats)]
            for key, label in (("latency_us", "latency"), ("cpu_us", "CPU per rank")):
                rows.append((f"n{n}_{tag}_{key[:-3]}", f"whole allreduce N={n}, {what}: {label}",
                             statistics.median(r[key] for r in runs)))  # fmt: skip
            if spin is None and not any(k == "call" for k, _, _ in rows):
                rows.append(("call", "posting call (iallreduce up to the engine's queue)",
                             statistics.median(r["call_us"] for r in runs)))  # fmt: skip
    print(f"where a {args.size} float32 allreduce's time goes (one host, loopback TCP; "
          f"median of {args.repeats}; {os.cpu_count()} cores)")  # fmt: skip
    width = max(len(label) for _, label, _ in rows)
    print(f"{'part':<{width}}  {'us':>8}")
    for _, label, value in rows:
        print(f"{label:<{width}}  {value:8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        us = {key: value for key, _, value in rows}
        document = {"benchmark": "small_ops", "bytes": nbytes, "repeats": args.repeats,
                    "cores": os.cpu_count(), "us": us}  # fmt: skip
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    scale = units.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


if __name__ == "__main__":
    sys.exit(main())
