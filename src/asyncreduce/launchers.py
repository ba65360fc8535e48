"""Who this process is in its job, and how its ranks will meet, from whichever launcher
started it.

Theory of operation. Every launcher tells its processes their place through environment
variables of its own. A launcher started inside another one's job also sees the outer one's
variables (inherited, and describing the outer job: ``srun`` around ``torchrun``, ``mpirun``
inside an ``sbatch`` script), so ``detect`` reads them innermost first and stops at the first
launcher present:

1. ``torchrun`` (``TORCHELASTIC_RUN_ID``) and ``asyncreduce run`` (``ASYNCREDUCE_RUN``):
   ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
2. ``mpirun``: Open MPI (``OMPI_COMM_WORLD_*``), MVAPICH (``MV2_COMM_WORLD_*``), MPICH's
   Hydra and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``),
   PMIx (``PMIX_RANK``, with the size from one of the others or from SLURM);
3. ``srun`` (``SLURM_PROCID``; see slurm.py);
4. ``RANK`` and ``WORLD_SIZE`` set by hand.

Variables that contradict the chosen launcher (a ``RANK`` left over in the environment of an
``mpirun`` job, two MPI families that disagree) are a ``UsageError`` naming both, never a
silent pick. Arguments given to ``init`` win over all of it.

How the ranks meet (``Rendezvous``): through ``init_method`` if given; under torchrun through
the store its agent already serves at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``), never a second one on its port; under srun at the
first host of the step on a port derived from the job id; under mpirun on one host at a port
derived from the job id, across hosts through MPI itself (rank 0 broadcasts where its store
listens) when mpi4py is installed; otherwise rank 0 serves the store at
``MASTER_ADDR:MASTER_PORT``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

from . import slurm
from .errors import UsageError

__all__ = ["Place", "Rendezvous", "detect"]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet. ``kind``: "serve" (rank 0 serves our store at host:port),
    "agent" (torchrun's store at host:port), "url" (``init_method``), "mpi" (rank 0 serves
    and tells the others through MPI). ``derived``: the port was derived from the job id
    (mpirun on one host, srun), so anyone on the host can predict it (docs/security.md)."""

    kind: str
    host: str | None = None
    port: int | None = None
    url: str | None = None
    derived: bool = False


