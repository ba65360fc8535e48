"""One rank of the concurrency benchmark: every variant of its library, in interleaved rounds.

``VARIANTS`` names what each library runs (and labels it in the tables; its order is theirs):
ten allreduces one after another, from ten threads, or posted from one thread and waited for
together, and for asyncreduce each of those again on buffers from ``comm.shared_empty`` (the
``window-`` family). ``worker`` is the body ``harness.worker_main`` runs: first ``warmup``
untimed runs of every variant (in the table's order), then ``rounds`` rounds, each of which runs
every variant once, in an order shuffled per round from a fixed seed (``round_order``: the
same on every rank, so the ranks' collectives pair up). Each run refills the buffers
(untimed), times all the allreduces as ``harness.timed`` does, and checks every sum afterwards
(sampled, untimed). A variant's result keeps its time in every round, in round order, and
where in each round it ran, so the parent can compare it with the sequential run of the same
round. ``Settings`` are what the parent resolved and every rank is told (as JSON).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

__all__ = [
    "ROUND_SEED",
    "VARIANTS",
    "WINDOW",
    "Settings",
    "round_order",
    "variant_family",
    "worker",
]

WINDOW = "window-"  # the prefix of the variants on shared windows
_SAMPLE = 4099  # check every 4099th element (a prime: touches every page of the buffer)
ROUND_SEED = 15  # round r shuffles the variants with random.Random(ROUND_SEED + r)

#: (library, variant) -> the label in tables and plots; the order is the table's.
VARIANTS: dict[tuple[str, str], str] = {
    ("asyncreduce", "sequential"): "sequential: allreduce x10",
    ("asyncreduce", "threads"): "10 threads, 1 named allreduce each",
    ("asyncreduce", "requests"): "1 thread: iallreduce x10 + wait_all",
    ("asyncreduce", "window-sequential"): "shared_empty buffers, sequential",
    ("asyncreduce", "window-threads"): "shared_empty buffers, 10 threads",
    ("asyncreduce", "window-requests"): "shared_empty buffers, iallreduce x10",
    ("gloo", "sequential"): "sequential: all_reduce x10",
    ("gloo", "threads"): "10 threads, 10 process groups",
    ("gloo", "pool2"): "10 threads, pool of 2 groups",
    ("gloo", "pool4"): "10 threads, pool of 4 groups",
    ("gloo", "async"): "1 thread: async_op=True x10 + wait",
    ("mpi", "sequential"): "sequential: Allreduce x10",
    ("mpi", "requests"): "1 thread: Iallreduce x10 + Waitall",
    ("mpi", "threads"): "10 threads, 10 Dup'd communicators",
}


@dataclass(frozen=True)
class Settings:
    nprocs: list[int]
    libs: list[str]
    tensors: int
    elements: int
    rounds: int
    warmup: int
    quick: bool


def variant_family(variant: str) -> str:
    return WINDOW if variant.startswith(WINDOW) else ""


def round_order(variants: Sequence[str], index: int) -> list[str]:
    """The order in which round ``index`` runs ``variants``: shuffled, the same on every rank."""
    return random.Random(ROUND_SEED + index).sample(list(variants), len(variants))


class _Turns:
    """Thread i may use group i mod P only after thread i-P is done with it.

    Collectives on one Gloo process group must be issued in the same order on every rank; a
    first-come pool would let threads race for a group differently on each rank.
    """

    def __init__(self, groups: int) -> None:
        self._cond = threading.Condition()
        self._next = [0] * groups

    def reset(self) -> None:
        with self._cond:
            self._next = [0] * len(self._next)

    @contextlib.contextmanager
    def turn(self, group: int, ticket: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._next[group] == ticket)
        try:
            yield
        finally:
            with self._cond:
                self._next[group] += 1
                self._cond.notify_all()


class _Buffers:
    """The tensors of one rank, their fill values and the check of their sums."""

    def __init__(self, rank: harness.Rank, s: Settings) -> None:
        self.rank = rank
        if rank.lib == "gloo":
            torch: Any = rank.torch  # type: ignore[attr-defined]
            self.x: list[Any] = [
                torch.empty(s.elements, dtype=torch.float32) for _ in range(s.tensors)
            ]
        else:
            np: Any = __import__("numpy")
            self.x = [np.empty(s.elements, dtype=np.float32) for _ in range(s.tensors)]
        self._sets = {"": self.x}  # variant family -> its buffers
        self._settings = s
        self.bad = 0

    def use(self, variant: str) -> None:
        """The buffers the variant runs on (the steps read ``self.x`` at each call); the
        shared windows of the window-* variants are made when the first of them runs
        (collective: every rank runs the variants in the same order)."""
        family = variant_family(variant)
        if family not in self._sets:
            comm, s = self.rank.comm, self._settings  # type: ignore[attr-defined]
            np: Any = __import__("numpy")
            self._sets[family] = [
                comm.shared_empty(s.elements, np.float32) for _ in range(s.tensors)
            ]
        self.x = self._sets[family]

    def fill(self) -> None:
        for i, x in enumerate(self.x):
            x[:] = self.rank.rank + 1 + i

    def check(self) -> None:
        n = self.rank.size
        for i, x in enumerate(self.x):
            expected = n * (n + 1) // 2 + n * i
            if not bool((x[::_SAMPLE] == expected).all()):
                self.bad += 1


def _asyncreduce_steps(rank: Any, b: _Buffers, pool: ThreadPoolExecutor) -> dict[str, Any]:
    comm, ar = rank.comm, rank.ar
    names = [f"concurrency.{i}" for i in range(len(b.x))]

    def one(i: int) -> None:
        comm.allreduce(b.x[i], name=names[i])

    def sequential() -> None:
        for i in range(len(b.x)):
            one(i)

    def requests() -> None:
        ar.wait_all([comm.iallreduce(x, name=name) for x, name in zip(b.x, names, strict=True)])

    def threads() -> None:
        list(pool.map(one, range(len(b.x))))

    plain = {"sequential": sequential, "threads": threads, "requests": requests}
    return {**plain, **{WINDOW + k: step for k, step in plain.items()}}


def _gloo_steps(rank: Any, b: _Buffers, pool: ThreadPoolExecutor) -> dict[str, Any]:
    dist = rank.dist
    groups = [dist.new_group(backend="gloo") for _ in b.x]  # every rank, same order

    def sequential() -> None:
        for x in b.x:
            dist.all_reduce(x)

    def own_group(i: int) -> None:
        dist.all_reduce(b.x[i], group=groups[i])

    def pooled(size: int) -> Callable[[], None]:
        turns = _Turns(size)

        def one(i: int) -> None:
            with turns.turn(i % size, i // size):
                dist.all_reduce(b.x[i], group=groups[i % size])

        def step() -> None:
            turns.reset()
            list(pool.map(one, range(len(b.x))))

        return step

    def async_ops() -> None:
        for work in [dist.all_reduce(x, async_op=True) for x in b.x]:
            work.wait()

    return {
        "sequential": sequential,
        "threads": lambda: list(pool.map(own_group, range(len(b.x)))),
        "pool2": pooled(2),
        "pool4": pooled(4),
        "async": async_ops,
    }


def _mpi_steps(rank: Any, b: _Buffers, pool: ThreadPoolExecutor) -> dict[str, Any]:
    mpi, comm = rank.MPI, rank.comm

    def sequential() -> None:
        for x in b.x:
            comm.Allreduce(mpi.IN_PLACE, x, op=mpi.SUM)

    def requests() -> None:
        mpi.Request.Waitall([comm.Iallreduce(mpi.IN_PLACE, x, op=mpi.SUM) for x in b.x])

    steps: dict[str, Any] = {"sequential": sequential, "requests": requests}
    if rank.thread_multiple:
        comms = [comm.Dup() for _ in b.x]  # one communicator per thread: no ordering to keep

        def own_comm(i: int) -> None:
            comms[i].Allreduce(mpi.IN_PLACE, b.x[i], op=mpi.SUM)

        steps["threads"] = lambda: list(pool.map(own_comm, range(len(b.x))))
    return steps


_STEPS = {"asyncreduce": _asyncreduce_steps, "gloo": _gloo_steps, "mpi": _mpi_steps}


def _runs(
    rank: harness.Rank, step: Callable[[], object], buffers: _Buffers, repeats: int, warmup: int
) -> tuple[list[float], int]:
    """``harness.timed`` on the buffers (fill, barrier, time, check): the times of the
    ``repeats`` runs after ``warmup`` untimed ones, and how many sums were wrong on this rank."""
    buffers.bad = 0
    times = harness.timed(rank, step, repeats, warmup, buffers.fill, buffers.check)
    return times, buffers.bad


class _Rounds:
    """Every variant's time per round, where in the round it ran, and its wrong sums."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.times: dict[str, list[float]] = {v: [] for v in names}
        self.positions: dict[str, list[int]] = {v: [] for v in names}
        self.bad = dict.fromkeys(names, 0)

    def warm_up(self, rank: harness.Rank, steps: dict[str, Any], b: _Buffers, runs: int) -> None:
        """``runs`` untimed runs of each variant, in the table's order (the windows are made
        here, on every rank in the same order)."""
        for variant in self.names:
            b.use(variant)
            self.bad[variant] += _runs(rank, steps[variant], b, 0, runs)[1]

    def one_round(self, rank: harness.Rank, steps: dict[str, Any], b: _Buffers, index: int) -> None:
        for position, variant in enumerate(round_order(self.names, index)):
            b.use(variant)
            times, wrong = _runs(rank, steps[variant], b, 1, 0)
            self.times[variant] += times
            self.positions[variant].append(position)
            self.bad[variant] += wrong


