"""Emulate a small cluster on one Linux machine: K network namespaces behind one switch, each
joined to it by a link of a chosen rate, for benchmarks and tests of multi-host behaviour.

Theory of operation
-------------------
One run (one ``Cluster``) owns a prefix ``P = arcl-<owner pid>-<sequence>-`` and creates, with
``ip`` and ``tc`` (root needed, standard library only):

::

    host 0: netns Ph0            switch: netns Psw               host 1: netns Ph1
    lo, eth0 10.77.S.1/24 <-veth-> b0 --+-- br0 --+-- b1 <-veth-> eth0 10.77.S.2/24, lo
    tbf on eth0 (uplink)           tbf on b0, b1 (downlinks)     tbf on eth0 (uplink)

* every host is a network namespace ``Ph<i>`` with its loopback up and one interface
  ``eth0`` holding ``10.77.S.<i+1>/24``; ``S`` is derived from the prefix, and as each host
  sees only its own namespace, two runs never clash even when ``S`` repeats;
* the switch is a bridge ``br0`` in its own namespace ``Psw``; host ``i`` is one veth pair
  ``eth0`` (in the host) to ``b<i>`` (in the switch), created directly inside those namespaces:
  nothing is ever added to the root namespace, no route, no address, no device, so traffic can
  only reach the other hosts of the same run, never the outside;
* a link's rate is a token-bucket filter (``tc qdisc add ... root tbf rate R burst B latency
  L``) on the egress of each end: ``eth0`` in the host shapes what it sends (uplink), ``b<i>``
  in the switch what it receives (downlink), so each host has a full-duplex link of rate ``R``
  to a non-blocking switch, like a NIC on a switch port (``shape="uplink"`` keeps only the
  first, ``rate=None`` none). ``tbf`` counts whole frames (Ethernet, IP and TCP headers), so at
  MTU 1500 TCP payload can reach at most ~95% of ``R``.

Programs run in a host with ``ip netns exec Ph<i> argv...`` (which execs ``argv``: the process
is the program itself) in a new session, with the caller's environment plus ``HOST_INDEX``,
``HOST_ADDR``, ``HOST_IFNAME`` (``eth0``), ``HOST_NETNS``, ``CLUSTER_HOSTS`` and
``CLUSTER_ADDRS`` (comma-separated, host order). ``Cluster.run`` starts one per host, hands
every output line (stdout and stderr merged) to a callback, by default printed prefixed with
``[h<i>] ``, stops the others a few seconds after one fails, kills all at a hard timeout, and
returns the exit codes.

Teardown always happens: ``close`` (also ``with``'s exit) kills every process it started and
any other process still inside its namespaces (``ip netns pids``), then deletes the
namespaces, which deletes the veths and the bridge with them. Every live cluster is in a
registry that an ``atexit`` hook and handlers for SIGINT, SIGTERM and SIGHUP tear down (the
handlers then chain to whatever was installed before, so Ctrl-C still raises
KeyboardInterrupt); the handlers are installed while a cluster is live, from the main thread
only. After a ``kill -9``, ``python scripts/cluster.py cleanup`` deletes the namespaces of
runs whose owner process is gone, ``cleanup --all`` every namespace named ``arcl-*``.

Command line (``python scripts/cluster.py --help``)::

    cluster.py run --hosts 2 --rate 1gbit -- python -c 'import os; print(os.environ["HOST_ADDR"])'
    cluster.py check --rates 1gbit,10gbit --patterns one,duplex,incast   # TCP throughput
    cluster.py cleanup [--all] [--dry-run]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import IO, Any

__all__ = [
    "Cluster",
    "ClusterError",
    "PREFIX",
    "IFNAME",
    "available",
    "cleanup",
    "leftovers",
    "parse_rate",
    "format_rate",
    "main",
]

PREFIX = "arcl-"  #: every namespace this module creates is named ``arcl-<pid>-<seq>-...``
IFNAME = "eth0"  #: the interface of every host, inside its namespace
BRIDGE = "br0"
DEFAULT_LATENCY_S = 0.005
_NAME_RE = re.compile(r"^arcl-(\d+)-(\d+)-(?:h\d+|sw)$")
_SAY = "cluster: "
_IP_TIMEOUT_S = 20.0
_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_sequence = itertools.count()

Argv = Sequence[str]
LineHandler = Callable[[int, str], None]


class ClusterError(RuntimeError):
    """Setting up the namespaces, links or shaping failed (the message shows the command)."""


# ---- rates -----------------------------------------------------------------------------------

_RATE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9, ``"100mbit"`` -> 1e8, ``"2.5g"`` or ``"2500000000"`` (bits/s)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit)?(?:/s)?\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not a rate: {text!r} (try 100mbit, 1gbit, 10gbit)")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def format_rate(bits_per_s: float) -> str:
    """1e9 -> ``"1gbit"``, 2.5e9 -> ``"2.5gbit"``, 1e8 -> ``"100mbit"``."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def tbf_burst_bytes(bits_per_s: float) -> int:
    """The token bucket: 1 ms at the rate, at least 64 KiB + one frame (one GSO packet of a
    veth passes whole, unsegmented); what the link may send at once above its rate."""
    return max(65536 + 1514, int(bits_per_s / 8 * 1e-3))


