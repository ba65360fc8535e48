"""Allreduce across emulated hosts behind 1 and 10 Gbit/s links: bus bandwidth, share of link.

Theory of operation
-------------------
``allreduce.py`` measures ranks on one machine over the loopback, where bandwidth is set by
memory copies and the CPU, not by a network. Here every rank gets its own emulated host:
``scripts/cluster.py`` makes K network namespaces on one virtual switch, each behind a
full-duplex link shaped by ``tc tbf`` to the chosen rate (both directions), so a collective
is bound by the link, as on a real cluster with 1 or 10 GbE.

For every (K hosts, rate) the parent (``main``) builds one cluster, checks the link with one
TCP stream h0 -> h1 (what any TCP library can hope for: ~95% of the rate at MTU 1500, where
Ethernet, IP and TCP headers take the rest), then runs each library's worker set in it:

* ``asyncreduce`` and ``gloo``: one rank per host, ``python allreduce.py --worker LIB`` in the
  host's namespace with RANK, WORLD_SIZE, MASTER_ADDR = host 0's address, MASTER_PORT (any:
  the namespaces are private), ASYNCREDUCE_ADDR = the host's own address and
  GLOO_SOCKET_IFNAME = its interface;
* ``mpi``: Open MPI over TCP (``btl self,tcp`` on the cluster interface): ``mpirun`` runs in
  host 0 and starts its daemon on every other host through an rsh agent that enters that
  host's namespace (``Cluster.mpirun_argv``), one rank per host.

The workers are exactly ``allreduce.py``'s (same warm-up, repeats, median, max over ranks; see
its docstring), so the numbers compare with that benchmark's. Rank 0 reports JSON lines on
stdout, each prefixed with ``allreduce.MARK``; anything else is kept as the tail shown when a
set fails. Each set has a hard time limit (scaled to the sizes and the link), after which
every process in it is killed; the cluster is torn down after each (K, rate), whatever
happens (``Cluster`` also does it on SIGINT, SIGTERM and at exit).

Bus bandwidth is ``bytes * 2 (K-1) / K / time``: what each host's link carries each way in a
ring allreduce, so ``busbw / rate`` is the share of the link the library turns into
allreduce throughput (at most ~0.95, the TCP payload share).

What a run holds and its table, JSON and plot are ``links_report.py``.

Needs root, ``ip`` and ``tc`` (iproute2). Run it as ``asyncreduce bench links [options]`` or
``python benchmarks/links.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_int

__all__ = ["LIBS", "main"]

DEFAULT_RATES = "1gbit,10gbit"
DEFAULT_HOSTS = "2,4"
DEFAULT_SIZES = "32M"
DEFAULT_MIN_TIME, QUICK_MIN_TIME = 0.5, 0.2
DEFAULT_WARMUP, QUICK_WARMUP = 3, 2
DEFAULT_REPEATS = 3
DEFAULT_TCP_S, QUICK_TCP_S = 1.0, 0.5
MASTER_PORT = 29500
DEFAULT_MTU = 1500
_SAY = "links bench: "
_HERE = Path(__file__).resolve().parent


sys.path.insert(0, str(_HERE))  # the harness, next to this file
import harness  # noqa: E402
from links_report import LIBS, Result, Run, Settings, plot, report, write_json  # noqa: E402

allreduce: Any = harness.load_module("asyncreduce_benchmarks.allreduce", _HERE / "allreduce.py")
cluster: Any = harness.load_module(
    "asyncreduce_scripts.cluster", _HERE.parent / "scripts" / "cluster.py"
)


# ---- command line ---------------------------------------------------------------------------


_HOST_LIST = harness.comma_list("host", harness.host_count)
_SIZE_LIST = harness.comma_list("size", harness.parse_size)


def _lib(text: str) -> str:
    if text not in LIBS:
        raise ValueError(f"unknown library {text!r}; choose from {','.join(LIBS)}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncreduce bench links",
        description="Allreduce (float32 sum) across emulated hosts (network namespaces behind "
        "tbf-shaped links, scripts/cluster.py): asyncreduce, Gloo and Open MPI over TCP. "
        "Needs root, ip and tc.",
        epilog="example: asyncreduce bench links --quick --json results/links.json",
    )
    add = parser.add_argument
    rates = harness.comma_list("rate", harness.checked(cluster.parse_rate))
    add(
        "--hosts",
        type=_HOST_LIST,
        default=None,
        help=f"host counts (default {DEFAULT_HOSTS}; with --quick 2)",
    )
    add(
        "--rates",
        type=rates,
        default=rates(DEFAULT_RATES),
        help=f"link rates (default {DEFAULT_RATES})",
    )
    add(
        "--sizes",
        type=_SIZE_LIST,
        default=None,
        help=f"buffer sizes, K/M suffixes (default {DEFAULT_SIZES})",
    )
    add(
        "--libs",
        type=harness.comma_list("library", _lib),
        default=list(LIBS),
        help=f"libraries (default {','.join(LIBS)}); missing ones are skipped",
    )
    add(
        "--quick",
        action="store_true",
        help=f"2 hosts, --min-time {QUICK_MIN_TIME}, --warmup {QUICK_WARMUP}, "
        f"--tcp-seconds {QUICK_TCP_S}",
    )
    add("--json", type=Path, metavar="PATH", help="write every result here")
    add("--plot", type=Path, metavar="PATH", help="share of the link per library, PNG")
    add(
        "--min-time",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds of timed allreduces per point (default {DEFAULT_MIN_TIME})",
    )
    add(
        "--warmup",
        type=int,
        default=None,
        metavar="N",
        help=f"untimed allreduces per point, at most (default {DEFAULT_WARMUP})",
    )
    add(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        metavar="R",
        help=f"timed repeats, the median is reported (default {DEFAULT_REPEATS})",
    )
    add(
        "--tcp-seconds",
        type=float,
        default=None,
        metavar="S",
        help=f"the one-stream TCP link check per cluster, 0 to skip (default {DEFAULT_TCP_S})",
    )
    add(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="hard limit per worker set (default: scaled to sizes and rate)",
    )
    add(
        "--mtu",
        type=positive_int,
        default=DEFAULT_MTU,
        help=f"the links' MTU (default {DEFAULT_MTU}; 9000: jumbo frames, as 10 GbE clusters "
        "often use, where TCP payload is ~99%% of the rate instead of ~95%%)",
    )
    return parser  # fmt: skip


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        hosts=args.hosts or ([2] if quick else _HOST_LIST(DEFAULT_HOSTS)),
        rates=args.rates,
        sizes=sorted(args.sizes or _SIZE_LIST(DEFAULT_SIZES)),
        libs=args.libs,
        min_time=args.min_time or (QUICK_MIN_TIME if quick else DEFAULT_MIN_TIME),
        warmup=args.warmup or (QUICK_WARMUP if quick else DEFAULT_WARMUP),
        repeats=max(1, args.repeats),
        tcp_seconds=(QUICK_TCP_S if quick else DEFAULT_TCP_S)
        if args.tcp_seconds is None
        else args.tcp_seconds,
        timeout=args.timeout,
        quick=quick,
        mtu=args.mtu,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit code (2: bad arguments or no way to run it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    why = cluster.available()
    if why:
        print(f"{_SAY}cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"{_SAY}--plot needs matplotlib (pip install 'asyncreduce[plot]')", file=sys.stderr)
        return 2
    return _parent_main(_settings(args), args.json, args.plot, argv)


class SetError(Exception):
    """A worker set failed, timed out or did not report."""


# ---- one worker set in one cluster ----------------------------------------------------------


class _Lines:
    """``on_line`` for ``Cluster.run``: rank 0's reports, and the tail of everything else."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.tails: dict[int, deque[str]] = {}

    def __call__(self, host: int, line: str) -> None:
        if line.startswith(allreduce.MARK):
            with contextlib.suppress(json.JSONDecodeError):
                self.messages.append(json.loads(line[len(allreduce.MARK) :]))
                return
        self.tails.setdefault(host, deque(maxlen=12)).append(line)

    def tail(self) -> str:
        return "\n".join(
            f"  h{host}: {line}" for host, lines in sorted(self.tails.items()) for line in lines
        )


