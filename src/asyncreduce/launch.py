"""Local launcher: ``asyncreduce run -n N prog.py args...`` on one machine.

Theory of operation
-------------------
``run`` starts ``N`` copies of one program, rank ``0 … N-1``, each told who it is through the
environment that ``asyncreduce.init()`` (and torchrun-style code) reads: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``PYTHONUNBUFFERED=1`` and ``ASYNCREDUCE_RUN=1`` (which names the launcher in the logs). A
program whose name ends in ``.py`` runs under this interpreter
(``sys.executable``); anything else runs as a command found on ``PATH``. When no port is given
the launcher picks a free one (bind to port 0, read it, close: another process can take it in
between, so pass ``master_port`` where that matters). Children read no input (stdin is
``/dev/null``).

Each child is the leader of its own session and process group, so signals from the terminal
reach only the launcher, and the launcher can signal a rank together with whatever it started
(``os.killpg``). Two threads per rank copy its stdout and stderr line by line to ours, each line
prefixed with ``[rank] ``, under one lock, flushed at once: lines never interleave.

The main thread polls the children every few milliseconds:

* every rank exited 0: return 0;
* a rank exited non-zero (killed by signal ``S`` counts as ``128 + S``): say so on stderr,
  stop the others (``SIGTERM``, then ``SIGKILL`` after ``grace`` seconds) and return that first
  failing rank's code;
* with ``elastic``, a rank that fails is only reported: the others go on without it
  (``asyncreduce.shrink``, docs/elastic.md), and the job's code is 0 once every other rank
  exited 0 (the first failure's code if none is left). With ``max_restarts`` the launcher
  starts a failed rank again (``ASYNCREDUCE_RESTART``: its count of restarts), up to that
  many times in all, and it knocks on the others' doors (``ASYNCREDUCE_DOORS``: a free port
  per rank on ``master_addr``, bootstrap/doors.py) to rejoin. With ``spare``, the process
  that restarts it was started ahead (``ASYNCREDUCE_SPARE=1``, no ``RANK``: it has run the
  program up to ``ar.init()`` and waits there to be told, on its stdin, which rank it stands
  in for), so a restart does not wait for Python and the imports; a new spare is started
  after each. The program must then do nothing of its rank's before ``ar.init()``;
* the launcher got ``SIGINT`` (Ctrl-C) or ``SIGTERM``: forward it to every rank, then escalate
  (``SIGTERM``, ``SIGKILL``) each ``grace`` seconds, and return ``128 + signal`` (130 for
  Ctrl-C). A second signal while stopping escalates straight to ``SIGKILL``.

Whatever happens (even an exception), ``run`` kills and reaps every child and sweeps each
rank's process group before it returns: no child is ever left running. Signal handlers are
installed only when ``run`` is called from the main thread, and restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TextIO

from asyncreduce.errors import UsageError

__all__ = ["run", "program_command", "child_env", "free_port", "exit_code"]

_POLL_S = 0.01
_DRAIN_S = 0.5
_SAY = "asyncreduce run: "
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def run(
    nprocs: int,
    argv: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace: float = 3.0,
    backend: str | None = None,
    elastic: bool = False,
    max_restarts: int = 0,
    spare: bool = False,
) -> int:
    """Run ``argv`` as ``nprocs`` ranks and return the job's exit code (see the module doc).

    ``backend`` is what ``ar.init()`` runs on in the ranks (ASYNCREDUCE_BACKEND); "mpi" hands
    the job to ``mpirun``, since MPI ranks must be started by MPI's own launcher."""
    if nprocs < 1:
        raise UsageError(f"nprocs must be >= 1, got {nprocs}")
    if not argv:
        raise UsageError("no program to run: argv is empty")
    if grace < 0:
        raise UsageError(f"grace must be >= 0 seconds, got {grace}")
    if max_restarts < 0:
        raise UsageError(f"max_restarts must be >= 0, got {max_restarts}")
    if max_restarts and not elastic:
        raise UsageError("max_restarts needs elastic: without it a failed rank ends the job")
    if backend is not None:
        os.environ["ASYNCREDUCE_BACKEND"] = backend  # (the ranks inherit it)
    if backend == "mpi":
        return _run_mpirun(nprocs, argv)
    port = free_port(master_addr) if master_port is None else master_port
    job = _Job(grace, elastic, max_restarts, spare)
    with _catching_signals(job.signals):
        try:
            job.start(program_command(argv), nprocs, master_addr, port)
        except OSError as exc:
            job.say(f"cannot start {argv[0]!r}: {exc.strerror or exc}")
            job.reap()
            return 127 if isinstance(exc, FileNotFoundError) else 126
        try:
            return job.supervise()
        finally:
            job.reap()


