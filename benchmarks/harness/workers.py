"""The parent side: one worker set, N ranks of one library started, watched and torn down.

For every (library, N) the parent starts one fresh set of ranks and never communicates itself:

* ``asyncreduce`` and ``gloo``: N copies of ``python SCRIPT --worker LIB ...``, each told RANK,
  WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) in its environment;
* ``mpi`` (any library ``under_mpirun``): ``mpirun -n N --bind-to none ... python SCRIPT
  --worker mpi ...``, Open MPI's default transports (shared memory on one host).

Each rank is the leader of its own process group and its stderr goes to a temporary file, shown
when the set fails. ``drive_set`` hands rank 0's ``MARK`` reports (see ``ranks``) to the
benchmark as they come, waiting for each at most what ``allow`` says (``STARTUP_S`` for the
first) and for the whole set at most ``SetSpec.limit_s``; on a timeout, a failed rank, an
unreadable report or Ctrl-C it kills every process group (SIGTERM, then SIGKILL) and records
the failure in the ``Run`` instead of raising. ``SetSpec`` says how a set differs from the
default protocol (``allreduce.py`` passes its own worker arguments and report prefix), and
where it runs (``where``, ``row``): that names it in progress lines, ``set_seconds`` and
failures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from asyncreduce.launch import free_port

from .machine import package_root
from .ranks import MARK

__all__ = [
    "STARTUP_S",
    "Outcome",
    "Progress",
    "Run",
    "SetSpec",
    "WorkerSet",
    "WorkerSetError",
    "drive_set",
    "failure_of",
    "run_set",
    "set_name",
    "set_tag",
    "set_words",
    "take_report",
    "unavailable",
    "under_mpirun",
    "worker_command",
    "worker_set",
]


STARTUP_S = 90.0  # importing torch on a busy 2-core machine is slow
_GRACE_S = 2.0
_MPIRUN = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none")


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
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
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


def take_report(message: dict[str, Any], spec: SetSpec, run: Run, progress: Progress) -> None:
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
        spec, run, progress, lambda m: take_report(m, spec, run, progress), lambda m, a: spec.step_s
    )


class Outcome(Protocol):
    """Where ``drive_set`` records a failed set and each finished set's wall time."""

    failures: list[dict[str, Any]]
    set_seconds: dict[str, float]


def set_name(spec: SetSpec) -> str:
    """``"gloo N=2"``, or ``"gloo N=2 2 hosts @ 1gbit"`` where ``spec.where`` says more."""
    return set_words(spec.lib, spec.nprocs, spec.where)


def set_words(lib: str, nprocs: int, where: str | None) -> str:
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