def _limit(settings: Settings, hosts: int, rate_bps: float) -> float:
    """Seconds a set may take: start-up, then ~10x the ideal time of every allreduce."""
    total = harness.STARTUP_S
    for nbytes in settings.sizes:
        ideal = nbytes * 2 * (hosts - 1) / hosts * 8 / rate_bps
        total += 30 + 2 * settings.min_time + 10 * (settings.warmup + settings.repeats + 2) * ideal
    return settings.timeout or total


def _worker_argv(lib: str, settings: Settings, limit: float) -> list[str]:
    return [
        sys.executable, str(_HERE / "allreduce.py"), "--worker", lib,
        "--sizes", ",".join(str(s) for s in settings.sizes),
        "--min-time", repr(settings.min_time), "--warmup", str(settings.warmup),
        "--repeats", str(settings.repeats), "--parent-pid", str(os.getpid()),
        "--deadline", f"{limit + 30:.0f}",
    ]  # fmt: skip


def _env(c: Any, lib: str, host: int) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    root = harness.package_root()
    if root:  # the workers use the same asyncreduce as this process
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    if lib != "mpi":
        env.update(
            RANK=str(host),
            WORLD_SIZE=str(c.hosts),
            MASTER_ADDR=c.addrs[0],
            MASTER_PORT=str(MASTER_PORT),
            ASYNCREDUCE_ADDR=c.addrs[host],
            GLOO_SOCKET_IFNAME=c.ifname,
        )
    return env


