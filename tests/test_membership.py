"""Agreement on who is alive (protocol/membership.py), sans-IO, in one process: 2-9 ranks, every
message through its bytes (``encode``/``decode``), delivered in random orders, with ranks that
die before or during the agreement (some halfway through sending), false suspicions (a rank
frozen for a while, then back), and partitions (a link down). Whatever happens, every rank that
decides decides the same set; a side that holds a quorum decides, and every live rank on it;
a side that does not never does (no split brain)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncreduce.protocol.membership import (
    NO_BALLOT,
    Accept,
    Accepted,
    Ballot,
    Decide,
    Membership,
    MembershipError,
    Nack,
    Prepare,
    Promise,
    Start,
    decode,
    encode,
)


@dataclass
class Net:
    """Ranks joined by links that lose nothing but deliver in any order (TCP between each
    pair keeps order; across pairs anything goes, and here even one pair's messages may pass
    each other, which only makes it harder)."""

    n: int
    rng: random.Random
    nodes: list[Membership] = field(init=False)
    flying: list[tuple[int, int, bytes]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    side: dict[int, int] = field(default_factory=dict)  # rank -> its side of a partition
    suspected: set[int] = field(default_factory=set)  # every rank anyone ever suspected
    suspecting: set[int] = field(default_factory=set)  # every rank that suspected anyone
    cut: set[frozenset[int]] = field(default_factory=set)  # links down between two ranks
    deciders_die: int = 0  # this many of the first ranks to decide die as they say so

    def __post_init__(self) -> None:
        self.nodes = [Membership(r, range(self.n)) for r in range(self.n)]

    def flush(self, rank: int, keep: int | None = None) -> None:
        """Put ``rank``'s outbox on the wire (only its first ``keep``: it dies halfway)."""
        out = self.nodes[rank].outbox
        for dst, message in out[:keep]:
            self.flying.append((rank, dst, encode(message)))
        out.clear()

    def reaches(self, src: int, dst: int) -> bool:
        return (dst not in self.dead and self.side.get(src, 0) == self.side.get(dst, 0)
                and frozenset((src, dst)) not in self.cut)  # fmt: skip

    def deliver_one(self) -> None:
        src, dst, data = self.flying.pop(self.rng.randrange(len(self.flying)))
        if self.reaches(src, dst):
            node = self.nodes[dst]
            undecided = node.excluded is None
            node.on_message(src, decode(data, self.n))
            if undecided and node.excluded is not None and self.deciders_die > 0:
                self.deciders_die -= 1  # it dies as it tells the others: some hear, some not
                self.kill(dst)
                return
            self.flush(dst)

    def kill(self, rank: int) -> None:
        """``rank`` dies: of what it was about to send, a random part goes out."""
        out = self.nodes[rank].outbox
        self.flush(rank, keep=self.rng.randrange(len(out) + 1))
        self.dead.add(rank)
        self.flying = [m for m in self.flying if m[0] != rank or self.rng.random() < 0.5]

    def suspect(self, rank: int, peers: set[int]) -> None:
        if rank not in self.dead:
            self.suspected |= peers
            if peers - {rank}:
                self.suspecting.add(rank)
            self.nodes[rank].suspect(peers)
            self.flush(rank)

    def retry(self, rank: int) -> None:
        if rank not in self.dead:
            self.nodes[rank].retry()
            self.flush(rank)


def _scenario(data: st.DataObject, n: int) -> dict[str, object]:
    ranks = list(range(n))
    dead_at_start = set(data.draw(st.lists(st.sampled_from(ranks), max_size=n - 1, unique=True)))
    alive = [r for r in ranks if r not in dead_at_start]
    dying = set(data.draw(st.lists(st.sampled_from(alive), max_size=len(alive) - 1, unique=True)))
    frozen = data.draw(st.lists(st.tuples(st.sampled_from(ranks), st.sampled_from(ranks)),
                                max_size=3 * n))  # fmt: skip
    split = data.draw(st.none() | st.sets(st.sampled_from(ranks), min_size=1, max_size=n - 1))
    deciders_die = data.draw(st.integers(0, 2))  # the first ranks to decide die as they tell it
    return {"dead_at_start": dead_at_start, "dying": dying, "frozen": frozen, "split": split,
            "deciders_die": deciders_die}  # fmt: skip


