"""Stall warnings in the ordered engine: an operation posted here and not agreed after
ASYNCREDUCE_STALL_WARNING seconds gives a warning (once per that many seconds) naming the ranks
that have not posted it; the last 100 are kept in ``stall_reports``.

The ordered engine asks nobody: its agreement (agreement.py) already knows who posted what, so
the warning is worded here, at a beat (engine.py), from what it says. The native engine asks
its peers instead (protocol/stall.py). Times are passed in (monotonic seconds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...keys import Key
from .posted import Posted

__all__ = ["Stalls"]

log = logging.getLogger("asyncreduce.ordered")
_REPORTS = 100  # stall warnings kept


class Stalls:
    """The stall warnings of one ordered engine (module docstring); only its thread calls these."""

    def __init__(self, rank: int, stall_warning: float) -> None:
        """``stall_warning``: seconds an operation may wait before a warning (0: never)."""
        self.rank = rank
        self.stall_reports: list[str] = []
        self._after = stall_warning
        self._warned: dict[Key, float] = {}

    def inspect(
        self, now: float, posted: dict[Key, Posted], waiting_for: Callable[[Posted], str]
    ) -> None:
        """Warn of the ``posted`` operations pending for too long (``waiting_for``: why)."""
        after = self._after
        if after <= 0:
            return
        for key, op in posted.items():
            due = now - op.started >= after and now - self._warned.get(key, -1e18) >= after
            if due and not op.request.done():
                self._warned[key] = now
                message = (f"stall: {op.label} posted on rank {self.rank} "
                           f"{now - op.started:.0f} s ago; {waiting_for(op)}")  # fmt: skip
                self.stall_reports.append(message)
                del self.stall_reports[:-_REPORTS]
                log.warning("%s", message)

    def agreed(self, key: Key) -> None:
        """``key`` was agreed: it stalls no more."""
        self._warned.pop(key, None)
