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
Every payload sent is a snapshot, because the buffer keeps changing after the send.
"""

from __future__ import annotations

from .base import Array, Collective, ProtocolError, Send
from .reduction import DType, combine, finalize

__all__ = ["RecursiveDoubling"]


class RecursiveDoubling(Collective):
    """Allreduce of ``buffer`` in place by recursive doubling."""

    def __init__(
        self, rank: int, world_size: int, buffer: Array, dtype: DType, reduce_op: str
    ) -> None:
        super().__init__(rank, world_size)
        self.buffer = buffer
        self.dtype = dtype
        self.reduce_op = reduce_op
        p = 1 << (world_size.bit_length() - 1)
        self._extra = world_size - p
        self._rounds = p.bit_length() - 1
        self._last_step = self._rounds + 1
        self._sits_out = rank < 2 * self._extra and rank % 2 == 0
        self._virtual = rank // 2 if rank < 2 * self._extra else rank - self._extra
        self._step = 0  # the next step this rank performs
        self._sent_step = 0
        self._early: dict[int, Array] = {}
        self._sources = self._schedule()  # step -> the rank this one receives from
        self._expected = len(self._sources)

    def _real(self, virtual: int) -> int:
        return virtual * 2 + 1 if virtual < self._extra else virtual + self._extra

    def _schedule(self) -> dict[int, int]:
        """step -> the rank this one receives from at that step."""
        if self._sits_out:
            return {self._last_step: self.rank + 1}
        steps = {s: self._real(self._virtual ^ (1 << (s - 1))) for s in range(1, self._rounds + 1)}
        if self.rank < 2 * self._extra:
            steps[0] = self.rank - 1
        return steps

    @property
    def pending_sources(self) -> set[int]:
        if self.done:
            return set()
        waiting = self._sources.items()
        return {src for step, src in waiting if step >= self._step and step not in self._early}

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