def _run(n: int, seed: int, scenario: dict[str, object], steps: int) -> Net:
    rng = random.Random(seed)
    net = Net(n, rng)
    dead_at_start: set[int] = scenario["dead_at_start"]  # type: ignore[assignment]
    dying: set[int] = scenario["dying"]  # type: ignore[assignment]
    split: set[int] | None = scenario["split"]  # type: ignore[assignment]
    net.dead |= dead_at_start
    net.deciders_die = scenario["deciders_die"]  # type: ignore[assignment]
    if split is not None:
        net.side = {r: int(r in split) for r in range(n)}
    lost = set(dead_at_start)

    def cut_off(rank: int) -> set[int]:
        """Whom ``rank``'s detector will suspect: the dead, and the other side."""
        other = {r for r in range(n) if net.side.get(r, 0) != net.side.get(rank, 0)}
        return (lost | other) - {rank}

    events: list[tuple[str, int, int]] = []  # (what, rank, about)
    for rank in range(n):
        events.append(("start", rank, -1))
    for rank in dying:
        events.append(("kill", rank, -1))
    for watcher, suspect in scenario["frozen"]:  # type: ignore[attr-defined]
        if watcher != suspect:
            events.append(("false", watcher, suspect))
    rng.shuffle(events)
    for _ in range(steps):
        roll = rng.random()
        if events and roll < 0.25:
            what, rank, about = events.pop()
            if what == "start":
                net.suspect(rank, cut_off(rank) if rng.random() < 0.5 else set())
            elif what == "kill" and rank not in net.dead:
                net.kill(rank)
                lost.add(rank)
            elif what == "false":
                net.suspect(rank, {about})
        elif net.flying and roll < 0.75:
            net.deliver_one()
            lost |= net.dead
        else:
            net.retry(rng.randrange(n))
    # then fairness: every event happens, every detector sees what it must, and the lowest
    # rank that leads is given time until the wire is quiet
    for what, rank, _ in events:
        if what == "kill" and rank not in net.dead:
            net.kill(rank)
            lost.add(rank)
    for _ in range(50):
        while True:  # every detector sees who died, until nobody dies telling a decision
            dead = len(net.dead)
            lost |= net.dead
            for rank in range(n):
                net.suspect(rank, cut_off(rank))
            while net.flying:
                net.deliver_one()
            if len(net.dead) == dead:
                break
        leaders = [r for r in range(n) if r not in net.dead and net.nodes[r].leader == r
                   and net.nodes[r].excluded is None]  # fmt: skip
        if not leaders:
            break
        net.retry(min(leaders))
    return net


def _check(net: Net) -> None:
    n = net.n
    decisions = {r: node.excluded for r, node in enumerate(net.nodes) if node.excluded is not None}
    values = set(decisions.values())
    assert len(values) <= 1, f"ranks decided differently: {decisions}"
    judge = net.nodes[0]
    sides: dict[int, set[int]] = {}
    for rank in range(n):
        sides.setdefault(net.side.get(rank, 0), set()).add(rank)
    for members in sides.values():
        live = members - net.dead
        if judge.has_quorum(live):  # it decides, every live rank on it
            assert live <= decisions.keys(), (sorted(live), decisions)
        if len(sides) > 1 and not judge.has_quorum(members):  # cut off from the start: never
            assert not members & decisions.keys(), (sorted(members), decisions)
    if values:
        (excluded,) = values
        assert set(range(n)) - excluded, "nobody survives"
        unsure = net.suspected | net.suspecting  # suspected, or cut off from someone kept
        assert excluded <= unsure, (excluded, "excluded though nobody suspected it or anyone")


@settings(max_examples=1000, deadline=None)
@given(n=st.integers(2, 9), seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 600),
       data=st.data())  # fmt: skip
def test_every_rank_that_decides_decides_the_same_and_a_quorum_side_always_decides(
    n: int, seed: int, steps: int, data: st.DataObject
) -> None:
    scenario = _scenario(data, n)
    net = _run(n, seed, scenario, steps)
    _check(net)


def test_a_killed_rank_is_excluded_by_every_survivor_in_two_round_trips() -> None:
    """Rank 3 of 4 dies; each survivor notices it: the leader, rank 0, decides after one
    PREPARE and one ACCEPT round trip, and the rest learn it from its DECIDE."""
    net = Net(4, random.Random(1))
    net.dead.add(3)
    for rank in range(3):
        net.suspect(rank, {3})
    batches = 0  # every message in flight delivered at once: one message latency
    while any(net.nodes[r].excluded is None for r in range(3)):
        batch, net.flying = net.flying, []
        for src, dst, data in batch:
            if net.reaches(src, dst):
                net.nodes[dst].on_message(src, decode(data, 4))
                net.flush(dst)
        batches += 1
    assert [net.nodes[r].survivors for r in range(3)] == [frozenset({0, 1, 2})] * 3
    assert batches == 5, batches  # prepare, promise, accept, accepted, decide