def _run_set(c: Any, lib: str, settings: Settings, run: Run, rate: str) -> None:
    tag = f"[{lib} K={c.hosts} {rate}]"
    limit = _limit(settings, c.hosts, c.rate_bps)
    lines = _Lines()
    argv = _worker_argv(lib, settings, limit)
    print(f"{_SAY}{tag} running (hard limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        if lib == "mpi":
            mpi = harness.cluster_mpirun(c, argv, harness.MPI_FORWARD)
            codes = c.run(mpi, lambda i: _env(c, lib, i), timeout=limit, on_line=lines, on=[0])
        else:
            codes = c.run(argv, lambda i: _env(c, lib, i), timeout=limit, on_line=lines)
        _check(codes, lines)
    except (SetError, TimeoutError, cluster.ClusterError) as exc:
        run.failures.append(
            {"lib": lib, "hosts": c.hosts, "rate": rate, "error": str(exc), "tail": lines.tail()}
        )
        print(f"{_SAY}{tag} FAILED: {exc}\n{lines.tail()}", file=sys.stderr)
        return
    for message in lines.messages:
        if message.get("event") == "result":
            run.results.append(_result(message, lib, c.hosts, rate, c.rate_bps))
    took = time.monotonic() - started
    run.set_seconds[f"{lib} K={c.hosts} {rate}"] = round(took, 2)
    print(f"{_SAY}{tag} done in {took:.1f} s", file=sys.stderr, flush=True)


def _check(codes: list[int], lines: _Lines) -> None:
    failed = [f"h{i} exited with {code}" for i, code in enumerate(codes) if code != 0]
    if failed:
        raise SetError("; ".join(failed))
    if not any(m.get("event") == "done" for m in lines.messages):
        raise SetError("rank 0 exited without reporting done")


def _result(message: dict[str, Any], lib: str, hosts: int, rate: str, rate_bps: float) -> Result:
    nbytes = int(message["bytes"])
    busbw = harness.busbw_gbps(nbytes, hosts, float(message["latency_us"]) / 1e6)
    return Result(
        lib=lib,
        hosts=hosts,
        rate=rate,
        rate_bps=rate_bps,
        bytes=nbytes,
        latency_us=float(message["latency_us"]),
        busbw_gbps=busbw,
        link_share=busbw * 8e9 / rate_bps,
        algorithm=str(message["algorithm"]),
        min_us=float(message["min_us"]),
        repeats_us=[float(t) for t in message["repeats_us"]],
        iters=int(message["iters"]),
        warmup=int(message["warmup"]),
    )


def _tcp_check(c: Any, settings: Settings, run: Run, rate: str) -> None:
    if settings.tcp_seconds <= 0:
        return
    try:
        found = c.measure_tcp(0, 1, seconds=settings.tcp_seconds)
    except (cluster.ClusterError, OSError, ValueError) as exc:
        print(f"{_SAY}TCP link check failed at {rate}: {exc}", file=sys.stderr)
        return
    run.tcp.append({"hosts": c.hosts, "rate": rate, "send_s": settings.tcp_seconds, **found})


def _run_cluster(hosts: int, rate: str, libs: list[str], settings: Settings, run: Run) -> None:
    try:
        with cluster.Cluster(hosts, rate, mtu=settings.mtu) as c:
            _tcp_check(c, settings, run, rate)
            for lib in libs:
                _run_set(c, lib, settings, run, rate)
    except cluster.ClusterError as exc:
        for lib in libs:
            run.failures.append({"lib": lib, "hosts": hosts, "rate": rate, "error": str(exc)})
        print(f"{_SAY}cluster of {hosts} at {rate} failed: {exc}", file=sys.stderr)


def _parent_main(
    settings: Settings, json_path: Path | None, plot_path: Path | None, argv: Sequence[str]
) -> int:
    started, load = time.monotonic(), harness.LoadWatch()
    run = Run(settings)
    harness.skip_unavailable("links", settings.libs, run.skipped, harness.cluster_unavailable)
    libs = [lib for lib in settings.libs if lib not in run.skipped]
    interrupted = False
    try:
        for hosts in settings.hosts:
            for rate in settings.rates:
                _run_cluster(hosts, rate, libs, settings, run)
    except KeyboardInterrupt:  # the cluster is already torn down; report what we have
        interrupted = True
        print(f"{_SAY}interrupted; partial results follow", file=sys.stderr)
    elapsed = time.monotonic() - started
    machine = {**harness.machine_info(), **load.ended()}
    return harness.finish(
        report(run, machine), elapsed, interrupted, bool(run.failures),
        json_path, lambda path: write_json(path, run, machine, argv, elapsed),
        plot_path if run.results else None, lambda path: plot(path, run),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
