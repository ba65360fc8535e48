"""Worker sets inside an emulated cluster (``scripts/cluster.py``), one rank per host.

``scaling.py`` and ``overlap.py --hosts`` run the workers of the ``MARK`` protocol on K
emulated hosts (network namespaces behind shaped links) instead of N processes here:
asyncreduce and Gloo ranks meet at host 0's address (``cluster_env``), Open MPI is one
``mpirun`` in host 0 over ``btl self,tcp`` on the cluster interface (``cluster_mpirun``, as
``links.py`` runs it). ``run_cluster_set`` runs one such set and hands rank 0's reports on
as they come; ``run_set_in_cluster`` is ``run_set`` for a cluster, recording results and a
failure in the ``Run``. The harness uses a cluster only through ``Hosts``, the few members of
``scripts/cluster.py``'s ``Cluster`` it needs; ``load_module`` imports that file by path
(scripts/ is no package).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from .machine import package_root
from .ranks import MARK
from .workers import (
    Progress,
    Run,
    SetSpec,
    WorkerSetError,
    failure_of,
    set_name,
    set_tag,
    take_report,
    unavailable,
    under_mpirun,
    worker_command,
)

__all__ = [
    "MPI_FORWARD",
    "Hosts",
    "cluster_env",
    "cluster_mpirun",
    "cluster_unavailable",
    "load_module",
    "run_cluster_set",
    "run_set_in_cluster",
]


class Hosts(Protocol):
    """What the harness uses of an emulated cluster (``scripts/cluster.py``'s ``Cluster``)."""

    @property
    def hosts(self) -> int:
        """How many hosts (one rank each)."""

    @property
    def addrs(self) -> Sequence[str]:
        """Each host's address on the cluster network, host order."""

    @property
    def ifname(self) -> str:
        """The cluster interface's name inside every host."""

    def run(
        self,
        argv: Sequence[str],
        env: Callable[[int], Mapping[str, str]],
        *,
        timeout: float | None = None,
        on_line: Callable[[int, str], None] | None = None,
        on: Sequence[int] | None = None,
    ) -> list[int]:
        """Run ``argv`` in every host (or those ``on``); the exit codes, host order."""

    def mpirun_argv(self, argv: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
        """``mpirun`` of ``argv``, one rank per host, over the cluster; run it in host 0."""


def load_module(name: str, path: Path) -> ModuleType:
    """Import a file of this checkout by path (``scripts/cluster.py``: scripts/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def cluster_env(c: Hosts, host: int, master_port: int) -> dict[str, str]:
    """The environment of rank ``host`` in cluster ``c``: one rank per host, rank 0's address
    as MASTER_ADDR, its own as ASYNCREDUCE_ADDR, Gloo on the cluster's interface, and the
    asyncreduce this process imports on PYTHONPATH (any port will do: the hosts are private)."""
    env = {
        "PYTHONUNBUFFERED": "1",
        "RANK": str(host),
        "WORLD_SIZE": str(c.hosts),
        "MASTER_ADDR": c.addrs[0],
        "MASTER_PORT": str(master_port),
        "ASYNCREDUCE_ADDR": c.addrs[host],
        "GLOO_SOCKET_IFNAME": c.ifname,
    }
    root = package_root()
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return env


class _ClusterLines:
    """``on_line`` for ``Cluster.run``: rank 0's reports go to ``take``; the last lines of
    everything else are kept for the message of a failed set."""

    def __init__(self, take: Callable[[dict[str, Any]], None], mark: str) -> None:
        self.take, self.mark = take, mark
        self.done = False
        self.tails: dict[int, list[str]] = {}

    def __call__(self, host: int, line: str) -> None:
        if line.startswith(self.mark):
            with contextlib.suppress(json.JSONDecodeError):
                message = json.loads(line[len(self.mark) :])
                self.done = self.done or message.get("event") == "done"
                self.take(message)
                return
        self.tails.setdefault(host, []).append(line)
        del self.tails[host][:-12]

    def tail(self) -> str:
        return "\n".join(
            f"  h{host}: {line}" for host, lines in sorted(self.tails.items()) for line in lines
        )


def run_cluster_set(
    c: Hosts, argv: Sequence[str], env: Callable[[int], dict[str, str]], limit_s: float,
    take: Callable[[dict[str, Any]], None], mark: str = MARK, on: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Run ``argv`` once in every host of cluster ``c`` (``env(host)`` adds to its
    environment; ``on=[0]``: in host 0 only, for one ``mpirun``) and hand each report of rank
    0 to ``take`` as it comes. Raises WorkerSetError, with the tail of the hosts' output, when
    a host fails, when rank 0 ends without ``done``, or at ``limit_s`` (every process of the
    set is killed by then)."""
    lines = _ClusterLines(take, mark)
    try:
        codes = c.run(list(argv), env, timeout=limit_s, on_line=lines, on=on)
    except TimeoutError as exc:
        raise WorkerSetError(f"{exc}\n{lines.tail()}") from None
    failed = [f"h{i} exited with {code}" for i, code in enumerate(codes) if code != 0]
    if failed or not lines.done:
        why = "; ".join(failed) or "rank 0 exited without reporting done"
        raise WorkerSetError(f"{why}\n{lines.tail()}")


def cluster_unavailable(lib: str) -> str | None:
    """Why ``lib`` cannot run across emulated hosts here, or None: ``unavailable``, and for
    mpi also ``orted`` (mpirun starts it on the other hosts)."""
    why = unavailable(lib)
    if why is None and under_mpirun(lib) and shutil.which("orted") is None:
        return "orted is not on PATH (install Open MPI)"
    return why


def cluster_mpirun(c: Hosts, argv: Sequence[str], forward: Sequence[str]) -> list[str]:
    """``mpirun`` of ``argv`` with one rank per host of cluster ``c``, Open MPI over TCP on
    the cluster's interface (``Cluster.mpirun_argv``), passing every rank the variables named
    in ``forward`` (``-x``) from mpirun's environment; run it in host 0 (``on=[0]``)."""
    return list(c.mpirun_argv(list(argv), extra=[a for name in forward for a in ("-x", name)]))


MPI_FORWARD = ("PYTHONPATH", "PYTHONUNBUFFERED")  # of cluster_env, what an mpi rank needs


def _cluster_launch(
    c: Hosts, spec: SetSpec, master_port: int
) -> tuple[list[str], Callable[[int], dict[str, str]], list[int] | None]:
    """(argv, env of each host, hosts to run it in) of ``spec``'s ranks in cluster ``c``."""
    command = worker_command(spec)
    if not under_mpirun(spec.lib):
        return command, lambda host: {**cluster_env(c, host, master_port), **spec.env}, None
    env = {k: v for k, v in cluster_env(c, 0, master_port).items() if k in MPI_FORWARD}
    env.update(spec.env)
    return cluster_mpirun(c, command, list(env)), lambda host: env, [0]


def run_set_in_cluster(
    c: Hosts, spec: SetSpec, run: Run, progress: Progress, master_port: int = 29500
) -> None:
    """``run_set`` with one rank per host of cluster ``c`` (``spec.nprocs`` = ``c.hosts``)
    instead of N processes here: asyncreduce and gloo ranks get ``cluster_env`` plus
    ``spec.env``; mpi is one ``cluster_mpirun`` in host 0 that forwards ``spec.env`` too.
    Results and a failure go to ``run`` as ``run_set`` records them; nothing is raised."""
    tag, started = set_tag(spec), time.monotonic()
    argv, env, on = _cluster_launch(c, spec, master_port)
    progress.show(f"{tag} starting {spec.nprocs} ranks (hard limit {spec.limit_s:.0f} s) ...")
    try:
        run_cluster_set(
            c, argv, env, spec.limit_s, lambda m: take_report(m, spec, run, progress), spec.mark, on
        )
    except (WorkerSetError, OSError, RuntimeError) as exc:  # ClusterError is a RuntimeError
        run.failures.append(failure_of(spec, str(exc)))
        progress.end(f"{tag} FAILED: {exc}")
        return
    took = time.monotonic() - started
    run.set_seconds[set_name(spec)] = round(took, 2)
    progress.end(f"{tag} done in {took:.1f} s")
