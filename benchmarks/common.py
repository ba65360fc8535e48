"""Shared machinery of the concurrency, overlap and priority benchmarks (not a benchmark itself).

Theory of operation
-------------------
Each benchmark script is both the parent and its own worker, as ``allreduce.py`` is. The parent
never communicates: for every (library, N) it starts one fresh set of N ranks that runs every
variant of that benchmark, then reads what rank 0 reports.

* ``asyncreduce`` and ``gloo``: N copies of ``python SCRIPT --worker LIB ...``, each told RANK,
  WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) in its environment;
* ``mpi``: ``mpirun -n N --bind-to none ... python SCRIPT --worker mpi ...``, Open MPI's default
  transports (shared memory on one host), ``MPI_THREAD_MULTIPLE`` requested.

The parent passes its resolved settings to the workers as one JSON argument, so both sides read
the same numbers. Rank 0 writes JSON lines to stdout, each prefixed with ``MARK`` (anything else
is ignored): ``ready``, then any number of ``start`` (a step begins: shown on the progress line),
``result`` (one row of the benchmark's results) and ``note`` (a sentence for the report), then
``done``. The parent waits for each line at most ``step_s`` seconds and for the whole set at
most ``limit_s``; on a timeout, a failed rank, an exception or Ctrl-C it kills every worker's
process group (SIGTERM, then SIGKILL) and records the failure. Workers exit by themselves when
the parent disappears or their own deadline passes.

On the worker side ``connect`` gives a ``Rank``: the library's handle plus the three things
every measurement needs (``barrier``, ``max`` over ranks, ``close``). ``timed`` runs a step
after a barrier and returns each repeat's wall time, the maximum over ranks, so every rank runs
the same number of collectives. Helpers for the report (tables, JSON, machine line) follow.

``allreduce.py`` and ``links.py`` run their own protocol, but share the pieces here: sizes and
units, the command-line checks, the worker set (``SetSpec`` says how it differs), the
parent's loop over its reports (``drive_set``), the machine's description and the output.
``scaling.py`` runs workers of this protocol inside an emulated cluster instead, one rank per
host (``cluster_env``, ``run_cluster_set``), and so does ``overlap.py --hosts`` for every
library (``run_set_in_cluster`` in place of ``run_set``, handed to ``parent_main`` as its
``sets``): asyncreduce and Gloo ranks meet at host 0's address, Open MPI is one ``mpirun`` in
host 0 over ``btl self,tcp`` on the cluster interface (``cluster_mpirun``, as ``links.py``
runs it). A set's ``SetSpec.where`` (``"2 hosts @ 1gbit"``) names it in progress lines,
``set_seconds`` and failures, and ``SetSpec.row`` is added to each of its result rows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Protocol

from asyncreduce.argtypes import positive_float, positive_int

__all__ = [
    "LIBS",
    "MARK",
    "MPI_FORWARD",
    "Progress",
    "Rank",
    "Run",
    "SetSpec",
    "WorkerSetError",
    "base_parser",
    "busbw_gbps",
    "cluster_env",
    "cluster_mpirun",
    "cluster_unavailable",
    "comma_list",
    "connect",
    "failure_of",
    "format_size",
    "fmt_ms",
    "host_count",
    "load_module",
    "machine_info",
    "machine_line",
    "median",
    "parent_main",
    "parse_size",
    "render_table",
    "run_cluster_set",
    "run_set_in_cluster",
    "timed",
    "worker_command",
    "worker_main",
]

LIBS = ("asyncreduce", "gloo", "mpi")
MARK = "@asyncreduce-bench "
STARTUP_S = 90.0  # importing torch on a busy 2-core machine is slow
_GRACE_S = 2.0
_MPIRUN = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none")
DTYPE_BYTES = 4  # float32


# ---- sizes and units ------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1M"``/``"1MiB"`` -> 1048576, ``"512"`` -> 512 (bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 1M, 128M or bytes)")
    nbytes = int(match.group(1)) * _UNITS[match.group(2)]
    if nbytes < DTYPE_BYTES or nbytes % DTYPE_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {DTYPE_BYTES} bytes (float32)"
        )
    return nbytes


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"``; sizes that are not whole KiB/MiB stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def busbw_gbps(nbytes: int, nprocs: int, seconds: float) -> float:
    """Bus bandwidth in GB/s: ``bytes * 2 (N-1) / N / time``."""
    return nbytes * 2 * (nprocs - 1) / nprocs / seconds / 1e9


# ---- command line -------------------------------------------------------------------------


def nprocs_list(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``; every count at least 2."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or values[0] < 2:
        raise argparse.ArgumentTypeError(f"process counts must be at least 2, got {text!r}")
    return values


def lib_list(known: Sequence[str], kind: str = "libraries") -> Callable[[str], list[str]]:
    """A parser of ``"asyncreduce,gloo"``: names, each one of ``known``, in ``known``'s order."""

    def parse_names(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(unknown) or '(none)'}; choose from {','.join(known)}"
            )
        return [name for name in known if name in names]

    return parse_names


def checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text once ``parse`` accepts it (``cluster.parse_rate``)."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def comma_list(kind: str, parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: ``"a,b"`` -> ``[parse("a"), parse("b")]``, repeats dropped, in order.

    ``kind`` names one item in the messages (``"bad rate list ..."``, ``"no rate given"``)."""

    def convert(text: str) -> list[Any]:
        try:
            values = [parse(part.strip()) for part in text.split(",") if part.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"bad {kind} list {text!r}: {exc}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"no {kind} given")
        return list(dict.fromkeys(values))

    return convert


def host_count(text: str) -> int:
    """A number of emulated hosts, one rank each: at least 2 (for ``comma_list``)."""
    value = int(text)
    if value < 2:
        raise ValueError("at least 2 hosts")
    return value


def base_parser(
    name: str, description: str, libs: Sequence[str], repeats: int, quick: str,
    known: Sequence[str] = LIBS, libs_default: str | None = None,
) -> argparse.ArgumentParser:  # fmt: skip
    """The options every one of these benchmarks has; each adds its own.

    ``libs`` is the default selection, ``known`` what ``--libs`` (and ``--worker``) accepts.
    ``libs_default``, where given, is the default in words for a benchmark that picks it
    itself: ``--libs`` is then None unless given.
    """
    parser = argparse.ArgumentParser(
        prog=f"asyncreduce bench {name}",
        description=description,
        epilog=f"example: asyncreduce bench {name} --quick --json results/{name}.json",
    )
    parser.add_argument(
        "--nprocs", type=nprocs_list, default=[2, 4], help="process counts (default 2,4)"
    )
    parser.add_argument(
        "--libs",
        type=lib_list(known),
        default=None if libs_default else list(libs),
        help=f"libraries, of {','.join(known)} (default {libs_default or ','.join(libs)}); "
        "missing ones are skipped",
    )
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every result here")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="PNG (needs matplotlib)")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="run nothing: print the report of a saved --json run (and --plot it)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        metavar="R",
        help=f"timed repeats after a warm-up, the median is reported (default {repeats})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="hard limit per (library, N) worker set (default: scaled to the work)",
    )
    # the worker side: how the parent starts the ranks; not for people
    workers = list(dict.fromkeys([*LIBS, *known]))
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | int:
    """The parsed arguments, or argparse's exit code (0 for --help, 2 for bad arguments)."""
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


# ---- the worker side: one rank ------------------------------------------------------------


class Rank:
    """One rank of one library: its handle plus barrier, max over ranks and close."""

    lib = ""
    rank = 0
    size = 1

    def barrier(self) -> None:
        raise NotImplementedError

    def max(self, value: float) -> float:
        """The maximum of ``value`` over all ranks (every rank must call it)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class AsyncReduceRank(Rank):
    """``backend="mpi"``: ranks started by mpirun, asyncreduce over MPI (lib asyncreduce-mpi)."""

    def __init__(self, backend: str = "native") -> None:
        import numpy as np

        import asyncreduce as ar

        self.lib = "asyncreduce" if backend == "native" else f"asyncreduce-{backend}"
        self.ar: Any = ar
        self.np: Any = np
        self.comm: Any = ar.init(timeout=60.0, backend=backend)  # from the launcher
        self.rank, self.size = self.comm.rank, self.comm.world_size

    def barrier(self) -> None:
        self.comm.barrier(name="bench.barrier")

    def max(self, value: float) -> float:
        box = self.np.array([value], dtype=self.np.float64)
        self.comm.allreduce(box, op="max", name="bench.max")
        return float(box[0])

    def close(self) -> None:
        self.comm.close()


class GlooRank(Rank):
    """``init_method``: where the ranks meet (``env://``: MASTER_ADDR/MASTER_PORT; or
    ``tcp://host:port``), rank and world size from RANK and WORLD_SIZE either way."""

    def __init__(self, init_method: str = "env://") -> None:
        self.lib = "gloo"
        self.torch: Any = importlib.import_module("torch")
        self.dist: Any = importlib.import_module("torch.distributed")
        if not self.dist.is_available() or not self.dist.is_gloo_available():
            raise RuntimeError("this PyTorch build has no Gloo backend")
        self.torch.set_num_threads(1)  # N ranks share the cores; Gloo has its own threads
        self.dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=120),
        )
        self.rank, self.size = int(self.dist.get_rank()), int(self.dist.get_world_size())

    def barrier(self) -> None:
        self.dist.barrier()

    def max(self, value: float) -> float:
        box = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(box, op=self.dist.ReduceOp.MAX)
        return float(box.item())

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiRank(Rank):
    def __init__(self) -> None:
        rc: Any = importlib.import_module("mpi4py").rc
        rc.thread_level = "multiple"  # before MPI_Init: the threaded variants need it
        self.lib = "mpi"
        self.MPI: Any = importlib.import_module("mpi4py.MPI")
        self.comm: Any = self.MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        self.thread_multiple = self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE

    def barrier(self) -> None:
        self.comm.Barrier()

    def max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))


