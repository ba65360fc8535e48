"""The blocking spellings of the collectives: each ``X(...)`` is ``iX(...).wait()``.

Theory of operation. As in mpi4py, an ``i`` prefix marks the call that starts an operation and
returns its ``Request`` at once; the call without it is that one plus a wait, with the same
arguments, so it raises what the operation raised (or TimeoutError for ``timeout``). Only the
non-blocking calls check arguments and post; these only wait. ``Communicator`` mixes them in,
and has its own ``allreduce`` and ``barrier`` (the same, but faster where they can run on the
calling thread: comm.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import Request

__all__ = ["BlockingCalls"]


class BlockingCalls:
    """``allreduce``, ``broadcast``, ... as ``iallreduce(...).wait()``, ... (module docstring)."""

    if TYPE_CHECKING:  # what the communicator that mixes these in provides

        def iallreduce(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def ibroadcast(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def iallgather(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def ireduce_scatter(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def ireduce(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def igather(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def iscatter(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def ialltoall(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def isend(self, *args: Any, **kwargs: Any) -> Request[None]: ...
        def irecv(self, *args: Any, **kwargs: Any) -> Request[Any]: ...
        def ibarrier(self, *args: Any, **kwargs: Any) -> Request[None]: ...

    def broadcast(self, x: Any, root: int = 0, **kwargs: Any) -> Any:
        """``ibroadcast(...).wait()``."""
        return self.ibroadcast(x, root, **kwargs).wait()

    def allgather(self, x: Any, **kwargs: Any) -> Any:
        """``iallgather(...).wait()``."""
        return self.iallgather(x, **kwargs).wait()

    def reduce_scatter(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        """``ireduce_scatter(...).wait()``."""
        return self.ireduce_scatter(x, op, **kwargs).wait()

    def reduce(self, x: Any, op: str = "sum", root: int = 0, **kwargs: Any) -> Any:
        """``ireduce(...).wait()``."""
        return self.ireduce(x, op, root, **kwargs).wait()

    def gather(self, x: Any, root: int = 0, **kwargs: Any) -> Any:
        """``igather(...).wait()``."""
        return self.igather(x, root, **kwargs).wait()

    def scatter(self, out: Any, source: Any = None, root: int = 0, **kwargs: Any) -> Any:
        """``iscatter(...).wait()``."""
        return self.iscatter(out, source, root, **kwargs).wait()

    def alltoall(self, x: Any, **kwargs: Any) -> Any:
        """``ialltoall(...).wait()``."""
        return self.ialltoall(x, **kwargs).wait()

    def send(self, x: Any, dst: int, **kwargs: Any) -> None:
        """``isend(...).wait()``."""
        self.isend(x, dst, **kwargs).wait()

    def recv(self, x: Any, src: int, **kwargs: Any) -> Any:
        """``irecv(...).wait()``."""
        return self.irecv(x, src, **kwargs).wait()