# ---- running ip and tc -----------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _command(["ip", *args], check)


def _command(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"{' '.join(argv)}: {exc}") from None
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")
    return done


def available() -> str | None:
    """Why clusters cannot be made here (not root, no ``ip`` or ``tc``), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    return None


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(name: str) -> None:
    """SIGKILL whatever still runs inside namespace ``name`` (only our programs can be there)."""
    out = _ip("netns", "pids", name, check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _delete_netns(name: str) -> None:
    _kill_netns_pids(name)
    _ip("netns", "delete", name, check=False)


def leftovers(all_runs: bool = False) -> list[str]:
    """Namespaces of ours whose owner process is gone (``all_runs``: every ``arcl-*`` one)."""
    names = []
    for name in _netns_names():
        match = _NAME_RE.match(name)
        if match and (all_runs or not _alive(int(match.group(1)))):
            names.append(name)
    return names


def cleanup(all_runs: bool = False, dry_run: bool = False) -> list[str]:
    """Delete ``leftovers(all_runs)`` (and so their links and processes); return their names."""
    names = leftovers(all_runs)
    if not dry_run:
        for name in names:
            _delete_netns(name)
    return names


# ---- the registry that atexit and the signal handlers tear down -----------------------------

_registry_lock = threading.RLock()  # re-entrant: a signal handler may run while it is held
_live: list[Cluster] = []
_previous: dict[int, Any] = {}
_atexit_done = False


def _register(cluster: Cluster) -> None:
    global _atexit_done
    with _registry_lock:
        _live.append(cluster)
        if not _atexit_done:
            atexit.register(_teardown_all)
            _atexit_done = True
        if threading.current_thread() is threading.main_thread() and not _previous:
            for sig in _SIGNALS:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:
                    continue  # e.g. nohup: keep ignoring it
                _previous[sig] = previous
                signal.signal(sig, _on_signal)


def _unregister(cluster: Cluster) -> None:
    with _registry_lock:
        if cluster in _live:
            _live.remove(cluster)
        if not _live and _previous and threading.current_thread() is threading.main_thread():
            for sig, previous in _previous.items():
                signal.signal(sig, previous)
            _previous.clear()


def _teardown_all() -> None:
    with _registry_lock:
        for cluster in list(_live):
            cluster.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    _teardown_all()  # restores the previous handlers once the last cluster is gone
    if callable(previous):
        previous(signum, frame)  # e.g. the default SIGINT handler: KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ---- the cluster -----------------------------------------------------------------------------


class Cluster:
    """K hosts (network namespaces) on one switch, each behind a full-duplex link of ``rate``.

    ``rate``: a tc rate such as ``"1gbit"``/``"10gbit"`` or bits per second, or None for
    unshaped veths. ``shape``: ``"both"`` (uplink and downlink) or ``"uplink"`` (host egress
    only). ``burst`` (bytes) and ``latency`` (seconds of queue before tbf drops) tune tbf.
    Use as a context manager, or call ``start()`` and ``close()`` yourself.
    """

    def __init__(
        self,
        hosts: int = 2,
        rate: str | float | None = "1gbit",
        *,
        shape: str = "both",
        burst: int | None = None,
        latency: float = DEFAULT_LATENCY_S,
        mtu: int = 1500,
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be within 1..250, got {hosts}")
        if shape not in ("both", "uplink"):
            raise ValueError(f"shape must be 'both' or 'uplink', got {shape!r}")
        self.hosts = hosts
        self.rate_bps: float | None = None if rate is None else _rate_value(rate)
        self.shape = shape
        self.burst = burst
        self.latency = latency
        self.mtu = mtu
        seq = next(_sequence)
        self.prefix = f"{PREFIX}{os.getpid()}-{seq}-"
        self.subnet = (os.getpid() * 7 + seq) % 254 + 1  # the S of 10.77.S.0/24
        self.netns = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.switch = f"{self.prefix}sw"
        self.addrs = [f"10.77.{self.subnet}.{i + 1}" for i in range(hosts)]
        self.ifname = IFNAME
        self._procs: list[subprocess.Popen[str]] = []
        self._created: list[str] = []
        self._started = False
        self._agent: str | None = None  # a temporary folder holding mpirun's rsh agent

    # -- life cycle

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Cluster:
        """Create the namespaces, the switch and the shaped links (tearing down on failure)."""
        if self._started:
            return self
        why = available()
        if why:
            raise ClusterError(why)
        self._started = True
        _register(self)
        try:
            self._add_netns(self.switch)
            _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for i in range(self.hosts):
                self._add_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, i: int) -> None:
        host, port = self.netns[i], f"b{i}"
        self._add_netns(host)
        _ip("-n", self.switch, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
            "peer", "name", IFNAME, "netns", host)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        _ip("-n", host, "addr", "add", f"{self.addrs[i]}/24", "dev", IFNAME)
        _ip("-n", host, "link", "set", IFNAME, "mtu", str(self.mtu), "up")
        if self.rate_bps is not None:
            self._shape(host, IFNAME)
            if self.shape == "both":
                self._shape(self.switch, port)

    def _shape(self, netns: str, dev: str) -> None:
        assert self.rate_bps is not None
        burst = self.burst or tbf_burst_bytes(self.rate_bps)
        latency_us = max(1, round(self.latency * 1e6))
        _command(
            ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{int(self.rate_bps)}bit", "burst", str(burst),
             "latency", f"{latency_us}us"],
            check=True,
        )  # fmt: skip

    def close(self) -> None:
        """Kill every process of this cluster, delete its namespaces; safe to call again."""
        self._stop(self._procs, grace=1.0)
        for name in reversed(self._created):  # hosts first, then the switch
            _delete_netns(name)
        self._created = [name for name in self._created if name in _netns_names()]
        if self._agent is not None:
            shutil.rmtree(self._agent, ignore_errors=True)
            self._agent = None
        if not self._created:
            _unregister(self)

    # -- running programs

    def host_env(self, i: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Our environment, plus ``env``, plus the variables that tell host ``i`` who it is."""
        return {
            **os.environ,
            **(env or {}),
            "HOST_INDEX": str(i),
            "HOST_ADDR": self.addrs[i],
            "HOST_IFNAME": self.ifname,
            "HOST_NETNS": self.netns[i],
            "CLUSTER_HOSTS": str(self.hosts),
            "CLUSTER_ADDRS": ",".join(self.addrs),
        }

    def exec_argv(self, i: int, argv: Argv) -> list[str]:
        """The command line that runs ``argv`` inside host ``i``."""
        return ["ip", "netns", "exec", self.netns[i], *argv]

    def popen(
        self, i: int, argv: Argv, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[str]:
        """Start ``argv`` in host ``i`` (own session, text pipes as ``kwargs`` ask); ``close``
        kills it if it is still running."""
        if not self._started or not self._created:
            raise ClusterError("the cluster is not running (use `with Cluster(...)` or start())")
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(
            self.exec_argv(i, argv),
            env=self.host_env(i, env),
            start_new_session=True,
            text=True,
            errors="replace",
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Argv | Callable[[int], Argv],
        env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
        *,
        timeout: float | None = None,
        on_line: LineHandler | None = None,
        grace: float = 5.0,
        cwd: str | None = None,
        on: Sequence[int] | None = None,
    ) -> list[int]:
        """Run one program per host (``argv`` and ``env`` may be functions of the host index)
        and return the exit codes, host order (``-S``: killed by signal ``S``).

        ``on`` picks the hosts (default: all; ``on=[0]`` for one ``mpirun``). Every output line
        goes to ``on_line(host, line)`` (default: printed as ``[h<i>] line``). ``grace``
        seconds after one host fails the others are killed; at ``timeout`` all are, and
        TimeoutError names the hosts that were still running.
        """
        handler = on_line or _printer()
        procs, readers = [], []
        try:
            chosen = list(range(self.hosts)) if on is None else list(on)
            for i in chosen:
                args = argv(i) if callable(argv) else argv
                extra = env(i) if callable(env) else env
                proc = self.popen(
                    i, args, extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd
                )
                procs.append(proc)
                readers.append(_reader(i, proc, handler))
            late = self._wait(chosen, procs, timeout, grace)
            for reader in readers:
                reader.join(timeout=2.0)  # the last lines
            if late:
                raise TimeoutError(
                    f"{_SAY}hard timeout of {timeout} s: killed {', '.join(late)} (still running)"
                )
            return [int(p.returncode) for p in procs]
        finally:
            self._stop(procs, grace=1.0)
            for proc, reader in zip(procs, readers, strict=False):
                reader.join(timeout=2.0)
                if proc.stdout is not None and not reader.is_alive():
                    proc.stdout.close()  # else a survivor holds it: it closes when that dies

    def _wait(
        self,
        hosts: list[int],
        procs: list[subprocess.Popen[str]],
        timeout: float | None,
        grace: float,
    ) -> list[str]:
        """Poll until all exit; returns the hosts killed at the timeout (empty if none)."""
        end = None if timeout is None else time.monotonic() + timeout
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                self._stop(procs, grace=1.0)
            if end is not None and now > end:
                late = [f"h{i}" for i, p in zip(hosts, procs, strict=True) if p.poll() is None]
                self._stop(procs, grace=1.0)
                return late
            time.sleep(0.02)
        return []

    @staticmethod
    def _stop(procs: Sequence[subprocess.Popen[str]], grace: float) -> None:
        """SIGTERM each process group, SIGKILL what is left after ``grace``; reap them."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None or sig == signal.SIGKILL:  # a group can outlive its leader
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, sig)
            end = time.monotonic() + grace
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.01, end - time.monotonic()))

    # -- Open MPI across the hosts

    def mpirun_argv(self, argv: Argv, *, per_host: int = 1, extra: Argv = ()) -> list[str]:
        """``mpirun`` for ``argv`` on every host (``per_host`` ranks each, rank ``r`` on host
        ``r // per_host``), TCP over ``eth0`` only; run it on host 0 (``run(..., on=[0])``).

        ``mpirun`` itself must run inside a host: its daemons on the other hosts connect back
        to it over the cluster, and its ranks reach their local daemon over loopback. It
        starts those daemons through an rsh agent (a shell script we write) that enters the
        host's namespace with ``ip netns exec`` instead of logging in with ssh.
        """
        hosts = ",".join(f"{addr}:{per_host}" for addr in self.addrs)
        return [
            "mpirun", "-n", str(self.hosts * per_host), "--host", hosts, "--map-by", "slot",
            "--allow-run-as-root", "--bind-to", "none",
            "--mca", "plm_rsh_agent", self._rsh_agent(), "--mca", "plm_rsh_no_tree_spawn", "1",
            "--mca", "oob_tcp_if_include", IFNAME,
            "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", IFNAME,
            *extra, *argv,
        ]  # fmt: skip

    def _rsh_agent(self) -> str:
        """Write (once) the script mpirun calls as ``agent HOST command...``."""
        if self._agent is None:
            cases = "".join(
                f"  {addr}) ns={ns}; i={i} ;;\n"
                for i, (addr, ns) in enumerate(zip(self.addrs, self.netns, strict=True))
            )
            self._agent = tempfile.mkdtemp(prefix=self.prefix)
            path = os.path.join(self._agent, "rsh-agent")
            with open(path, "w") as script:
                script.write(
                    '#!/bin/sh\n# mpirun calls: rsh-agent HOST command...\nhost="$1"; shift\n'
                    f'case "$host" in\n{cases}'
                    '  *) echo "cluster rsh-agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
                    'exec ip netns exec "$ns" env HOST_INDEX="$i" HOST_ADDR="$host" '
                    'HOST_NETNS="$ns" sh -c "$*"\n'
                )
            os.chmod(path, 0o700)
        return os.path.join(self._agent, "rsh-agent")

    # -- checking the links

    def measure_tcp(
        self, src: int = 0, dst: int = 1, seconds: float = 1.0, port: int = 5201
    ) -> dict[str, float]:
        """One TCP stream ``src`` -> ``dst`` for ``seconds``: the receiver's ``bits_per_s``,
        and ``share`` of the link rate (absent when unshaped)."""
        return self.measure_flows([(src, dst)], seconds, port)[0]

    def measure_flows(
        self, flows: Sequence[tuple[int, int]], seconds: float = 1.0, port: int = 5201
    ) -> list[dict[str, float]]:
        """TCP streams ``(src, dst)``, all at once, for ``seconds``; one result per stream as
        in ``measure_tcp``. ``[(0, 1), (1, 0)]`` checks both directions of the links,
        ``[(1, 0), (2, 0)]`` that host 0's downlink caps what two senders get together."""
        sinks, sources = [], []
        try:
            for n, (src, dst) in enumerate(flows):
                where = ["--addr", self.addrs[dst], "--port", str(port + n)]
                sinks.append(self._tcp_end(dst, ["_sink", *where], subprocess.PIPE))
                source = ["_source", *where, "--seconds", repr(seconds)]
                sources.append(self._tcp_end(src, source, subprocess.DEVNULL))
            outs = [sink.communicate(timeout=seconds + 30) for sink in sinks]
            errs = [source.communicate(timeout=10)[1] for source in sources]
        finally:
            self._stop([*sinks, *sources], grace=0.5)
            for proc in [*sinks, *sources]:
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
        together = zip(outs, sinks, errs, strict=True)
        return [self._flow_result(out, err, sink, e) for (out, err), sink, e in together]

    def _tcp_end(self, host: int, args: list[str], stdout: int) -> subprocess.Popen[str]:
        """This file's ``_sink`` or ``_source`` command in ``host``."""
        me = os.path.abspath(__file__)
        command = [sys.executable, me, *args]
        return self.popen(host, command, stdout=stdout, stderr=subprocess.PIPE)

    def _flow_result(
        self, out: str, err: str, sink: subprocess.Popen[str], source_err: str
    ) -> dict[str, float]:
        if sink.returncode != 0 or not out.strip():
            raise ClusterError(f"TCP check failed: {err.strip()} {source_err.strip()}".strip())
        found: dict[str, float] = json.loads(out.strip().splitlines()[-1])
        if self.rate_bps is not None:
            found["share"] = found["bits_per_s"] / self.rate_bps
        return found


def _rate_value(rate: str | float) -> float:
    return parse_rate(rate) if isinstance(rate, str) else float(rate)


def _printer(stream: IO[str] | None = None) -> LineHandler:
    lock = threading.Lock()

    def show(host: int, line: str) -> None:
        with lock:
            out = stream or sys.stdout
            out.write(f"[h{host}] {line}\n")
            out.flush()

    return show


def _reader(host: int, proc: subprocess.Popen[str], handler: LineHandler) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # closed under us at teardown
            for line in proc.stdout:
                handler(host, line.rstrip("\n"))

    thread = threading.Thread(target=pump, name=f"cluster-h{host}-output", daemon=True)
    thread.start()
    return thread


# ---- the TCP check's two ends (run inside the namespaces; standard library only) ------------

_CHUNK = 1 << 20


def _sink(addr: str, port: int) -> int:
    """Accept one connection, read to EOF, print bytes/s from the first byte to the last."""
    with socket.create_server((addr, port)) as server:
        server.settimeout(30)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(60)
        view = memoryview(bytearray(_CHUNK))
        total = conn.recv_into(view)
        first = last = time.perf_counter()
        while True:
            n = conn.recv_into(view)
            if not n:
                break
            total += n
            last = time.perf_counter()
    seconds = max(last - first, 1e-9)
    print(json.dumps({"bytes": total, "seconds": seconds, "bits_per_s": total * 8 / seconds}))
    return 0


def _source(addr: str, port: int, seconds: float) -> int:
    """Connect (retrying while the sink starts) and send for ``seconds``."""
    end = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    payload = bytes(_CHUNK)
    with conn:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            conn.sendall(payload)
    return 0


# ---- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cluster.py",
        description="Emulate a cluster: K network namespaces on one switch, rate-limited links.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,check,cleanup}")
    run = commands.add_parser(
        "run", help="run a command in every host; exit with the first failure's code"
    )
    _link_options(run)
    run.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    run.add_argument("--rate", default="1gbit", help="link rate, or 'none' (default 1gbit)")
    run.add_argument("--timeout", type=float, default=None, help="hard limit in seconds")
    run.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- command and arguments")
    check = commands.add_parser("check", help="measure TCP streams between hosts at each rate")
    _link_options(check)
    check.add_argument("--rates", default="1gbit,10gbit", help="comma-separated (or 'none')")
    check.add_argument("--seconds", type=float, default=2.0, help="per test (default 2)")
    check.add_argument(
        "--patterns",
        default="one",
        help="comma-separated: one (h0->h1), duplex (h0<->h1), incast (h1,h2->h0); default one",
    )
    clean = commands.add_parser("cleanup", help="delete leftover namespaces of dead runs")
    clean.add_argument("--all", action="store_true", help="every arcl-* namespace, live or not")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    sink = commands.add_parser("_sink")  # the TCP check's ends, started inside namespaces
    sink.add_argument("--addr", required=True)
    sink.add_argument("--port", type=int, required=True)
    source = commands.add_parser("_source")
    source.add_argument("--addr", required=True)
    source.add_argument("--port", type=int, required=True)
    source.add_argument("--seconds", type=float, required=True)
    return parser


def _link_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=("both", "uplink"), default="both")
    parser.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes")
    parser.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S, help="tbf queue, s")
    parser.add_argument("--mtu", type=int, default=1500)