def connect(lib: str) -> Rank:
    """Join the job as one rank of ``lib`` (from the environment the parent set)."""
    kinds: dict[str, Callable[[], Rank]] = {
        "asyncreduce": AsyncReduceRank,
        "asyncreduce-mpi": lambda: AsyncReduceRank("mpi"),
        "gloo": GlooRank,
        "mpi": MpiRank,
    }
    return kinds[lib]()


def timed(
    rank: Rank,
    step: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    prepare: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> list[float]:
    """Wall seconds of ``step`` per repeat (after ``warmup`` untimed ones), max over ranks.

    Each run: ``prepare()`` (untimed), barrier, ``step()``; the clock stops when ``step``
    returns on this rank, then ``after()`` (untimed); the slowest rank's time counts.
    """
    times = []
    for index in range(warmup + repeats):
        if prepare is not None:
            prepare()
        rank.barrier()
        start = time.perf_counter()
        step()
        mine = time.perf_counter() - start
        if after is not None:
            after()
        elapsed = rank.max(mine)
        if index >= warmup:
            times.append(elapsed)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


Tell = Callable[..., None]


def watchdog(parent_pid: int | None, deadline: float | None, say: str = "") -> None:
    """Exit (code 3) once the parent (or our launcher, mpirun) is gone or the deadline passed.

    ``say`` starts the line that tells of a passed deadline (on stderr).
    """
    end = None if deadline is None else time.monotonic() + deadline
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if end is not None and time.monotonic() > end:
                print(f"{say}worker deadline of {deadline:.0f} s passed", file=sys.stderr)
                os._exit(3)
            if os.getppid() != launcher or (parent_pid is not None and not _alive(parent_pid)):
                os._exit(3)

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()


def worker_main(
    args: argparse.Namespace,
    body: Callable[[Rank, dict[str, Any], Tell], None],
    make_rank: Callable[[str], Rank] = connect,
) -> int:
    """Run ``body(rank, settings, tell)`` as one rank; ``tell`` reports from rank 0 only.

    ``make_rank(lib)`` joins the job (default ``connect``)."""
    watchdog(args.parent_pid, args.deadline)
    settings: dict[str, Any] = json.loads(args.settings or "{}")
    started = time.perf_counter()
    rank = make_rank(args.worker)

    def tell(event: str, **fields: Any) -> None:
        if rank.rank == 0:
            print(MARK + json.dumps({"event": event, **fields}), flush=True)

    try:
        tell("ready", init_s=round(time.perf_counter() - started, 3))
        body(rank, settings, tell)
        rank.barrier()
        tell("done")
    finally:
        rank.close()
    return 0


# ---- the parent side: worker sets -----------------------------------------------------------


class WorkerSetError(Exception):
    """A worker set failed, timed out, or reported something unreadable."""


class _NoReport(WorkerSetError):
    def __init__(self, seconds: float, what: str = "report") -> None:
        super().__init__(f"no {what} for {seconds:.1f} s (hung?)")


@dataclass(frozen=True)
class SetSpec:
    """How to start one (library, N) set and how long to let it run."""

    script: Path
    lib: str
    nprocs: int
    settings: dict[str, Any]
    limit_s: float  # the whole set, start-up included
    step_s: float  # the longest wait for any one report after ``ready``
    env: dict[str, str] = field(default_factory=dict)
    # what allreduce.py's sets do their own way (the defaults are this module's protocol):
    worker_args: tuple[str, ...] | None = None  # after --worker; None: --settings JSON
    mpirun_args: tuple[str, ...] = ()  # more options for mpirun (a lib named mpi*)
    mark: str = MARK  # the prefix of rank 0's report lines
    silence: str = "report"  # "no <silence> for S s (hung?)"
    killed_first: bool = False  # name the ranks killed by a signal first when several fail
    limit_note: str = ""  # appended to the hard-timeout message
    # where the set runs, when that is not simply N processes here (an emulated cluster):
    where: str = ""  # e.g. "2 hosts @ 1gbit": in the progress tag, set_seconds and failures
    row: dict[str, Any] = field(default_factory=dict)  # added to each result row and failure


@dataclass
class Run:
    """Everything one invocation measured and everything that went wrong."""

    benchmark: str
    settings: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # lib -> why
    failures: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    set_seconds: dict[str, float] = field(default_factory=dict)  # "lib N=n" -> wall time

    def rows(self, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.results if all(r.get(k) == v for k, v in match.items())]

    def failed(self, lib: str, nprocs: int) -> bool:
        return any((f["lib"], f["nprocs"]) == (lib, nprocs) for f in self.failures)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable(lib: str) -> str | None:
    """Why ``lib`` cannot run here, or None."""
    if lib == "gloo" and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'asyncreduce[torch]')"
    if under_mpirun(lib):
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install 'asyncreduce[mpi]')"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (install Open MPI)"
    return None


