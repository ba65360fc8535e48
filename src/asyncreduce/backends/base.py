"""What a communicator needs from the thing that runs its operations: the backend interface.

Theory of operation. The communicator checks a call's arguments, gives the operation its key
and label and makes its ``Request``; everything after that is the backend's: it turns the
``Plan`` (kind, buffer, reduction, root, for direct exchanges the peers' blocks) into what its
engine runs, and completes the request. A backend also closes and aborts, says whether (and
why) it broke, keeps the stall warnings and the flight record, and says which data plane its
operations use. There is one backend per kind of engine: ``LocalBackend`` (a world of one:
nothing to talk to), ``NativeBackend`` (our own engine, key-matched, over TCP or shared
memory) and ``OrderedBackend`` (engines that need one order on every rank: MPI,
torch.distributed; see ordered/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..keys import Key
from ..plans import Plan
from ..request import Request
from ..samehost.planes import DataPlane, SharedPlanes

if TYPE_CHECKING:
    from ..engine import Engine
    from .ordered.engine import OrderedEngine

__all__ = ["Backend"]


class Backend(Protocol):
    """What runs a communicator's operations (this module's docstring)."""

    #: True where CUDA tensors are taken as they are (backend="torch"), not staged.
    devices: bool
    #: The engine's rank of each of the communicator's ranks (a group: its members).
    members: tuple[int, ...]
    #: The same-host memory its allreduces may read in place (and shared_empty's windows).
    planes: SharedPlanes

    @property
    def engine(self) -> Engine | OrderedEngine | None:
        """The engine object, for diagnostics (None in a world of one)."""

    @property
    def ordered(self) -> OrderedEngine | None:
        """The ordered engine, where this backend is one (diagnostics, torch staging)."""

    def refusal(self, plan: Plan, priority: int) -> str | None:
        """Why this backend cannot run ``plan`` (the caller gets a UsageError), or None. Asked
        before the operation takes a key, so a refused post leaves the ranks' counters alike."""

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        """Start ``plan`` as operation ``key``; ``request`` gets its result or error."""

    def group(self, members: tuple[int, ...]) -> Backend:
        """The backend of a group of ``members`` (ranks of this backend's communicator)."""

    def close(self) -> None:
        """Fail what is pending with ClosedError, say goodbye, release everything."""

    def abort(self, reason: str) -> None:
        """Break every rank's communicator now, with ``reason``."""

    @property
    def broken(self) -> BaseException | None:
        """What broke the communicator, or None."""

    @property
    def stall_reports(self) -> list[str]:
        """The stall warnings given, newest last."""

    @property
    def data_plane(self) -> DataPlane:
        """Which data plane the operations use."""

    def flight_record(self) -> dict[str, Any]:
        """The last operations as a JSON-ready dict (see ``asyncreduce.flight``)."""

    def dump_flight_record(self, path: str) -> str:
        """Write ``flight_record()`` to ``path`` (a file or a directory); return the file."""
