"""The fake network of the algorithm tests: every rank of one collective in one process,
joined by a wire that delivers in random order (sans-IO algorithms need nothing more).

On every delivery it checks that the payload is unchanged since it was sent, that "done" is
exact (nothing awaited, no work left), and, with ``probe``, that malformed messages are refused;
it scribbles over the staging after ``on_view``, and sometimes splits a receive in two. The
protocol above the algorithms has a wire of its own (wire.py), which carries frames.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from asyncreduce.algorithms import Collective, ProtocolError

__all__ = ["Flight", "Network", "quiet_floats"]


# Overflow wraps or saturates as in MPI; the engine's progress thread turns numpy's
# floating-point warnings off for itself (see reduction.py), so the tests do the same where
# they stand in for it.
def quiet_floats() -> np.errstate:
    return np.errstate(all="ignore")


@dataclass
class Flight:
    src: int
    dst: int
    step: int
    seg: int
    payload: np.ndarray  # the array the algorithm handed out (often a view of its buffer)
    sent: bytes  # its bytes at the moment it was sent


@dataclass
class Network:
    """Every rank of one collective, joined by a wire that delivers in random order."""

    machines: list[Collective]
    seed: int
    split_recv: bool = True  # sometimes ask for a buffer now and fill/consume it later
    probe: bool = False  # around each delivery, check that malformed messages are refused
    started: set[int] = field(default_factory=set)
    sent_by: list[int] = field(default_factory=list)
    received_by: list[int] = field(default_factory=list)
    log: list[Flight] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.n = len(self.machines)
        self.rng = random.Random(self.seed)
        self.sent_by = [0] * self.n
        self.received_by = [0] * self.n
        self.in_flight: list[Flight] = []  # to started ranks
        self.held: dict[int, list[Flight]] = {r: [] for r in range(self.n)}  # to unstarted ranks
        self.pending: dict[tuple[int, int], tuple[Flight, np.ndarray]] = {}  # (dst, src) -> ...
        self.must_start: Callable[[int], set[int]] = lambda rank: set(range(self.n))

    @property
    def delivered(self) -> int:
        return sum(self.received_by)

    def _post(self, src: int, sends: list) -> None:
        for s in sends:
            assert 0 <= s.dst < self.n and s.dst != src, f"rank {src} sends to {s.dst}"
            flight = Flight(src, s.dst, s.step, s.seg, s.payload, s.payload.tobytes())
            self.sent_by[src] += 1
            (self.in_flight if s.dst in self.started else self.held[s.dst]).append(flight)

    def start(self, rank: int) -> None:
        assert rank not in self.started
        self.started.add(rank)
        self.in_flight += self.held.pop(rank)
        self._post(rank, self.machines[rank].start())

    def _probe_malformed(self, f: Flight) -> None:
        m, nbytes = self.machines[f.dst], len(f.sent)
        bad = [
            (f.src, f.step, f.seg, nbytes + 1),  # payload too long
            (-1, f.step, f.seg, nbytes),  # no such rank
            (self.n, f.step, f.seg, nbytes),
            (f.src, -1, f.seg, nbytes),  # no such step
            (f.src, f.step + 1000, f.seg, nbytes),
            (f.src, f.step, -1, nbytes),  # no such segment
            (f.src, f.step, f.seg + 1000, nbytes),
        ]
        if nbytes:
            bad.append((f.src, f.step, f.seg, nbytes - 1))  # payload too short
        # Every algorithm here names each (step, seg) it receives with exactly one source.
        bad += [(src, f.step, f.seg, nbytes) for src in range(self.n) if src != f.src]
        for args in bad:
            with pytest.raises(ProtocolError):
                m.recv_buffer(*args)

    def _deliver(self, f: Flight) -> None:
        m = self.machines[f.dst]
        assert not m.done, f"rank {f.dst} got {(f.src, f.step, f.seg)} after it finished"
        assert f.src in m.pending_sources, f"rank {f.dst} does not list {f.src} as pending"
        if self.probe:
            self._probe_malformed(f)
        if m.takes_view(f.src, f.step, f.seg) and self.rng.random() < 0.5:
            self._consume_view(f)
            return
        target = m.recv_buffer(f.src, f.step, f.seg, len(f.sent))
        assert target.nbytes == len(f.sent)
        if self.split_recv and self.rng.random() < 0.3:
            self.pending[(f.dst, f.src)] = (f, target)
        else:
            self._consume(f, target)

    def _consume(self, f: Flight, target: np.ndarray) -> None:
        m = self.machines[f.dst]
        # A payload stays untouched by its sender until it has been delivered.
        assert f.payload.tobytes() == f.sent, f"rank {f.src} changed {(f.step, f.seg)} in flight"
        target.reshape(-1).view(np.uint8)[:] = np.frombuffer(f.sent, dtype=np.uint8)
        with quiet_floats():  # as the progress thread runs the algorithms
            sends = m.on_message(f.src, f.step, f.seg, target)
        self._post(f.dst, sends)
        self.received_by[f.dst] += 1
        self.log.append(f)
        assert m.pending_sources <= set(range(self.n)) - {f.dst}
        self._settled(f.dst)
        if self.probe:
            with pytest.raises(ProtocolError):
                m.recv_buffer(f.src, f.step, f.seg, len(f.sent))

    def _settled(self, rank: int) -> None:
        """After a message or a unit of work: done exactly when nothing is awaited or left."""
        m = self.machines[rank]
        assert m.done == (not m.pending_sources and not m.has_work), (m.done, m.pending_sources)
        if m.done:
            missing = self.must_start(rank) - self.started
            assert not missing, f"rank {rank} finished before ranks {sorted(missing)} started"

    def _work(self, rank: int) -> None:
        m = self.machines[rank]
        with quiet_floats():
            sends = m.work()
        self._post(rank, sends)
        self._settled(rank)

    def _consume_view(self, f: Flight) -> None:
        """Consume a message from where it arrived (the transport's staging, shared memory),
        which is overwritten the moment the call returns: nothing may keep reading it."""
        m = self.machines[f.dst]
        assert f.payload.tobytes() == f.sent, f"rank {f.src} changed {(f.step, f.seg)} in flight"
        staging = bytearray(f.sent)
        with quiet_floats():
            sends = m.on_view(f.src, f.step, f.seg, memoryview(staging))
        staging[:] = b"\xa5" * len(staging)
        self._post(f.dst, sends)
        self.received_by[f.dst] += 1
        self.log.append(f)
        self._settled(f.dst)

    def _finish_pending(self, key: tuple[int, int]) -> None:
        self._consume(*self.pending.pop(key))

    def step(self) -> bool:
        """Deliver (or finish) one message to a started rank, or let one do a unit of its
        own work; False once nothing can move."""
        busy = [r for r in sorted(self.started) if self.machines[r].has_work]
        if busy and (not (self.in_flight or self.pending) or self.rng.random() < 0.3):
            self._work(self.rng.choice(busy))
            return True
        if self.in_flight and (not self.pending or self.rng.random() < 0.8):
            f = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
            if (f.dst, f.src) in self.pending:  # one receive per source at a time
                self._finish_pending((f.dst, f.src))
            self._deliver(f)
            return True
        if self.pending:
            self._finish_pending(self.rng.choice(sorted(self.pending)))
            return True
        return False

    def quiet(self) -> None:
        while self.step():
            pass

    def run(self) -> Network:
        """Start the ranks in random order at random moments and deliver everything."""
        order = list(range(self.n))
        self.rng.shuffle(order)
        for rank in order:
            self.start(rank)
            for _ in range(self.rng.randrange(4 * self.n)):
                if not self.step():
                    break
        self.quiet()
        unfinished = [r for r, m in enumerate(self.machines) if not m.done]
        assert not unfinished, f"ranks {unfinished} never finished"
        assert not any(self.held.values())
        assert sum(self.sent_by) == self.delivered
        return self
