"""The agreement of the ordered backends, in one process: N ranks, messages delivered in orders
hypothesis draws (per pair in order, as MPI and Gloo deliver them, or in any order), posts in a
different order on each rank, and programs that wait for one operation before posting the next.

What must hold: every rank runs the same operations in the same order; every operation that
every rank posts is agreed (no deadlock that the key-matched native engine would not have);
a mismatch is seen on every rank, naming the other side; bad contributions are refused."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncreduce.algorithms import DTYPES
from asyncreduce.backends.ordered.agreement import Agreement, AgreementError, Entry, decode, encode
from asyncreduce.backends.ordered.backend import OrderedBackend
from asyncreduce.backends.ordered.fusion import Call, complete
from asyncreduce.backends.ordered.posted import Posted
from asyncreduce.buffers import device_buffer
from asyncreduce.flight import FlightRecorder
from asyncreduce.plans import Plan
from asyncreduce.protocol import ON_DEVICE, describe
from asyncreduce.request import CallbackRunner, Request
from asyncreduce.transport.frame import Descriptor

DESC = Descriptor(1, 2, 1, 0, 1000)


def entry(name: str, instance: int = 0, desc: Descriptor = DESC, priority: int = 0) -> Entry:
    return Entry(name.encode(), instance, desc, priority)


class Net:
    """In-flight messages between the ranks' agreements, delivered in a drawn order."""

    def __init__(self, n: int, rng: random.Random, fifo: bool) -> None:
        self.ranks = [Agreement(r, n) for r in range(n)]
        self.queues: dict[tuple[int, int], list[bytes]] = {}
        self.rng, self.fifo = rng, fifo
        self.order: list[list[tuple[bytes, int]]] = [[] for _ in range(n)]
        self.mismatches: list[list[tuple[bytes, int, int]]] = [[] for _ in range(n)]

    def send(self, src: int, out: list[tuple[int, bytes]]) -> None:
        for dst, message in out:
            self.queues.setdefault((src, dst), []).append(message)

    def post(self, rank: int, e: Entry) -> None:
        self.send(rank, self.ranks[rank].post(e))
        self.collect(rank)

    def deliver_one(self) -> bool:
        pairs = [p for p, q in self.queues.items() if q]
        if not pairs:
            return False
        src, dst = self.rng.choice(pairs)
        queue = self.queues[(src, dst)]
        message = queue.pop(0 if self.fifo else self.rng.randrange(len(queue)))
        self.send(dst, self.ranks[dst].receive(src, message))
        self.collect(dst)
        return True

    def collect(self, rank: int) -> None:
        for agreed in self.ranks[rank].take_agreed():
            self.order[rank].append(agreed.key)
            if agreed.mismatch is not None:
                self.mismatches[rank].append((*agreed.key, agreed.mismatch[0]))

    def run(self, programs: list[list[tuple[str, Entry]]]) -> None:
        """Run each rank's program of ("post", e) and ("wait", e) steps, interleaved at random
        with deliveries, until nothing can move."""
        at = [0] * len(programs)
        while True:
            movable = [
                r
                for r, prog in enumerate(programs)
                if at[r] < len(prog)
                and (prog[at[r]][0] == "post" or prog[at[r]][1].key in self.order[r])
            ]
            if not movable and not any(self.queues.values()):
                return
            if movable and (not any(self.queues.values()) or self.rng.random() < 0.4):
                r = self.rng.choice(movable)
                step, e = programs[r][at[r]]
                at[r] += 1
                if step == "post":
                    self.post(r, e)
            else:
                self.deliver_one()


