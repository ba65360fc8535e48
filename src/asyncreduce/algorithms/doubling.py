"""Recursive-doubling allreduce: the fewest rounds, for small buffers.

Theory of operation (n ranks, p the largest power of two <= n, extra = n - p):

* step 0 (only if n is not a power of two): each even rank r < 2*extra sends its whole buffer
  to r+1 and sits out; r+1 combines it. The p ranks left take virtual ranks 0..p-1.
* steps 1..log2(p): virtual rank v exchanges its whole buffer with v xor 2^(step-1) and
  combines. Both partners combine the same two operands in the same order (the lower rank's
  first), so they stay bitwise equal.
* last step (only if n is not a power of two): r+1 sends the result back to r.

log2(p) + 2 rounds at most, each moving the whole buffer: right when latency, not bandwidth,
decides. Messages of a later round may arrive before those of an earlier one; they wait.
Every payload sent is a snapshot, because the buffer keeps changing after the send. The
message a rank is waiting for is combined straight from where it arrived (``on_view``);
one that comes early is copied and waits.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from ..kernels.fold import Combining, Swap
from ..kernels.reduction import REDUCTION_CODES, DType, combine, finalize, quiet_numpy
from .base import Array, Collective, ProtocolError, Send

__all__ = ["DirectAllreduce", "RecursiveDoubling"]


class RecursiveDoubling(Collective):
    """Allreduce of ``buffer`` in place by recursive doubling."""

    def __init__(
        self, rank: int, world_size: int, buffer: Array, dtype: DType, reduce_op: str
    ) -> None:
        super().__init__(rank, world_size)
        self.buffer = buffer
        self.dtype = dtype
        self.reduce_op = reduce_op
        plan = _schedule(rank, world_size)
        self._extra, self._rounds, self._sits_out, self._sources, self.partners = plan[:5]
        # (partners: every rank this one exchanges with; it receives from each what it sends)
        self.swaps = plan.swaps  # (RunsDirectly: with a power of two ranks, every step)
        self.sources = self.partners  # (RunsDirectly: whose streams a direct run reads)
        self.message_bytes = int(buffer.nbytes)  # (RunsDirectly: every message, the buffer)
        self._last_step = self._rounds + 1
        self._step = 0  # the next step this rank performs
        self._sent_step = 0
        self._early: dict[int, Array] = {}
        self._expected = len(self._sources)

    @property
    def pending_sources(self) -> set[int]:
        if self.done:
            return set()
        waiting = self._sources.items()
        return {src for step, src in waiting if step >= self._step and step not in self._early}

    @property
    def awaited(self) -> tuple[int, int] | None:
        """(the rank, the step) of the message this rank needs next; None once done. A
        caller that moves the messages itself (``Engine.run_direct``) reads which one to take."""
        if self._received == self._expected:  # (done, without the property: every look asks)
            return None
        step = self._last_step if self._sits_out else self._step
        return self._sources[step], step

    def start(self) -> list[Send]:
        if self.world_size == 1:
            return []
        if self._sits_out:
            return [Send(self.rank + 1, 0, 0, self.buffer.copy())]
        self._step = 0 if 0 in self._sources else 1
        return self._advance()

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        fresh = not self.done and step not in self._early and step >= self._step
        if self._sources.get(step) != src or seg != 0 or not fresh:
            raise ProtocolError(f"recursive doubling: unexpected step {step} from rank {src}")
        target = self.buffer if step == self._last_step else self.buffer.copy()
        return self._check_size("recursive doubling", target, nbytes)

    def takes_view(self, src: int, step: int, seg: int) -> bool:
        """The message this rank waits for now (not the final result): combined straight from
        the view, with no copy of the buffer to receive into."""
        current = step == self._step and step != self._last_step and seg == 0
        return current and self._received != self._expected and self._sources.get(step) == src

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]:
        if not self.takes_view(src, step, seg):
            return super().on_view(src, step, seg, view)
        buffer = self.buffer
        self._check_size("recursive doubling", buffer, view.nbytes)
        self._received += 1  # (on_message, then _advance, by the short way: it is this step's)
        incoming = np.frombuffer(view, buffer.dtype)
        combine(self.dtype, self.reduce_op, buffer, incoming, src < self.rank)
        self._step += 1
        return self._advance()

    @property
    def combining(self) -> Combining:
        """(``RunsDirectly``) How each of ``swaps`` combines: into the buffer, as ``on_view``."""
        return _combining(self.buffer, self.dtype, self.reduce_op)

    def swapped(self, done: int) -> list[Send]:
        """(``RunsDirectly``) The caller ran the first ``done`` of ``swaps`` and the message
        of the next one left: go on from there (``on_view`` of that step's message next)."""
        rounds = self._rounds
        if self.swaps is None or not 0 <= done <= rounds or self._step:
            raise ProtocolError(f"recursive doubling: {done} swaps cannot have run here")
        self._received = done
        if done < rounds:
            self._step = self._sent_step = done + 1  # (steps are 1..rounds; this one's sent)
            return []
        self._step, self._sent_step = rounds + 1, rounds  # (every step done: _advance ends it)
        if self.reduce_op == "avg":  # (it divides, on a caller's thread: numpy's errors,
            return quiet_numpy(self._advance)  # ours)
        return self._advance()

    def finished(self) -> None:
        """Every step ran elsewhere (a direct run's swaps, ``DirectAllreduce``) and the
        buffer holds the result, divided for avg: done, with nothing left to send."""
        if self.swaps is None or self._step:
            raise ProtocolError("recursive doubling: only a fresh run with swaps can be done")
        self._received = self._expected
        self._step, self._sent_step = self._last_step + 1, self._rounds

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._received += 1
        if self._sits_out:
            return []  # the result was received straight into the buffer
        self._early[step] = payload
        return self._advance()

    def _advance(self) -> list[Send]:
        """Run steps in order for as long as their messages are here."""
        sends: list[Send] = []
        while self._step <= self._rounds:
            step = self._step
            if step >= 1 and self._sent_step < step:
                partner = self._sources[step]
                sends.append(Send(partner, step, 0, self.buffer.copy()))
                self._sent_step = step
            if step not in self._early:
                return sends
            partner_first = self._sources[step] < self.rank  # same operand order on both
            combine(self.dtype, self.reduce_op, self.buffer, self._early.pop(step), partner_first)
            self._step += 1
        if self._step == self._rounds + 1:
            self._step += 1
            finalize(self.dtype, self.reduce_op, self.buffer, self.world_size)
            if self.rank < 2 * self._extra:
                sends.append(Send(self.rank - 1, self._last_step, 0, self.buffer.copy()))
        return sends


class DirectAllreduce:
    """A small allreduce as a direct run (``Engine.run_direct``, a ``RunsDirectly``) sees it: the
    swaps of recursive doubling (with a power of two ranks; worked out once per rank and
    world size) over the buffer, no more. It costs a fraction of ``RecursiveDoubling``'s
    set-up, which most direct runs never need: the algorithm itself is made (``algorithm``)
    only where a run cannot end with its swaps, or has none."""

    __slots__ = ("rank", "world_size", "buffer", "dtype", "reduce_op", "swaps", "sources",
                 "partners", "message_bytes", "combining", "_algorithm", "_swapped")  # fmt: skip

    def __init__(
        self, rank: int, world_size: int, buffer: Array, dtype: DType, reduce_op: str
    ) -> None:
        self.rank, self.world_size, self.buffer = rank, world_size, buffer
        self.dtype, self.reduce_op = dtype, reduce_op
        plan = _schedule(rank, world_size)
        self.swaps, self.sources = plan.swaps, plan.partners  # (RecursiveDoubling's own)
        self.partners, self.message_bytes = plan.partners, buffer.nbytes
        self.combining = _combining(buffer, dtype, reduce_op)
        self._algorithm: RecursiveDoubling | None = None
        self._swapped = False  # every swap ran, with no algorithm made: done

    @property
    def done(self) -> bool:
        return self._swapped or (self._algorithm is not None and self._algorithm.done)

    @property
    def algorithm(self) -> RecursiveDoubling:
        """The allreduce itself, made the first time it is asked for (the same one after);
        after every swap ran, one that is done (the buffer holds the result: nothing is
        combined or divided again)."""
        if self._algorithm is None:
            algorithm = RecursiveDoubling(
                self.rank, self.world_size, self.buffer, self.dtype, self.reduce_op
            )
            if self._swapped:
                algorithm.finished()
            self._algorithm = algorithm
        return self._algorithm

    def start(self) -> list[Send]:
        return self.algorithm.start()

    @property
    def awaited(self) -> tuple[int, int] | None:
        return None if self._swapped else self.algorithm.awaited

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]:
        return self.algorithm.on_view(src, step, seg, view)

    def swapped(self, done: int) -> list[Send]:
        """(``RunsDirectly``) As ``RecursiveDoubling.swapped``; after every swap, only avg's
        division is left (on a caller's thread: numpy's errors quiet, as ours)."""
        if self._algorithm is not None or self.swaps is None or done != len(self.swaps):
            return self.algorithm.swapped(done)
        self._swapped = True
        if self.reduce_op == "avg":
            quiet_numpy(finalize, self.dtype, "avg", self.buffer, self.world_size)
        return []


