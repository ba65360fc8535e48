"""Run every rank of a sans-IO collective in one process over a fake wire.

Messages are copied when sent (as a socket would) and delivered one at a time in an order
chosen by ``pick``; the driver checks that nothing is left undelivered and that every rank
finishes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from asyncreduce.algorithms import Collective, Send


@dataclass
class Message:
    src: int
    dst: int
    step: int
    seg: int
    data: bytes


def run_ranks(machines: list[Collective], rng: random.Random) -> int:
    """Deliver messages in random order until quiet; return how many were delivered."""
    in_flight: list[Message] = []

    def post(src: int, sends: list[Send]) -> None:
        for s in sends:
            in_flight.append(
                Message(src, s.dst, s.step, s.seg, np.ascontiguousarray(s.payload).tobytes())
            )

    for rank, machine in enumerate(machines):
        post(rank, machine.start())
    delivered = 0
    while in_flight:
        msg = in_flight.pop(rng.randrange(len(in_flight)))
        machine = machines[msg.dst]
        target = machine.recv_buffer(msg.src, msg.step, msg.seg, len(msg.data))
        target.reshape(-1).view(np.uint8)[:] = np.frombuffer(msg.data, dtype=np.uint8)
        post(msg.dst, machine.on_message(msg.src, msg.step, msg.seg, target))
        delivered += 1
    unfinished = [r for r, m in enumerate(machines) if not m.done]
    assert not unfinished, f"ranks {unfinished} never finished"
    return delivered


Build = Callable[[int], Collective]