def under_mpirun(lib: str) -> bool:
    """Whether ``lib``'s ranks are started by one mpirun (Open MPI, and asyncreduce over it)."""
    return lib.startswith("mpi") or lib == "asyncreduce-mpi"


def package_root() -> Path | None:
    """The folder holding the ``asyncreduce`` package this process imports, or None."""
    spec = importlib.util.find_spec("asyncreduce")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parents[1]


def worker_command(spec: SetSpec) -> list[str]:
    """The command line of one rank of ``spec`` (``mpirun`` goes in front for ``mpi*``)."""
    args = spec.worker_args
    if args is None:
        args = ("--settings", json.dumps(spec.settings))
    lib = "mpi" if spec.lib.startswith("mpi") else spec.lib
    return [
        sys.executable, str(spec.script.resolve()), "--worker", lib, *args,
        "--parent-pid", str(os.getpid()), "--deadline", f"{spec.limit_s + 30:.0f}",
    ]  # fmt: skip


class WorkerSet:
    """N ranks of one library, each the leader of its own process group."""

    def __init__(self, spec: SetSpec) -> None:
        self.spec = spec
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.mpi = under_mpirun(spec.lib)  # mpi, mpi-tcp, asyncreduce-mpi: one mpirun
        command = worker_command(spec)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **spec.env)
        src = package_root()
        if src is not None:  # the workers use the same asyncreduce as this process
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        n = spec.nprocs
        if self.mpi:
            mpirun = ["mpirun", "-n", str(n), *_MPIRUN, *spec.mpirun_args]
            self._start([*mpirun, *command], env, reports=True)
            return
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, like the others
        for rank in range(n):
            self._start(command, dict(env, RANK=str(rank)), reports=rank == 0)

    def _start(self, command: list[str], env: dict[str, str], reports: bool) -> None:
        log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.logs.append(log)
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if reports else subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # its own process group: killpg reaches what it starts
        )
        self.procs.append(proc)
        if reports:
            assert proc.stdout is not None
            threading.Thread(
                target=self._read, args=(proc.stdout,), name="bench-reader", daemon=True
            ).start()

    def _read(self, pipe: IO[bytes]) -> None:
        try:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith(self.spec.mark):
                    self.lines.put(line[len(self.spec.mark) :])
        finally:
            self.lines.put(None)

    def next_message(self, timeout: float) -> dict[str, Any]:
        """The next report of rank 0; WorkerSetError on a timeout or a failed rank."""
        end = time.monotonic() + timeout
        while True:
            if self.failed_rank() is not None:
                time.sleep(0.5)  # let the others exit and their errors reach their logs
                raise WorkerSetError(self.failed_rank() or "a rank failed")
            try:
                line = self.lines.get(timeout=min(0.2, max(0.0, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= end:
                    raise _NoReport(timeout, self.spec.silence) from None
                continue
            if line is None:
                for proc in self.procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=2.0)
                raise WorkerSetError(self.failed_rank() or "rank 0 closed its output early")
            try:
                message: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                raise WorkerSetError(f"unreadable report from rank 0: {line!r}") from None
            return message

    def failed_rank(self) -> str | None:
        """Who exited with an error (the killed first if ``killed_first``), or None."""
        failed = []
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code not in (None, 0):
                who = "mpirun" if self.mpi else f"rank {rank}"
                how = f"killed by signal {-code}" if code < 0 else f"failed with exit code {code}"
                failed.append((code >= 0, f"{who} {how}"))
        if self.spec.killed_first:
            failed.sort()
        return "; ".join(text for _, text in failed) or None

    def finish(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.01, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise WorkerSetError("workers did not exit after finishing") from None
        failed = self.failed_rank()
        if failed:
            raise WorkerSetError(failed)

    def stderr_tail(self, lines: int = 15) -> str:
        tails = []
        for index, log in enumerate(self.logs):
            log.seek(0)
            text = log.read().decode(errors="replace").strip()
            if text:
                who = "mpirun" if self.mpi else f"rank {index}"
                tail = "\n".join("    " + ln for ln in text.splitlines()[-lines:])
                tails.append(f"  stderr of {who}:\n{tail}")
        return "\n".join(tails)

    def kill(self) -> None:
        """SIGTERM every process group, then SIGKILL whatever is left; reap all."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # a group can outlive its leader: sweep it anyway
            end = time.monotonic() + _GRACE_S
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.01, end - time.monotonic()))

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()
        for log in self.logs:
            log.close()


@contextlib.contextmanager
def worker_set(spec: SetSpec) -> Iterator[WorkerSet]:
    workers = WorkerSet(spec)
    try:
        yield workers
    finally:
        workers.kill()
        workers.close()


class Progress:
    """One line on stderr, rewritten in place on a terminal, one line per step otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def end(self, text: str) -> None:
        self.show(text)
        if self.tty:
            sys.stderr.write("\n")
            self.width = 0


def _take(message: dict[str, Any], spec: SetSpec, run: Run, progress: Progress) -> None:
    """Record one report."""
    event = message.get("event")
    if event == "start":
        progress.show(f"{set_tag(spec)} {message.get('step', '')} ...")
    elif event == "result":
        row = {k: v for k, v in message.items() if k != "event"}
        run.results.append({"lib": spec.lib, "nprocs": spec.nprocs, **spec.row, **row})
    elif event == "note":
        run.notes.append(f"{set_name(spec)}: {message.get('text', '')}")


def run_set(spec: SetSpec, run: Run, progress: Progress) -> None:
    """Start one set, collect its reports into ``run``; a failure is recorded, not raised."""
    drive_set(
        spec, run, progress, lambda m: _take(m, spec, run, progress), lambda m, a: spec.step_s
    )


class Outcome(Protocol):
    """Where ``drive_set`` records a failed set and each finished set's wall time."""

    failures: list[dict[str, Any]]
    set_seconds: dict[str, float]


def set_name(spec: SetSpec) -> str:
    """``"gloo N=2"``, or ``"gloo N=2 2 hosts @ 1gbit"`` where ``spec.where`` says more."""
    return _set_words(spec.lib, spec.nprocs, spec.where)


def _set_words(lib: str, nprocs: int, where: str | None) -> str:
    return " ".join(filter(None, [lib, f"N={nprocs}", where]))


def set_tag(spec: SetSpec) -> str:
    return f"[{set_name(spec)}]"


def failure_of(spec: SetSpec, error: str, **detail: str) -> dict[str, Any]:
    """A failed set as ``Run.failures`` holds it (``preamble`` shows ``where``)."""
    where = {"where": spec.where} if spec.where else {}
    return {"lib": spec.lib, "nprocs": spec.nprocs, **where, **spec.row, "error": error, **detail}


def drive_set(
    spec: SetSpec, run: Outcome, progress: Progress, take: Callable[[dict[str, Any]], None],
    allow: Callable[[dict[str, Any], float], float],
) -> None:  # fmt: skip
    """Start one set and hand each report to ``take`` until ``done``; a failure is recorded in
    ``run``, not raised. ``allow(report, seconds)``: how long to wait for the next report."""
    tag = set_tag(spec)
    started = time.monotonic()
    end = started + spec.limit_s
    progress.show(f"{tag} starting {spec.nprocs} processes ...")
    with worker_set(spec) as workers:
        try:
            allowance = STARTUP_S
            over = f"hard timeout: the set ran over its limit of {spec.limit_s:.1f} s"
            over += spec.limit_note
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise WorkerSetError(over)
                try:
                    message = workers.next_message(min(allowance, left))
                except _NoReport:
                    if allowance < left:
                        raise
                    raise WorkerSetError(over) from None
                allowance = allow(message, allowance)
                take(message)
                if message.get("event") == "done":
                    workers.finish(timeout=max(1.0, min(30.0, end - time.monotonic())))
                    break
        except WorkerSetError as exc:
            workers.kill()
            detail = workers.stderr_tail()
            run.failures.append(failure_of(spec, str(exc), stderr=detail))
            progress.end(f"{tag} FAILED: {exc}")
            if detail:
                print(detail, file=sys.stderr)
            return
    took = time.monotonic() - started
    run.set_seconds[set_name(spec)] = round(took, 2)
    progress.end(f"{tag} done in {took:.1f} s")


# ---- the parent side: worker sets inside an emulated cluster (scripts/cluster.py) ------------


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


def cluster_env(c: Any, host: int, master_port: int) -> dict[str, str]:
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
    c: Any, argv: Sequence[str], env: Callable[[int], dict[str, str]], limit_s: float,
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


def cluster_mpirun(c: Any, argv: Sequence[str], forward: Sequence[str]) -> list[str]:
    """``mpirun`` of ``argv`` with one rank per host of cluster ``c``, Open MPI over TCP on
    the cluster's interface (``Cluster.mpirun_argv``), passing every rank the variables named
    in ``forward`` (``-x``) from mpirun's environment; run it in host 0 (``on=[0]``)."""
    return list(c.mpirun_argv(list(argv), extra=[a for name in forward for a in ("-x", name)]))


MPI_FORWARD = ("PYTHONPATH", "PYTHONUNBUFFERED")  # of cluster_env, what an mpi rank needs


def _cluster_launch(
    c: Any, spec: SetSpec, master_port: int
) -> tuple[list[str], Callable[[int], dict[str, str]], list[int] | None]:
    """(argv, env of each host, hosts to run it in) of ``spec``'s ranks in cluster ``c``."""
    command = worker_command(spec)
    if not under_mpirun(spec.lib):
        return command, lambda host: {**cluster_env(c, host, master_port), **spec.env}, None
    env = {k: v for k, v in cluster_env(c, 0, master_port).items() if k in MPI_FORWARD}
    env.update(spec.env)
    return cluster_mpirun(c, command, list(env)), lambda host: env, [0]


def run_set_in_cluster(
    c: Any, spec: SetSpec, run: Run, progress: Progress, master_port: int = 29500
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
            c, argv, env, spec.limit_s, lambda m: _take(m, spec, run, progress), spec.mark, on
        )
    except (WorkerSetError, OSError, RuntimeError) as exc:  # ClusterError is a RuntimeError
        run.failures.append(failure_of(spec, str(exc)))
        progress.end(f"{tag} FAILED: {exc}")
        return
    took = time.monotonic() - started
    run.set_seconds[set_name(spec)] = round(took, 2)
    progress.end(f"{tag} done in {took:.1f} s")


# ---- the parent side: report ----------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms < 10:
        return f"{ms:.2f}"
    if ms < 1000:
        return f"{ms:.1f}"
    return f"{ms:.0f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to fit; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(widths[i]) if i < left else c.rjust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def library_state() -> dict[str, Any]:
    """Which asyncreduce ran: the checkout's commit, whether src/ differs from it, and the
    ASYNCREDUCE_* environment (e.g. ASYNCREDUCE_SHM=0 keeps ranks on TCP)."""
    root = package_root()
    state: dict[str, Any] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("ASYNCREDUCE_")}
    }
    if root is None or shutil.which("git") is None:
        return state
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(root.parent)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.splitlines()  # fmt: skip
        state.update(commit=head, src_changes=[line[3:] for line in changed])
    return state


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _open_mpi_version() -> str | None:
    if shutil.which("mpirun") is None:
        return None
    try:
        out = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (out.stdout or out.stderr).strip().splitlines()
    return first[0] if first else None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    import numpy as np

    from asyncreduce import algorithms

    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "open_mpi": _open_mpi_version(),
        "asyncreduce": _version("asyncreduce"),
        "small_allreduce_bytes": algorithms.SMALL_ALLREDUCE_BYTES,
        "cross_memory_bytes": algorithms.CROSS_MEMORY_BYTES,
    }