def _combining(buffer: Array, dtype: DType, reduce_op: str) -> Combining:
    """How a swap combines into ``buffer`` (its bytes, the type's and the reduction's codes)."""
    into = memoryview(buffer).cast("B")  # type: ignore[arg-type]
    return Combining(into, dtype.code, REDUCTION_CODES[reduce_op])


class _Schedule(NamedTuple):
    extra: int
    rounds: int
    sits_out: bool
    sources: Mapping[int, int]  # {step: the rank this one receives from then}
    partners: frozenset[int]  # the ranks it receives from (and sends to)
    swaps: tuple[Swap, ...] | None  # every step, with a power of two ranks


@functools.cache
def _schedule(rank: int, world_size: int) -> _Schedule:
    """A rank's steps: the same for every operation of a communicator, so worked out once
    (read-only)."""
    p = 1 << (world_size.bit_length() - 1)
    extra = world_size - p
    rounds = p.bit_length() - 1
    if rank < 2 * extra and rank % 2 == 0:
        last = MappingProxyType({rounds + 1: rank + 1})
        return _Schedule(extra, rounds, True, last, frozenset({rank + 1}), None)
    virtual = rank // 2 if rank < 2 * extra else rank - extra

    def real(v: int) -> int:
        return v * 2 + 1 if v < extra else v + extra

    steps = {s: real(virtual ^ (1 << (s - 1))) for s in range(1, rounds + 1)}
    if rank < 2 * extra:
        steps[0] = rank - 1
    swaps = None
    if not extra and world_size > 1:
        swaps = tuple(Swap(peer, step, peer < rank) for step, peer in steps.items())
    sources = MappingProxyType(steps)
    return _Schedule(extra, rounds, False, sources, frozenset(steps.values()), swaps)
