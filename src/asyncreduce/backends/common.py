"""What the native and the ordered backend share: passing calls on to their engine's thread,
and the DEBUG line of each posted operation."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..flight import FlightRecorder
from ..plans import Plan
from ..transport.frame import Descriptor

__all__ = ["EngineBackend", "log_post"]

log_ops = logging.getLogger("asyncreduce.ops")  # a line per operation, when asked (see comm.py)


class _Runs(Protocol):
    """What the native and the ordered engine both offer."""

    flight: FlightRecorder

    def close(self) -> None: ...

    def abort(self, reason: str = "") -> None: ...

    @property
    def broken(self) -> BaseException | None: ...

    @property
    def stall_reports(self) -> list[str]: ...


class EngineBackend:
    """The part of a backend that only passes calls on to its engine's thread."""

    _runs: _Runs

    def refusal(self, plan: Plan, priority: int) -> str | None:
        return None  # our own engine runs every plan the communicator builds

    def close(self) -> None:
        self._runs.close()

    def abort(self, reason: str) -> None:
        self._runs.abort(reason)

    @property
    def broken(self) -> BaseException | None:
        return self._runs.broken

    @property
    def stall_reports(self) -> list[str]:
        return self._runs.stall_reports

    def flight_record(self) -> dict[str, Any]:
        return self._runs.flight.snapshot()

    def dump_flight_record(self, path: str) -> str:
        return self._runs.flight.dump(path)


def log_post(rank: int, label: str, desc: Descriptor) -> None:
    """The ``asyncreduce.ops`` DEBUG line of one posted operation."""
    if log_ops.isEnabledFor(logging.DEBUG):
        log_ops.debug("rank %d posts %s: %s", rank, label, desc)
