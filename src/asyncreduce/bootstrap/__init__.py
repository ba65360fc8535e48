"""Building a communicator: from the launcher's environment to connected ranks.

Theory of operation. ``init`` asks launchers.py who this process is and how the ranks meet,
opens that store (ours, served by rank 0; torchrun's agent store; a file store; or ours with
its address sent through MPI), and ``connect`` does the rest over it:

1. every rank checks its world size against rank 0's (a rank told otherwise stops every rank
   at once through an ``abort`` key, naming both sizes, instead of leaving them to time out);
2. each rank listens on the address on its route to the store, publishes it, and the mesh is
   dialled (one TCP connection per pair, authenticated when there is a secret);
3. ranks on the same host (same boot and network namespace) map shared-memory arenas, and the
   ranks on a host count themselves (``local_rank``, ``local_world_size``, unless the launcher
   said);
4. when every rank is on one host, cross-memory attach is probed (see samehost/cma.py);
5. rank 0 keeps a store it serves open until every rank is done with it; the engine starts,
   the ranks agree on a shared clock origin, open the same-host lane where they all want it,
   and one INFO line says what was chosen.

In torchrun's store, which outlives any one rendezvous, every init keeps its keys under a
namespace of its own (``asyncreduce/<restart>/<n>/``).

A process that restarts a rank of an elastic job (``ASYNCREDUCE_RESTART`` above 0, with
``ASYNCREDUCE_DOORS``) does not meet the others in a store: it knocks on their doors until
they let it in at a step boundary (doors.py; ``rejoin``).
"""

from __future__ import annotations

import os

from ..comm import Communicator
from ..errors import UsageError
from .doors import doors_from_env, restart_count, stand_in
from .native import join, rejoin

__all__ = ["init"]


def init(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    init_method: str | None = None,
    timeout: float = 30.0,
    backend: str | None = None,
    comm: object = None,
    group: object = None,
) -> Communicator:
    """Join the job and connect to every other rank.

    Inside an initialized torch.distributed job (``dist.init_process_group`` first), and with
    no argument given, the ranks meet in that job's store. Otherwise anything not given comes
    from the launcher: ``asyncreduce run``, torchrun (through the
    store its agent serves), srun, mpirun (Open MPI, MPICH/Hydra, MVAPICH, PMIx; on one host
    nothing more is needed, across hosts either MASTER_ADDR/MASTER_PORT or mpi4py), or RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand. ``init_method`` may be
    ``tcp://host:port`` or ``file:///shared/dir``. Raises UsageError when the environment is
    incomplete or contradicts itself, and TimeoutError naming the ranks that did not join
    within ``timeout`` seconds.

    ``backend`` (default: ASYNCREDUCE_BACKEND, else "native"): "native" is our own engine;
    "mpi" runs the same operations over mpi4py (``comm``: a communicator, COMM_WORLD by
    default); "torch" over a group of an initialized torch.distributed job (``group``, its
    WORLD by default: gloo, nccl, ...). See docs/engines.md.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(
            f"timeout must be a positive number of seconds (how long to wait for the other "
            f"ranks to join), got {timeout!r}"
        )
    chosen = backend or os.environ.get("ASYNCREDUCE_BACKEND") or "native"
    if chosen not in ("native", "mpi", "torch"):
        raise UsageError(f"backend={chosen!r} is not one of native, mpi, torch")
    if comm is not None and chosen != "mpi" or group is not None and chosen != "torch":
        raise UsageError("comm= is for backend='mpi' and group= for backend='torch'")
    if chosen == "mpi":
        from .ordered import connect_mpi

        return connect_mpi(comm, timeout)
    if chosen == "torch":
        from .ordered import connect_torch

        return connect_torch(group, timeout)
    stand_in()  # (a spare of an elastic job waits here until a rank needs it)
    if restart_count() > 0 and doors_from_env() is not None:  # a restarted elastic rank
        return rejoin(timeout)
    return join(rank, world_size, master_addr, master_port, init_method, timeout)