def test_rank_0_dead_the_next_lowest_leads() -> None:
    net = Net(4, random.Random(2))
    net.dead.add(0)
    for rank in (1, 2, 3):
        net.suspect(rank, {0})
    while net.flying:
        net.deliver_one()
    assert all(net.nodes[r].survivors == frozenset({1, 2, 3}) for r in (1, 2, 3))


def test_a_rank_cut_off_alone_never_decides_and_learns_it_was_excluded_once_back() -> None:
    """Rank 2 of 4 loses its link: alone it is no quorum and decides nothing; the other three
    exclude it; when its link is back, its next message is answered with the decision."""
    net = Net(4, random.Random(3))
    net.side = {0: 0, 1: 0, 2: 1, 3: 0}
    net.suspect(2, {0, 1, 3})
    for rank in (0, 1, 3):
        net.suspect(rank, {2})
    while net.flying:
        net.deliver_one()
    assert net.nodes[2].excluded is None
    assert all(net.nodes[r].excluded == frozenset({2}) for r in (0, 1, 3))
    net.side = {}
    net.retry(2)
    while net.flying:
        net.deliver_one()
    assert net.nodes[2].excluded == frozenset({2})  # it knows it is out


def test_two_halves_go_on_only_on_the_side_of_the_lowest_rank() -> None:
    net = Net(4, random.Random(4))
    net.side = {0: 0, 1: 1, 2: 0, 3: 1}
    for rank in range(4):
        net.suspect(rank, {r for r in range(4) if net.side[r] != net.side[rank]})
    for _ in range(5):
        while net.flying:
            net.deliver_one()
        net.retry(1)
    assert net.nodes[0].survivors == net.nodes[2].survivors == frozenset({0, 2})
    assert net.nodes[1].excluded is None and net.nodes[3].excluded is None


def test_two_ranks_rank_0_goes_on_alone_rank_1_does_not() -> None:
    for survivor in (0, 1):
        net = Net(2, random.Random(5))
        net.dead.add(1 - survivor)
        net.suspect(survivor, {1 - survivor})
        net.retry(survivor)
        assert (net.nodes[survivor].survivors is not None) == (survivor == 0)


@pytest.mark.parametrize(
    "message",
    [Prepare(Ballot(3, 1)), Promise(Ballot(3, 1), NO_BALLOT, frozenset(), frozenset({2})),
     Promise(Ballot(4, 0), Ballot(3, 1), frozenset({5}), frozenset({5, 6})),
     Accept(Ballot(4, 0), frozenset({5})), Accepted(Ballot(4, 0)),
     Nack(Ballot(3, 1), Ballot(4, 0)), Decide(frozenset({1, 6})), Start()],
)  # fmt: skip
def test_every_message_round_trips_and_every_truncation_is_refused(message: object) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert decode(data, 8) == message
    for cut in range(len(data)):
        with pytest.raises(MembershipError):
            decode(data[:cut], 8)
    with pytest.raises(MembershipError):
        decode(data + b"\0", 8)


def test_ranks_outside_the_world_or_out_of_order_are_refused() -> None:
    with pytest.raises(MembershipError, match="rank 9 of a world of 8"):
        decode(encode(Prepare(Ballot(1, 9))), 8)
    with pytest.raises(MembershipError, match="out of order or range"):
        decode(encode(Decide(frozenset({8}))), 8)
    forged = bytes([6]) + (2).to_bytes(4, "little") + (3).to_bytes(4, "little") * 2
    with pytest.raises(MembershipError, match="out of order"):
        decode(forged, 8)  # the same rank twice
    with pytest.raises(MembershipError, match="not a membership message"):
        decode(b"\x09", 8)


def test_a_leader_waits_for_the_ranks_nobody_suspects_so_a_lost_one_is_not_kept() -> None:
    """Rank 2 of 4 stopped; only rank 3 has noticed yet. Ranks 0 and 1 answer the leader
    first and weigh a quorum, but the leader waits for rank 3 too (nobody suspects it), whose
    promise names rank 2: rank 2 is excluded, not kept for want of asking."""
    net = Net(4, random.Random(6))
    net.dead.add(2)
    net.suspect(3, {2})
    net.suspect(0, set())
    for message in (m for m in list(net.flying) if m[1] == 1):  # rank 1 answers first
        net.flying.remove(message)
        net.nodes[1].on_message(message[0], decode(message[2], 4))
        net.flush(1)
    while net.flying:
        net.deliver_one()
    assert [net.nodes[r].survivors for r in (0, 1, 3)] == [frozenset({0, 1, 3})] * 3