def machine_line(machine: dict[str, Any]) -> str:
    parts = [
        f"{machine['cores']} cores" + (f" ({machine['cpu']})" if machine["cpu"] else ""),
        f"Python {machine['python']}",
        f"numpy {machine['numpy']}",
        f"torch {machine['torch'] or 'not installed'}",
        f"mpi4py {machine['mpi4py'] or 'not installed'}",
        machine["open_mpi"] or "Open MPI not found",
        f"asyncreduce {machine['asyncreduce']}" + _state_words(machine.get("library", {})),
    ]
    load = machine.get("load_1min")
    if load:
        parts.append(f"load average before/after {load['before']}/{load['after']}")
    return "machine: " + "; ".join(parts)


def _state_words(state: dict[str, Any]) -> str:
    words = []
    if state.get("commit"):
        changes = len(state.get("src_changes", []))
        words.append(
            f"git {state['commit']}" + (f" + {changes} changed in src/" if changes else "")
        )
    words += [f"{k}={v}" for k, v in state.get("env", {}).items()]
    return f" ({', '.join(words)})" if words else ""


def preamble(run: Run, machine: dict[str, Any]) -> list[str]:
    """The lines every report starts with: machine, skipped, failures, notes."""
    lines = [machine_line(machine)]
    lines += [f"skipped {lib}: {why}" for lib, why in run.skipped.items()]
    for f in run.failures:
        lines.append(f"FAILED {_set_words(f['lib'], f['nprocs'], f.get('where'))}: {f['error']}")
    lines += [f"note: {text}" for text in run.notes]
    return lines