def phased_programs(n: int, keys: int, phases: int, rng: random.Random) -> list[list]:
    """Keys cut into phases; each rank posts a phase's keys in its own order, waits for some of
    them (in its own order), then goes on: the shape of a training step."""
    names = [entry(f"k{i}", priority=rng.randrange(3)) for i in range(keys)]
    cut = sorted(rng.sample(range(1, keys), min(phases - 1, keys - 1))) if keys > 1 else []
    groups = [names[a:b] for a, b in zip([0, *cut], [*cut, keys], strict=True)]
    programs = []
    for _ in range(n):
        prog: list = []
        for group in groups:
            posts = group[:]
            rng.shuffle(posts)
            prog += [("post", e) for e in posts]
            waits = group[:]
            rng.shuffle(waits)
            prog += [("wait", e) for e in waits]
        programs.append(prog)
    return programs


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 9), keys=st.integers(1, 24), phases=st.integers(1, 6),
       fifo=st.booleans(), seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_every_rank_runs_every_operation_in_one_order(
    n: int, keys: int, phases: int, fifo: bool, seed: int
) -> None:
    rng = random.Random(seed)
    net = Net(n, rng, fifo)
    net.run(phased_programs(n, keys, phases, rng))
    assert len(net.order[0]) == keys, "an operation every rank posted was never agreed"
    for r in range(1, n):
        assert net.order[r] == net.order[0], f"rank {r} runs another order than rank 0"
    assert all(a.waiting == 0 for a in net.ranks)
    assert not any(net.queues.values())


def test_priority_orders_operations_agreed_together() -> None:
    net = Net(3, random.Random(1), True)
    for r in range(3):
        for name, prio in (("a", 0), ("b", 5), ("c", 1)):
            net.send(r, net.ranks[r].post(entry(name, priority=prio if r == 2 else 0)))
    while net.deliver_one():
        pass
    for r in range(3):
        net.collect(r)
    # The first round carries only each rank's first post; b and c go in the next one, where
    # the highest priority any rank gave comes first.
    assert net.order[0] == [(b"a", 0), (b"b", 0), (b"c", 0)]
    assert net.order[1] == net.order[2] == net.order[0]


def test_a_rank_waiting_on_one_key_answers_rounds_that_others_start() -> None:
    """A posts k1 and waits; B posts k2 first, then k1: k1 must complete (as natively), and
    then A's k2."""
    net = Net(2, random.Random(2), True)
    programs = [
        [("post", entry("k1")), ("wait", entry("k1")), ("post", entry("k2")),
         ("wait", entry("k2"))],
        [("post", entry("k2")), ("post", entry("k1")), ("wait", entry("k1")),
         ("wait", entry("k2"))],
    ]  # fmt: skip
    for seed in range(50):
        net = Net(2, random.Random(seed), True)
        net.run(programs)
        assert net.order[0] == net.order[1] == [(b"k1", 0), (b"k2", 0)]


def test_an_idle_rank_sends_nothing() -> None:
    a = Agreement(0, 3)
    assert a.receive(1, encode(0, [entry("x")])) == []  # nothing posted here: stay silent
    out = a.post(entry("x"))
    assert sorted(dst for dst, _ in out) == [1, 2]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_mismatch_is_seen_on_every_rank_naming_the_other_side(n: int) -> None:
    net = Net(n, random.Random(n), True)
    other = DESC._replace(count=999)
    for r in range(n):
        net.post(r, entry("w", desc=other if r == n - 1 else DESC))
    while net.deliver_one():
        pass
    for r in range(n - 1):
        assert net.mismatches[r] == [(b"w", 0, n - 1)]
    assert net.mismatches[n - 1] == [(b"w", 0, 0)]
    assert all(order == [(b"w", 0)] for order in net.order)


def test_posted_by_names_who_posted_a_pending_key() -> None:
    net = Net(3, random.Random(3), True)
    net.post(0, entry("s"))
    net.post(1, entry("s"))
    while net.deliver_one():
        pass
    assert net.ranks[0].posted_by((b"s", 0)) == {0, 1}
    assert net.ranks[2].posted_by((b"s", 0)) == {0, 1}


