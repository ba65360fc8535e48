"""How long a waiting thread keeps moving what it waits for before it sleeps: a spin window.

A waiter moves the engine's loop (engine/core.py, ``drive``) or the same-host lane
(lane.py, ``Lane.drive``) itself, yielding the core between looks, for ``spin`` seconds from
its start or from the last progress it saw (each operation that completed or moved on gives
it another ``spin``), and never for longer than its ``timeout`` in all. Small operations come
in runs: the next one's peers are usually there within the window. Times come in; nothing here
reads a clock.
"""

from __future__ import annotations

import math

__all__ = ["SpinWindow"]


class SpinWindow:
    """One waiter's window (see the module docstring)."""

    __slots__ = ("_spin", "_last", "end")

    def __init__(self, spin: float, timeout: float | None, now: float) -> None:
        """``spin``: seconds after the start or a progress (already cut to ``timeout``)."""
        self._spin = spin
        self._last = now + timeout if timeout is not None else math.inf
        self.end = now + spin

    def moved(self, now: float) -> None:
        """Progress at ``now``: another ``spin`` from here, within the timeout."""
        self.end = min(now + self._spin, self._last)

    def over(self, now: float) -> bool:
        """Whether the waiter stops moving things at ``now`` (and sleeps)."""
        return now >= self.end