def json_head(
    name: str, argv: Sequence[str], elapsed: float, machine: dict[str, Any], **command: Any
) -> dict[str, Any]:
    """What every ``--json`` document starts with (``command`` adds to its command entry)."""
    return {
        "benchmark": name,
        "command": {
            "line": shlex.join(["asyncreduce", "bench", name, *argv]),
            "argv": list(argv),
            **command,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 2),
        "machine": machine,
    }


def save_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def report_per_n(run: Run, machine: dict[str, Any], table: Callable[[Run, int], str]) -> str:
    """The preamble, then ``table(run, N)`` for each process count, a blank line before each."""
    lines = preamble(run, machine)
    for nprocs in run.settings["nprocs"]:
        lines += ["", table(run, nprocs)]
    return "\n".join(lines)


def write_json(
    path: Path, run: Run, machine: dict[str, Any], argv: Sequence[str], elapsed: float,
    summary: dict[str, Any],
) -> None:  # fmt: skip
    document = {
        **json_head(run.benchmark, argv, elapsed, machine),
        "settings": run.settings,
        "skipped": run.skipped,
        "failures": run.failures,
        "notes": run.notes,
        "set_seconds": run.set_seconds,
        "results": run.results,
        "summary": summary,
    }
    save_json(path, document)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Benchmark:
    """What ``parent_main`` needs from one benchmark."""

    name: str
    script: Path
    spec: Callable[[str, int], SetSpec]  # (lib, nprocs) -> how to run that set
    report: Callable[[Run, dict[str, Any]], str]
    summary: Callable[[Run], dict[str, Any]]
    plot: Callable[[Path, Run], None]