def _cluster(args: argparse.Namespace, hosts: int, rate: str) -> Cluster:
    return Cluster(
        hosts,
        None if rate.lower() == "none" else rate,
        shape=args.shape,
        burst=args.burst,
        latency=args.latency,
        mtu=args.mtu,
    )


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _cli_run(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print(f"{_SAY}run: no command given (cluster.py run [options] -- cmd ...)", file=sys.stderr)
        return 2
    env = dict(item.split("=", 1) for item in args.env)
    with _cluster(args, args.hosts, args.rate) as cluster:
        print(f"{_SAY}{describe(cluster)}", file=sys.stderr)
        try:
            codes = cluster.run(argv, env, timeout=args.timeout)
        except TimeoutError as exc:
            print(exc, file=sys.stderr)
            return 124
    summary = " ".join(f"h{i}={code}" for i, code in enumerate(codes))
    print(f"{_SAY}exit codes {summary}", file=sys.stderr)
    return next((_exit_code(c) for c in codes if c != 0), 0)


def describe(cluster: Cluster) -> str:
    rate = "unshaped" if cluster.rate_bps is None else format_rate(cluster.rate_bps)
    how = "" if cluster.rate_bps is None else f" ({cluster.shape})"
    return (
        f"{cluster.hosts} hosts {cluster.prefix}h0.. at {rate}{how}, "
        f"addresses {', '.join(cluster.addrs)} on {cluster.ifname}"
    )


_PATTERNS = {  # name: (hosts, flows)
    "one": (2, [(0, 1)]),
    "duplex": (2, [(0, 1), (1, 0)]),
    "incast": (3, [(1, 0), (2, 0)]),
}


def _cli_check(args: argparse.Namespace) -> int:
    for rate in (r.strip() for r in args.rates.split(",") if r.strip()):
        for pattern in args.patterns.split(","):
            hosts, flows = _PATTERNS[pattern.strip()]
            with _cluster(args, hosts, rate) as made:
                found = made.measure_flows(flows, seconds=args.seconds)
            print(
                f"link {rate:>8}, {pattern:<6} for {args.seconds:g} s: {_flows_text(flows, found)}"
            )
    return 0


def _flows_text(flows: list[tuple[int, int]], found: list[dict[str, float]]) -> str:
    parts = []
    for (src, dst), result in zip(flows, found, strict=True):
        share = f" ({result['share']:.1%})" if "share" in result else ""
        parts.append(f"h{src}->h{dst} {result['bits_per_s'] / 1e9:.3f} Gbit/s{share}")
    if len({dst for _, dst in flows}) == 1 and len(flows) > 1:
        total = sum(r["bits_per_s"] for r in found)
        parts.append(f"together {total / 1e9:.3f} Gbit/s")
    return ", ".join(parts)


def _cli_cleanup(args: argparse.Namespace) -> int:
    names = cleanup(all_runs=args.all, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{_SAY}{verb} {len(names)} namespace(s){': ' if names else ''}{' '.join(names)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command == "_sink":
        return _sink(args.addr, args.port)
    if args.command == "_source":
        return _source(args.addr, args.port, args.seconds)
    why = available()
    if why:
        print(f"{_SAY}{why}", file=sys.stderr)
        return 2
    try:
        if args.command == "run":
            return _cli_run(args)
        if args.command == "check":
            return _cli_check(args)
        return _cli_cleanup(args)
    except (ClusterError, ValueError) as exc:
        print(f"{_SAY}{exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the namespaces are already gone (see _on_signal)
        print(f"{_SAY}interrupted; torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