@dataclass(frozen=True)
class Place:
    """This process's place in the job; ``local_*`` None: the launcher did not say (then
    they are counted among the ranks on this host at init)."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    launcher: str
    rendezvous: Rendezvous


#: MPI families, in the order they are read: (name, rank, size, local rank, local size).
_MPI = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIx", "PMIX_RANK", None, None, None),
)  # fmt: skip


def detect(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    init_method: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Place:
    """This process's place and rendezvous (see the module docstring); UsageError naming the
    variables when they are missing or contradict each other."""
    env = _os_environ() if env is None else env
    if (rank is None) != (world_size is None) and not _launched(env):
        missing = "world_size" if world_size is None else "rank"
        raise UsageError(f"init got {'rank' if rank is not None else 'world_size'} but not "
                         f"{missing}: pass both, or neither and let the launcher say")  # fmt: skip
    found = _from_launcher(env)
    if rank is not None and world_size is not None:
        found = Place(rank, world_size, found.local_rank if found else None,
                      found.local_world_size if found else None, "arguments",
                      found.rendezvous if found else Rendezvous("serve"))  # fmt: skip
    elif found is None:
        raise UsageError(
            "rank and world_size are unknown: pass them, or start the program with a launcher "
            "(asyncreduce run, torchrun, srun, mpirun), or set RANK and WORLD_SIZE"
        )
    elif rank is not None or world_size is not None:
        found = Place(rank if rank is not None else found.rank,
                      world_size if world_size is not None else found.world_size,
                      found.local_rank, found.local_world_size, found.launcher,
                      found.rendezvous)  # fmt: skip
    _check_place(found)
    return _with_rendezvous(found, master_addr, master_port, init_method, env)


def _os_environ() -> Mapping[str, str]:
    import os

    return os.environ


def _launched(env: Mapping[str, str]) -> bool:
    return _from_launcher(env) is not None


def _from_launcher(env: Mapping[str, str]) -> Place | None:
    """The innermost launcher's view, before the rendezvous is settled."""
    if "TORCHELASTIC_RUN_ID" in env or "ASYNCREDUCE_RUN" in env:
        name = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "asyncreduce run"
        agent = name == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return _plain(env, name, Rendezvous("agent" if agent else "serve"))
    mpi = None if _srun_through_pmi(env) else _from_mpi(env)
    if mpi is not None:
        return mpi
    try:
        task = slurm.from_environment(env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if task is not None:
        _agree_with_plain(env, "srun", task.rank, task.world_size, "SLURM_PROCID", "SLURM_NTASKS")
        meeting = Rendezvous("serve", task.master_addr, task.master_port,
                             derived=not env.get("MASTER_PORT"))  # fmt: skip
        return Place(task.rank, task.world_size, task.local_rank, task.local_world_size,
                     "srun", meeting)  # fmt: skip
    if "RANK" in env or "WORLD_SIZE" in env:
        return _plain(env, "environment", Rendezvous("serve"))
    return None


def _srun_through_pmi(env: Mapping[str, str]) -> bool:
    """srun itself, with a PMI plugin (MpiDefault=pmix or pmi2) that sets PMIX_RANK or
    PMI_RANK in every task: the same rank as SLURM_PROCID and no MPI runtime's own variables.
    (mpirun inside an allocation gives every rank the allocation's one SLURM_PROCID.)"""
    if "SLURM_PROCID" not in env:
        return False
    present = [f for f in _MPI if f[1] in env]
    own = any(f[0] in ("Open MPI", "MVAPICH") for f in present)
    return bool(present) and not own and all(env[f[1]] == env["SLURM_PROCID"] for f in present)


def _plain(env: Mapping[str, str], launcher: str, rendezvous: Rendezvous) -> Place:
    missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
    if missing:
        raise UsageError(f"{' and '.join(missing)} not set though "
                         f"{'RANK' if 'RANK' in env else 'WORLD_SIZE'} is: set both")  # fmt: skip
    return Place(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int_or_none(env, "LOCAL_RANK"),
                 _int_or_none(env, "LOCAL_WORLD_SIZE"), launcher, rendezvous)  # fmt: skip


def _from_mpi(env: Mapping[str, str]) -> Place | None:
    present = [family for family in _MPI if family[1] in env]
    if not present:
        return None
    name, rank_var, size_var, local_var, local_size_var = present[0]
    rank = _int(env, rank_var)
    for other in present[1:]:
        if _int(env, other[1]) != rank:
            raise UsageError(f"{rank_var}={env[rank_var]} but {other[1]}={env[other[1]]}: two "
                             "MPI launchers' variables disagree; unset the stale ones")  # fmt: skip
    sizes = [v for v in (size_var, *(f[2] for f in present[1:])) if v and v in env]
    sizes += ["SLURM_NTASKS"] if "SLURM_NTASKS" in env else []
    if not sizes:
        raise UsageError(f"{rank_var} is set but no world size is ({name}): set WORLD_SIZE")
    world = _int(env, sizes[0])
    _agree_with_plain(env, f"mpirun ({name})", rank, world, rank_var, sizes[0])
    local = _int_or_none(env, local_var) if local_var else None
    local_size = _int_or_none(env, local_size_var) if local_size_var else None
    return Place(rank, world, local, local_size, f"mpirun ({name})", Rendezvous("mpi"))


def _agree_with_plain(
    env: Mapping[str, str], launcher: str, rank: int, world: int, rank_var: str, size_var: str
) -> None:
    """A hand-set (or leftover) RANK / WORLD_SIZE must say what the launcher says."""
    for plain, value, theirs in (("RANK", rank, rank_var), ("WORLD_SIZE", world, size_var)):
        if plain in env and _int(env, plain) != value:
            raise UsageError(
                f"{plain}={env[plain]} but {theirs}={env[theirs]} ({launcher} started this "
                f"process): the environment contradicts the launcher; unset {plain}"
            )


def _check_place(place: Place) -> None:
    if place.world_size < 1 or not 0 <= place.rank < place.world_size:
        raise UsageError(f"rank {place.rank} is not within a world of size {place.world_size} "
                         f"(from {place.launcher})")  # fmt: skip
    local, size = place.local_rank, place.local_world_size
    if local is not None and size is not None and not 0 <= local < size <= place.world_size:
        raise UsageError(f"local rank {local} of {size} on this host does not fit a world of "
                         f"{place.world_size} (from {place.launcher})")  # fmt: skip


def _with_rendezvous(
    place: Place, addr: str | None, port: int | None, init_method: str | None,
    env: Mapping[str, str],
) -> Place:  # fmt: skip
    meeting = place.rendezvous
    if place.world_size == 1:
        return place  # nobody to meet
    explicit = addr is not None or port is not None
    chosen = port is not None or _port_or_none(env) is not None  # a port someone chose
    addr = addr or env.get("MASTER_ADDR") or meeting.host
    port = port if port is not None else _port_or_none(env) or meeting.port
    if init_method is not None:
        meeting = Rendezvous("url", url=init_method)
    elif explicit:  # init(master_addr=..., master_port=...): rank 0 serves there
        meeting = Rendezvous("serve", addr, port, derived=meeting.derived and not chosen)
    elif meeting.kind == "agent":
        if addr is None or port is None:
            raise UsageError("torchrun set TORCHELASTIC_USE_AGENT_STORE but not MASTER_ADDR "
                             "and MASTER_PORT, where its store serves")  # fmt: skip
        meeting = Rendezvous("agent", addr, port)
    elif meeting.kind == "mpi":
        meeting = _mpi_rendezvous(place, addr, port, env)
    else:
        meeting = Rendezvous("serve", addr, port, derived=meeting.derived and not chosen)
    if meeting.kind == "serve" and (meeting.host is None or meeting.port is None):
        missing = [n for n, v in (("MASTER_ADDR", meeting.host), ("MASTER_PORT", meeting.port))
                   if v is None]  # fmt: skip
        raise UsageError(
            f"rendezvous needs to know where rank 0 serves the store: set {' and '.join(missing)}"
            " (or pass master_addr= and master_port=, or init_method='tcp://HOST:PORT' or "
            "'file:///PATH')"
        )
    return Place(place.rank, place.world_size, place.local_rank, place.local_world_size,
                 place.launcher, meeting)  # fmt: skip


def _mpi_rendezvous(
    place: Place, addr: str | None, port: int | None, env: Mapping[str, str]
) -> Rendezvous:
    """mpirun: MASTER_ADDR/MASTER_PORT if given; on one host a port every rank derives from
    Open MPI's job id; across hosts, through MPI itself (mpi4py)."""
    if addr is not None and port is not None:
        return Rendezvous("serve", addr, port)
    job = env.get("OMPI_MCA_ess_base_jobid", "")  # noqa: SIM112 (Open MPI's spelling)
    if place.local_world_size == place.world_size and job.isdigit():
        # below Linux's ephemeral range (32768 and up), where no connection of ours can hold it
        return Rendezvous("serve", addr or "127.0.0.1", port or 12000 + int(job) % 20000,
                          derived=port is None)  # fmt: skip
    if importlib.util.find_spec("mpi4py") is not None:
        return Rendezvous("mpi")
    raise UsageError(
        f"{place.launcher} across hosts: set MASTER_ADDR and MASTER_PORT for every rank "
        "(mpirun -x MASTER_ADDR=... -x MASTER_PORT=...), or install mpi4py, through which "
        "rank 0 then tells the others where it listens"
    )


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _int_or_none(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if env.get(name, "").strip() else None


def _port_or_none(env: Mapping[str, str]) -> int | None:
    text = env.get("MASTER_PORT", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UsageError(f"MASTER_PORT must be a port number in 1..65535, got {text!r}")
    return int(text)