def replay(bench: Benchmark, path: Path, plot_path: Path | None) -> int:
    """Print the report of a saved ``--json`` document (and plot it) without running anything."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{bench.name} bench: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if doc.get("benchmark") != bench.name:
        print(f"{bench.name} bench: {path} is a {doc.get('benchmark')!r} run", file=sys.stderr)
        return 2
    run = Run(bench.name, doc["settings"], doc["results"], doc["skipped"], doc["failures"],
              doc["notes"], doc["set_seconds"])  # fmt: skip
    print(bench.report(run, doc["machine"]))
    print(f"\n(measured {doc['date']} by: {doc['command']['line']}; total {doc['elapsed_s']} s)")
    if plot_path is not None and run.results:
        bench.plot(plot_path, run)
        print(f"wrote {plot_path}")
    return 1 if run.failures else 0


def _load() -> float:
    return round(os.getloadavg()[0], 2)


SetRunner = Callable[[Run, Sequence[str], Progress], None]  # (run, libraries, progress)


def _sets_here(bench: Benchmark, nprocs: Sequence[int]) -> SetRunner:
    """Every (N, library) set on this host, N by N."""

    def run_all(run: Run, libs: Sequence[str], progress: Progress) -> None:
        for n in nprocs:
            for lib in libs:
                run_set(bench.spec(lib, n), run, progress)

    return run_all


def parent_main(
    bench: Benchmark, run: Run, libs: Sequence[str], nprocs: Sequence[int],
    argv: Sequence[str], args: argparse.Namespace,
    sets: SetRunner | None = None, why_not: Callable[[str], str | None] = unavailable,
) -> int:  # fmt: skip
    """Run every (N, library) set in turn, print the report, write JSON and plot.

    ``args`` supplies ``json``, ``plot`` and ``from_json`` (report a saved run instead).
    ``sets(run, libs, progress)``, where given, runs the sets instead (e.g. in emulated
    clusters, ``run_set_in_cluster``) with the libraries that ``why_not`` did not skip.
    """
    json_path, plot_path = args.json, args.plot
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        print("--plot needs matplotlib: pip install 'asyncreduce[plot]'", file=sys.stderr)
        return 2
    if args.from_json is not None:
        return replay(bench, args.from_json, plot_path)
    started, load_before = time.monotonic(), _load()
    skip_unavailable(bench.name, libs, run.skipped, why_not)
    progress = Progress()
    interrupted = False
    try:
        runner = sets or _sets_here(bench, nprocs)
        runner(run, [lib for lib in libs if lib not in run.skipped], progress)
    except KeyboardInterrupt:  # the set is torn down already; report what we have
        interrupted = True
        progress.end(f"{bench.name} bench: interrupted; partial results follow")
    elapsed = time.monotonic() - started
    machine = {**machine_info(), "library": library_state()}
    machine["load_1min"] = {"before": load_before, "after": _load()}
    return finish(
        bench.report(run, machine), elapsed, interrupted, bool(run.failures),
        json_path, lambda path: write_json(path, run, machine, argv, elapsed, bench.summary(run)),
        plot_path if run.results else None, lambda path: bench.plot(path, run),
    )  # fmt: skip


def skip_unavailable(
    name: str, libs: Sequence[str], skipped: dict[str, str],
    why_not: Callable[[str], str | None] = unavailable,
) -> None:  # fmt: skip
    """Record (and say on stderr) each of ``libs`` that cannot run here."""
    for lib in libs:
        why = why_not(lib)
        if why:
            skipped[lib] = why
            print(f"{name} bench: skipping {lib}: {why}", file=sys.stderr)


def finish(
    report: str, elapsed: float, interrupted: bool, failed: bool,
    json_path: Path | None, write: Callable[[Path], None],
    plot_path: Path | None, plot: Callable[[Path], None],
) -> int:  # fmt: skip
    """Print the report, write the JSON and the plot (where asked), return the exit code."""
    print(report)
    print(f"\n(total {elapsed:.1f} s)")
    if json_path is not None:
        write(json_path)
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot(plot_path)
        print(f"wrote {plot_path}")
    if interrupted:
        return 130
    return 1 if failed else 0


def bench_main(
    name: str, script: Path, argv: Sequence[str] | None, parser: argparse.ArgumentParser,
    settings: Callable[[argparse.Namespace], Any],
    worker: Callable[[Rank, dict[str, Any], Tell], None],
    spec: Callable[[Any, float | None, str, int], SetSpec],
    report: Callable[[Run, dict[str, Any]], str], summary: Callable[[Run], dict[str, Any]],
    plot: Callable[[Path, Run], None],
) -> int:  # fmt: skip
    """The ``main`` of a benchmark on this module's protocol: one rank with ``--worker``, else
    the parent. ``settings(args)`` is a dataclass with ``libs`` and ``nprocs``; ``spec(settings,
    --timeout, lib, N)`` says how to run one set."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    if args.worker:
        return worker_main(args, worker)
    s = settings(args)
    bench = Benchmark(
        name, script, lambda lib, n: spec(s, args.timeout, lib, n), report, summary, plot
    )
    run = Run(name, asdict(s))
    return parent_main(bench, run, s.libs, s.nprocs, argv, args)
