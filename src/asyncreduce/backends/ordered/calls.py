"""Engine calls in the ordered engine: what every rank agreed, issued in the agreed order as
calls of the engine under us, and tested until each ends.

Theory of operation. The agreement (agreement.py) hands over a round's agreed operations in
the order every rank shares. A mismatch is seen by every rank in the same round: nobody runs
that one, and every rank breaks (failure.py); the rest of the round still runs everywhere (on
scratch memory where the request failed), so no peer is left alone in an engine call. What
runs is fused (fusion.py: small allreduces of one dtype and reduction as one call) and issued
through the adapter (posted.py), which returns at once; point-to-point operations need no
agreement and are issued as they come. The engine's thread tests every call in flight without
blocking (which is what makes MPI progress while the caller computes): a finished one
completes its operations, a failed one (or one the engine refused) fails them and breaks.
"""

from __future__ import annotations

import logging
import os

from ...errors import BrokenError, MismatchError
from ...flight import FlightRecorder
from ...keys import Key
from ...protocol import describe
from .agreement import Agreed
from .failure import Breaker
from .fusion import Call, complete, fuse, pack
from .posted import Adapter, Posted
from .stalls import Stalls

__all__ = ["CallRunner"]

log = logging.getLogger("asyncreduce.ordered")


class CallRunner:
    """Runs one ordered engine's agreed operations as engine calls (module docstring); only
    its thread calls these."""

    def __init__(
        self, adapter: Adapter, rank: int, world_size: int, flight: FlightRecorder,
        stalls: Stalls, posted: dict[Key, Posted], calls: list[Call], breaker: Breaker,
    ) -> None:  # fmt: skip
        """``posted`` and ``calls``: the engine's operations not yet agreed and its engine calls
        in flight (the engine's own tables: agreed ones leave the first, calls join the second)."""
        self.adapter, self.rank, self.world_size = adapter, rank, world_size
        self.flight, self._stalls = flight, stalls
        self._posted, self._calls, self._breaker = posted, calls, breaker
        self.issued = 0  # engine calls issued (fusion makes this smaller than the operations)

    def run_agreed(self, agreed: list[Agreed], fusion_bytes: int) -> None:
        """Issue what every rank agreed, in order, but a mismatch (module docstring), fusing
        up to ``fusion_bytes`` (the engine's, read at each round: a benchmark changes it)."""
        ops = []
        for a in agreed:
            op = self._posted.pop(a.key, None)
            self._stalls.agreed(a.key)
            if op is None:  # cannot happen: every agreed key was posted here
                log.error("rank %d: agreed %r was never posted here", self.rank, a.key)
                continue
            if a.mismatch is not None:
                other, mine, theirs = a.mismatch
                self._breaker.fail_everywhere(op, MismatchError(
                    f"{op.label}: rank {self.rank} posted {describe(mine)} "
                    f"but rank {other} posted {describe(theirs)}"))  # fmt: skip
                continue
            ops.append(op)
        for group in fuse(ops, fusion_bytes):
            self.issue(group)

    def issue(self, group: list[Posted]) -> None:
        """Start one engine call of ``group`` (one operation, or several fused)."""
        first = group[0]
        scratch = pack(group)
        try:
            running = self.adapter.start(first, first.flat if scratch is None else scratch)
        except Exception as exc:
            why = f"the {self.adapter.name} engine refused it on rank {self.rank}: {exc}"
            self._breaker.fail_call(group, BrokenError(f"{first.label}: {why}"))
            return
        self.issued += 1
        self._calls.append(Call(group, running, scratch))

    def poll(self) -> bool:
        """Test every call in flight once: whether any ended."""
        moved = False
        for call in list(self._calls):
            try:
                finished = call.running.done()
            except Exception as exc:
                self._calls.remove(call)
                cls = MismatchError if isinstance(exc, MismatchError) else BrokenError
                self._breaker.fail_call(call.ops, cls(
                    f"{call.ops[0].label}: the {self.adapter.name} engine failed on rank "
                    f"{self.rank}: {exc}"))  # fmt: skip
                return True
            if finished:
                moved = True
                self._calls.remove(call)
                complete(call, self.world_size, self.flight)
                os.sched_yield()  # let the waiter take the GIL now, not at the next switch
        return moved