def test_contributions_round_trip() -> None:
    entries = [entry("layer.weight", 7, Descriptor(1, 9, 3, 2, 2**40), -4), entry("", 3)]
    assert decode(encode(12, entries)) == (12, entries)


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (b"", "shorter than its header"),
        (b"XXXX" + bytes(12), "not a contribution"),
        (encode(0, [entry("a")])[:-1], "does not fit"),
        (encode(0, [entry("a")]) + b"!", "after the last entry"),
        (encode(0, [entry("a")])[:20], "ends inside an entry"),
        (encode(0, [])[:12] + (10**6).to_bytes(4, "little"), "claims 1000000 entries"),
    ],
)
def test_bad_contributions_are_refused(message: bytes, words: str) -> None:
    with pytest.raises(AgreementError, match=words):
        Agreement(0, 2).receive(1, message)


def test_contributions_out_of_round_or_twice_are_refused() -> None:
    a = Agreement(0, 3)
    a.receive(1, encode(0, []))
    with pytest.raises(AgreementError, match="twice"):
        a.receive(1, encode(0, []))
    with pytest.raises(AgreementError, match="round 5"):
        a.receive(2, encode(5, []))
    a.post(entry("k"))
    with pytest.raises(AgreementError, match="posted twice"):
        a.post(entry("k"))


def test_a_stopped_rank_finishes_its_round_and_starts_no_other() -> None:
    a = Agreement(0, 2)
    a.post(entry("x"))  # round 0 contributed
    a.stop()
    a.receive(1, encode(0, [entry("x")]))  # round 0 completes: x agreed
    assert [g.key for g in a.take_agreed()] == [(b"x", 0)]
    a.post(entry("y"))  # (a closing engine fails such posts; the agreement stays silent)
    assert a.receive(1, encode(1, [entry("z")])) == []


class _Engine:
    """A stand-in for the ordered engine: what OrderedBackend reads of one (an adapter that
    takes device tensors), and the operations it is handed."""

    rank, world_size = 0, 2
    adapter = SimpleNamespace(devices=True)

    def __init__(self) -> None:
        self.posted: list[Posted] = []

    def submit(self, op: Posted) -> None:
        self.posted.append(op)


def _posted_on_device(name: str, root: int) -> Posted:
    """What OrderedBackend.submit hands the engine for a (meta-device) tensor of ``name`` type,
    built as a CUDA tensor's is: device_buffer, then an allreduce (``root`` 0) or a broadcast
    from ``root``."""
    torch = pytest.importorskip("torch")
    buf = device_buffer(torch.zeros(3, 5, dtype=getattr(torch, name), device="meta"), "x")
    assert buf is not None
    plan = Plan("broadcast", buf, lambda: None, None, root) if root else Plan(
        "allreduce", buf, lambda: None, "sum")  # fmt: skip
    engine = _Engine()
    OrderedBackend(engine).submit(  # type: ignore[arg-type]
        plan, (b"g", 0), "g", 0, None, Request("g", CallbackRunner("test"))
    )
    return engine.posted[0]


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_device_descriptors_go_through_the_agreement(name: str, root: int) -> None:
    """A device buffer's descriptor (its dtype code + ON_DEVICE) is ints that fit the wire, and
    comes back equal from a peer's agreement (it once held a tensor's ``size`` method, and the
    engine thread died packing it: struct.error, every rank broken)."""
    desc = _posted_on_device(name, root).desc
    e = Entry(b"g", 0, desc, 0)
    assert decode(encode(3, [e])) == (3, [e])
    assert all(type(field) is int for field in desc), desc
    assert (desc.dtype, desc.root, desc.count) == (DTYPES[name].code + ON_DEVICE, root, 15)
    a, b = Agreement(0, 2), Agreement(1, 2)
    for _, message in a.post(e):
        b.receive(0, message)
    b.post(e)
    [agreed] = b.take_agreed()
    assert (agreed.desc, agreed.mismatch) == (desc, None)


def test_an_agreed_device_operation_completes() -> None:
    """Past the agreement, the engine completes a device operation's call (fusion.complete
    once added a tensor's ``size`` method to an int: the engine thread's next crash)."""
    op = _posted_on_device("float32", 0)
    complete(Call([op], _Done()), 2, FlightRecorder(0, 2, 8, describe))
    assert op.request.done() and op.request.exception() is None


class _Done:
    """A finished engine call."""

    def done(self) -> bool:
        return True