def worker(rank: harness.Rank, settings: dict[str, Any], tell: harness.Tell) -> None:
    s = Settings(**settings)
    buffers = _Buffers(rank, s)
    with ThreadPoolExecutor(max_workers=s.tensors, thread_name_prefix="bench-thread") as pool:
        steps = _STEPS[rank.lib](rank, buffers, pool)
        if rank.lib == "mpi" and "threads" not in steps:
            tell("note", text="MPI_THREAD_MULTIPLE not granted: the threads variant is skipped")
        rounds = _Rounds([v for (lib, v) in VARIANTS if lib == rank.lib and v in steps])
        tell("start", step=f"warm-up, {s.warmup} of each variant")
        rounds.warm_up(rank, steps, buffers, s.warmup)
        for index in range(s.rounds):
            tell("start", step=f"round {index + 1} of {s.rounds}")
            rounds.one_round(rank, steps, buffers, index)
    for variant in rounds.names:  # the table's order, on every rank: rank.max is collective
        verified = rank.max(float(rounds.bad[variant])) == 0
        tell("result", variant=variant, label=VARIANTS[(rank.lib, variant)],
             seconds=harness.median(rounds.times[variant]), rounds_s=rounds.times[variant],
             positions=rounds.positions[variant], verified=verified)  # fmt: skip
