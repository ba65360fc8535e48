"""A world of one: no engine, no peer; every operation runs as it is posted, on the caller's
thread, with the same algorithm a larger world would build."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..keys import Key
from ..plans import Plan
from ..request import Request
from ..samehost.planes import DataPlane, SharedPlanes
from .common import log_post
from .native import built

if TYPE_CHECKING:
    from ..engine import Engine
    from .ordered.engine import OrderedEngine

__all__ = ["LocalBackend"]


class LocalBackend:
    """A world of one: nothing to talk to; every operation completes as it is posted."""

    devices = False
    members: tuple[int, ...] = (0,)
    engine: Engine | None = None
    ordered: OrderedEngine | None = None
    broken: BaseException | None = None

    def __init__(self) -> None:
        self.planes = SharedPlanes(False, None)

    def refusal(self, plan: Plan, priority: int) -> str | None:
        return None

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        algo, desc = built(plan, 0, 1, self.planes)
        log_post(0, label, desc)
        algo.start()
        request.set_result(plan.result())

    def group(self, members: tuple[int, ...]) -> LocalBackend:
        return LocalBackend()

    def close(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    @property
    def stall_reports(self) -> list[str]:
        return []

    @property
    def data_plane(self) -> DataPlane:
        return DataPlane("local")

    def flight_record(self) -> dict[str, Any]:
        return {"rank": 0, "world_size": 1, "records": []}

    def dump_flight_record(self, path: str) -> str:
        raise UsageError("a world of one records no operations")