def _deliver(net: Net, src: int, dst: int, kind: type) -> None:
    """Deliver the first message in flight from ``src`` to ``dst`` of type ``kind``."""
    for i, (s, d, data) in enumerate(net.flying):
        if s == src and d == dst and isinstance(decode(data, net.n), kind):
            del net.flying[i]
            net.nodes[dst].on_message(src, decode(data, net.n))
            net.flush(dst)
            return
    raise AssertionError(f"no {kind.__name__} from {src} to {dst} in flight")


def test_an_accept_of_a_ballot_superseded_meanwhile_is_refused() -> None:
    """Rank 0 (which suspects ranks 3 and 4 by mistake) gathers promises from 0-2 and sends
    ACCEPT; before it lands, rank 1 (which suspects rank 0 by mistake) gathers promises from
    1-4 for a higher ballot. Ranks 2 and 3, having promised the higher one, refuse rank 0's
    ACCEPT: only rank 1's value is decided."""
    net = Net(5, random.Random(7))
    net.suspect(0, {3, 4})  # rank 0 proposes
    for peer in (1, 2):
        _deliver(net, 0, peer, Prepare)
        _deliver(net, peer, 0, Promise)
    net.suspect(4, {0})  # a promise of rank 4 will carry its suspicion of rank 0
    net.suspect(1, {0})  # rank 1 now leads in its own eyes
    for peer in (2, 3, 4):
        _deliver(net, 1, peer, Prepare)
        _deliver(net, peer, 1, Promise)
    for peer in (2, 3):  # rank 0's ACCEPT lands late: refused (accepting it would let rank 0
        _deliver(net, 0, peer, Accept)  # decide {3, 4} while rank 1 decides {0})
        _deliver(net, peer, 0, Nack)
    while net.flying:
        net.deliver_one()
    decisions = {r: net.nodes[r].excluded for r in range(5) if net.nodes[r].excluded is not None}
    assert set(decisions.values()) == {frozenset({0})}, decisions


def test_a_link_down_between_two_live_ranks_excludes_the_higher_one() -> None:
    """Ranks 1 and 2 of 4 cannot reach each other and both answer rank 0: keeping both would
    break the next membership again, so the higher one goes, and only it."""
    net = Net(4, random.Random(8))
    net.cut.add(frozenset((1, 2)))
    net.suspect(1, {2})
    net.suspect(2, {1})
    net.suspect(0, set())
    while net.flying:
        net.deliver_one()
    assert {net.nodes[r].excluded for r in (0, 1, 3)} == {frozenset({2})}


def test_a_rank_refused_by_a_lower_ranks_ballot_waits_for_its_timer() -> None:
    """Rank 1 suspects rank 0 by mistake and proposes; rank 0's higher ballot refuses it.
    However often rank 1's detector speaks, it proposes again only at its timer (``retry``),
    so two ranks that cannot reach each other do not pre-empt each other at every beat."""
    node = Membership(1, range(3))
    node.suspect({0})
    assert [m for _, m in node.outbox if isinstance(m, Prepare)], "rank 1 leads in its eyes"
    node.outbox.clear()
    node.on_message(2, Nack(Ballot(1, 1), Ballot(2, 0)))  # rank 2 promised rank 0's
    for _ in range(5):
        node.suspect({0})  # every beat: nothing new
    assert not [m for _, m in node.outbox if isinstance(m, Prepare)], node.outbox
    node.retry()
    prepares = [m for _, m in node.outbox if isinstance(m, Prepare)]
    assert prepares and prepares[0].ballot > Ballot(2, 0), prepares


def test_a_leader_that_noticed_nothing_starts_when_a_rank_tells_it() -> None:
    """Ranks 1 and 3 lost rank 2; rank 0, the leader, noticed nothing and is never asked by
    its caller: the others' START makes it propose, and rank 2 is excluded."""
    net = Net(4, random.Random(10))
    net.dead.add(2)
    net.suspect(1, {2})
    net.suspect(3, {2})
    while net.flying:
        net.deliver_one()
    assert [net.nodes[r].excluded for r in (0, 1, 3)] == [frozenset({2})] * 3