def _run_mpirun(nprocs: int, argv: Sequence[str]) -> int:
    """``mpirun -n N prog``: MPI's launcher starts the ranks (as root, if we are root)."""
    import shutil

    if shutil.which("mpirun") is None:
        raise UsageError("--backend mpi needs mpirun on PATH (e.g. apt install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = ["mpirun", "-n", str(nprocs), *root, "--oversubscribe", *program_command(argv)]
    return exit_code(subprocess.call(command))


def program_command(argv: Sequence[str]) -> list[str]:
    """The command line for one rank: ``prog.py args`` runs under ``sys.executable``."""
    if argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return list(argv)


def child_env(rank: int, nprocs: int, master_addr: str, master_port: int) -> dict[str, str]:
    """Our environment plus what tells a rank who it is and where rank 0 listens."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
        ASYNCREDUCE_RUN="1",
    )
    return env


def free_port(master_addr: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on every interface of ``master_addr``'s family."""
    family = socket.getaddrinfo(master_addr, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def exit_code(returncode: int) -> int:
    """A shell-style exit code: a child killed by signal ``S`` (``-S`` in Popen) is ``128 + S``."""
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _catching_signals(received: list[int]) -> Iterator[None]:
    """Record SIGINT/SIGTERM in ``received`` instead of dying (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread] = field(default_factory=list)
    label: list[bytes] = field(default_factory=list)  # its lines' prefix (a spare's changes)

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Signal the rank's whole process group (it leads it: pgid == pid)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def drain(self, timeout: float) -> None:
        """Wait (a little) until the rank's output has been copied."""
        deadline = time.monotonic() + timeout
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


class _Job:
    """The ranks of one ``run`` call, their output pumps and the signals we received."""

    def __init__(
        self, grace: float, elastic: bool = False, max_restarts: int = 0, spare: bool = False
    ) -> None:
        self.grace, self.elastic, self.restarts_left = grace, elastic, max_restarts
        self.keeps_spare = spare
        self.restarts = 0
        self.failed: list[_Rank] = []  # (elastic) the ranks that failed, reported
        self.ranks: list[_Rank] = []
        self.signals: list[int] = []
        self.out_lock = threading.Lock()
        self.command: list[str] = []
        self.envs: list[dict[str, str]] = []
        self.spare: _Rank | None = None  # (max_restarts) a started process, waiting to stand in

    def start(self, command: list[str], nprocs: int, master_addr: str, master_port: int) -> None:
        self.command = command
        self.envs = [child_env(rank, nprocs, master_addr, master_port) for rank in range(nprocs)]
        if self.elastic:
            doors = ",".join(f"{master_addr}:{free_port(master_addr)}" for _ in range(nprocs))
            for env in self.envs:
                env["ASYNCREDUCE_DOORS"] = doors
        for rank in range(nprocs):
            self.ranks.append(self._spawn(rank, self.envs[rank]))
        self._keep_a_spare()

    def _spawn(self, rank: int, env: dict[str, str], spare: bool = False) -> _Rank:
        proc = subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.PIPE if spare else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        member = _Rank(rank, proc, label=[b"[spare] " if spare else f"[{rank}] ".encode()])
        assert proc.stdout is not None and proc.stderr is not None
        member.pumps.append(self._pump(member, proc.stdout, sys.stdout))
        member.pumps.append(self._pump(member, proc.stderr, sys.stderr))
        return member

    def _keep_a_spare(self) -> None:
        """(max_restarts) Start a spare: the program, run up to ``ar.init()``, where it waits
        to be told which rank it stands in for (bootstrap/doors.py), so a restart does not
        wait for Python and the imports."""
        if self.keeps_spare and self.restarts_left > 0 and self.spare is None:
            env = {k: v for k, v in self.envs[0].items() if k not in ("RANK", "LOCAL_RANK")}
            self.spare = self._spawn(-1, {**env, "ASYNCREDUCE_SPARE": "1"}, spare=True)

    def _stand_in(self, rank: int) -> _Rank:
        """The spare, told to stand in for ``rank`` (restart ``self.restarts``), else a new
        process for it; then a new spare."""
        spare, self.spare = self.spare, None
        member = None
        if spare is not None and spare.running():
            try:
                assert spare.proc.stdin is not None
                spare.proc.stdin.write(f"{rank} {self.restarts}\n".encode())
                spare.proc.stdin.close()
                spare.rank, spare.label[0] = rank, f"[{rank}] ".encode()
                member = spare
            except OSError:  # (it died meanwhile)
                spare.signal_group(signal.SIGKILL)
        if member is None:
            member = self._spawn(rank, self.envs[rank])
        self._keep_a_spare()
        return member

    def _pump(self, member: _Rank, pipe: IO[bytes], out: TextIO) -> threading.Thread:
        name = f"asyncreduce-run-{member.proc.pid}-{'out' if out is sys.stdout else 'err'}"
        thread = threading.Thread(
            target=_copy_lines, args=(pipe, out, member.label, self.out_lock), name=name,
            daemon=True,
        )  # fmt: skip
        thread.start()
        return thread

    def say(self, message: str) -> None:
        """One line from the launcher itself, on stderr."""
        _write(sys.stderr, (_SAY + message + "\n").encode(), self.out_lock)

    def supervise(self) -> int:
        """Poll until every rank succeeded, one failed, or we were signalled."""
        while True:
            if self.signals:
                return self._interrupted(self.signals[0])
            finished = not any(member.running() for member in self.ranks)
            failed = self._first_failure()  # after `finished`: a rank dying in between is seen
            if failed is not None and not self.elastic:
                return self._failed(failed)
            if failed is not None:
                self._lost(failed)
                continue
            if finished:
                return self._elastic_code() if self.failed else 0
            time.sleep(_POLL_S)

    def _first_failure(self) -> _Rank | None:
        for member in self.ranks:
            if member.proc.poll() not in (None, 0) and member not in self.failed:
                return member
        return None

    def _lost(self, member: _Rank) -> None:
        """(elastic) Report a failed rank; the others go on without it."""
        self.failed.append(member)
        code = exit_code(member.proc.returncode)
        member.drain(_DRAIN_S)
        how = f" (killed by {signal.Signals(-member.proc.returncode).name})" if code > 128 else ""
        self.say(f"rank {member.rank} exited with code {code}{how}; the others go on (elastic)")
        if self.restarts_left > 0 and any(m.running() for m in self.ranks):
            self.restarts_left -= 1
            self.restarts += 1
            self.envs[member.rank]["ASYNCREDUCE_RESTART"] = str(self.restarts)
            self.ranks[self.ranks.index(member)] = self._stand_in(member.rank)
            self.say(f"rank {member.rank} started again (restart {self.restarts}); it rejoins")

    def _elastic_code(self) -> int:
        """0 if some rank did not fail (they all exited 0); else the first failure's code."""
        if any(member not in self.failed for member in self.ranks):
            return 0
        return exit_code(self.failed[0].proc.returncode)

    def _failed(self, member: _Rank) -> int:
        code = exit_code(member.proc.returncode)
        member.drain(_DRAIN_S)
        how = f" (killed by {signal.Signals(-member.proc.returncode).name})" if code > 128 else ""
        others = any(other.running() for other in self.ranks)
        tail = "; stopping the other ranks" if others else ""
        self.say(f"rank {member.rank} exited with code {code}{how}{tail}")
        self._stop([signal.SIGTERM, signal.SIGKILL], calm=len(self.signals))
        return code

    def _interrupted(self, sig: int) -> int:
        name = signal.Signals(sig).name
        self.say(f"got {name}; forwarding it to every rank")
        self._stop([sig, *(s for s in (signal.SIGTERM, signal.SIGKILL) if s != sig)], calm=1)
        return 128 + sig

    def _stop(self, steps: Sequence[int], calm: int) -> None:
        """Send each signal in turn to the running ranks, ``grace`` seconds apart.

        Once the launcher has got more than ``calm`` signals (a second Ctrl-C), skip straight
        to the last step.
        """
        for sig in steps[:-1]:
            self._signal_running(sig)
            if self._wait_exit(time.monotonic() + self.grace, calm):
                return
            if len(self.signals) > calm:
                break
        self._signal_running(steps[-1])

    def _signal_running(self, sig: int) -> None:
        for member in self.ranks:
            if member.running():
                member.signal_group(sig)

    def _wait_exit(self, deadline: float, calm: int) -> bool:
        """True once every rank exited; False at ``deadline`` or when a new signal came."""
        while any(member.running() for member in self.ranks):
            if time.monotonic() >= deadline or len(self.signals) > calm:
                return False
            time.sleep(_POLL_S)
        return True

    def reap(self) -> None:
        """Kill and reap every child, sweep their groups, and finish copying their output."""
        if self.spare is not None:
            self.ranks.append(self.spare)  # (it is reaped with the others)
            self.spare = None
        for member in self.ranks:
            if member.running():
                member.signal_group(signal.SIGKILL)
            member.proc.wait()
        for member in self.ranks:
            member.signal_group(signal.SIGKILL)  # whatever a rank started and left behind
        for member in self.ranks:
            member.drain(_DRAIN_S)


def _copy_lines(
    pipe: IO[bytes], out: TextIO, label: list[bytes], lock: threading.Lock
) -> None:
    """Copy whole lines from ``pipe`` to ``out``, prefixed with ``label[0]`` (as it is when
    the line comes); keep draining if ``out`` breaks."""
    broken = False
    with pipe:
        for line in pipe:
            if broken:
                continue
            try:
                _write(out, label[0] + (line if line.endswith(b"\n") else line + b"\n"), lock)
            except (OSError, ValueError):
                broken = True  # our stdout is gone (closed pipe): never block the child


def _write(out: TextIO, data: bytes, lock: threading.Lock) -> None:
    """Write bytes to a text stream, through its binary buffer when it has one; flush."""
    with lock:
        buffer = getattr(out, "buffer", None)
        if buffer is None:
            out.write(data.decode(errors="replace"))
            out.flush()
        else:
            out.flush()  # whatever was written as text goes first
            buffer.write(data)
            buffer.flush()
