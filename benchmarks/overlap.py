"""Overlap: how much of one asynchronous allreduce hides behind computation on the caller's thread.

Theory of operation
-------------------
A user posts a non-blocking allreduce, computes, then waits: the allreduce is hidden to the
degree that the whole takes less than computing and communicating one after the other. For
every (library, N) one fresh set of N ranks (see ``harness``) measures, on a float32 buffer
of ``--bytes`` (32 MiB by default, summed in place):

* ``t_comm``: post, then wait at once (the allreduce alone);
* ``t_compute``: ``k`` matmuls of two ``--matrix`` x ``--matrix`` float32 matrices (numpy, one
  BLAS thread: the workers run with OPENBLAS_NUM_THREADS=1), with no communication;
* ``t_both``: post, compute ``k`` matmuls, wait; the compute part and the wait are timed too.

``k`` is calibrated per library so that ``t_compute`` is about ``t_comm``: after a warm-up the
allreduce alone is timed three times (the median counts), and a run of matmuls worth about
25 ms five times (all ranks at once; how many, a first short probe says); ``k`` is
``round(t_comm / per matmul)`` at the fastest of the five. The fastest, not the median: on a
machine with fewer free cores than busy threads the scheduler now and then puts two ranks'
computations on one core for a few milliseconds, and a run caught by that takes up to twice as
long (short runs of twenty matmuls, median of three, once gave one library half the ``k`` of
another in the same run); contention only ever slows a run down, so the fastest is the
uncontended speed. Then ``repeats`` rounds each time the three in turn (so drift hits all three
alike); every time is the slowest rank's, and the median over rounds is reported. The overlap is

    overlap = 1 - (t_both - max(t_comm, t_compute)) / min(t_comm, t_compute)

1 when the shorter one is completely hidden, 0 when nothing is (t_both = t_comm + t_compute);
it is reported raw and clipped to [0, 1]. The calls: asyncreduce ``iallreduce`` + ``wait``
(a progress thread moves the data), Gloo ``all_reduce(async_op=True)`` + ``wait`` (Gloo's own
threads), Open MPI ``Iallreduce`` + ``Wait`` with no MPI call during the computation, as a user
would write it (Open MPI progresses a non-blocking collective only inside MPI calls).

Every rank computes on its own core share: on a machine with fewer cores than ranks times two
busy threads, communication and computation compete for the CPU and the overlap says so.

The reference: raw TCP streams
------------------------------
Moving bytes over TCP costs CPU in the kernel (and on emulated hosts the veths, the bridge and
the tbf queues run on the same cores as the ranks), so no TCP library can hide all of its
communication here. The pseudo-library ``tcp`` measures how much any could: each rank moves
exactly the bytes a ring allreduce moves over its link, 2(N-1)/N * ``--bytes`` to its right
neighbour and as many from its left (N=2: the whole buffer both ways), over plain TCP sockets
of its own, in two background threads (``sendall`` of whole buffers, ``recv_into`` woken per
512 KiB by SO_RCVLOWAT; TCP_NODELAY and 4 MiB socket buffers, as asyncreduce's), and reduces
nothing; "post" starts both threads, "wait" joins them (``rawtcp.py``, which says more). Its
barrier and max are 8-byte messages on the same sockets, never during a timed transfer. It is a
reference, not a library: its rows say so (the table: ``tcp (reference)``, "raw TCP streams, no
reduction", and a line under the table; the JSON rows and the summary: ``"reference": true``,
``false`` for the libraries; its rows also give ``bytes_each_way``), and otherwise go through
the same calibration, rounds, formula, table, JSON and plot as the libraries. Its overlap is
the ceiling this machine puts on any TCP library's, up to run-to-run noise (a few hundredths).
It runs by default with ``--hosts`` (a few seconds per set); on one host only when ``--libs``
names it, since there asyncreduce and Open MPI move the data through shared memory, not TCP, so
it bounds Gloo alone.

One host or emulated hosts
--------------------------
By default the N ranks of a set run on this host and meet over the loopback (``harness``):
there an allreduce is memory copies and reductions, CPU work that competes with the ranks'
computations for the same cores. In training the allreduce mostly waits on a network link
while the CPU is free, which is what ``--hosts K`` measures: for every K and every rate of
``--rate`` (default 1gbit) ``scripts/cluster.py`` builds K network namespaces on one switch,
each behind a full-duplex link shaped by ``tc tbf`` (``--mtu``, default 1500), as
``links.py`` does, and every set runs there with one rank per host
(``harness.run_set_in_cluster``): asyncreduce and Gloo meet at host 0's address, Open MPI is
one ``mpirun`` in host 0 over ``btl self,tcp`` on the cluster interface
(``Cluster.mpirun_argv``). The workers, the calibration and the formula are the same; the
cluster is torn down after each (K, rate), whatever happens. Needs root, ``ip`` and ``tc``;
without them ``--hosts`` fails at once and says why.

Every result row records where it ran: ``hosts`` (1 on this host), ``rate`` and ``rate_bps``
(None on the loopback) and ``mtu``; the table's ``setting`` column says it too (``1 host``,
``2 hosts @ 1gbit``), and the summary is keyed by N on one host, ``"K hosts @ RATE"`` else.

One rank (the calls, the calibration, the rounds) is ``overlap_rank.py``; the reference's
sockets are ``rawtcp.py``.

Run it as ``asyncreduce bench overlap [options]`` or ``python benchmarks/overlap.py``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_int

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # the harness, next to this file
import harness  # noqa: E402
from overlap_rank import AR_MPI, TCP, Settings, connect, overlap, worker  # noqa: E402

cluster: Any = harness.load_module(
    "asyncreduce_scripts.cluster", _HERE.parent / "scripts" / "cluster.py"
)

__all__ = ["main", "overlap"]

DEFAULT_BYTES = 32 << 20
QUICK_BYTES = 4 << 20
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
DEFAULT_MATRIX = 256
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DEFAULT_RATE = "1gbit"
DEFAULT_MTU = 1500
MASTER_PORT = 29500  # rank 0's store on an emulated host (the hosts are private)
_SAY = "overlap bench: "
KNOWN = ("asyncreduce", AR_MPI, "gloo", "mpi", TCP)  # what --libs accepts, in the table's order


def _parser() -> argparse.ArgumentParser:
    parser = harness.base_parser(
        "overlap",
        "How much of one non-blocking float32 allreduce hides behind numpy matmuls on the "
        "caller's thread: asyncreduce, Gloo (torch.distributed), Open MPI (mpi4py), and as a "
        "reference (tcp) raw TCP streams moving the same bytes with no library and no "
        "reduction. By default the ranks share this host and the loopback, where the allreduce "
        "is CPU work competing with the computation; --hosts K --rate R puts each rank on its "
        "own emulated host behind a shaped link, where the allreduce waits on the link (needs "
        "root).",
        harness.LIBS,
        DEFAULT_REPEATS,
        f"{harness.format_size(QUICK_BYTES)} buffer, {QUICK_REPEATS} repeats",
        known=KNOWN,
        libs_default=f"{','.join(harness.LIBS)}, and {TCP} with --hosts",
    )
    parser.add_argument(
        "--bytes",
        type=harness.parse_size,
        default=None,
        help="allreduce size, K/M suffixes (default 32M)",
    )
    parser.add_argument(
        "--matrix",
        type=positive_int,
        default=DEFAULT_MATRIX,
        help=f"side of the square float32 matrices multiplied (default {DEFAULT_MATRIX})",
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=1, help="untimed rounds first (default 1)"
    )
    _host_options(parser)
    parser.epilog = (
        f"{parser.epilog}; on emulated hosts: asyncreduce bench overlap --quick --hosts 2 "
        "--rate 1gbit,10gbit"
    )
    return parser


def _host_options(parser: argparse.ArgumentParser) -> None:
    """``--hosts``, ``--rate``, ``--mtu``: one rank per emulated host instead of the loopback."""
    add = parser.add_argument
    add("--hosts", type=harness.comma_list("host", harness.host_count), default=None,
        metavar="K", help="one rank per emulated host, K hosts (or K1,K2,...) in place of "
        "--nprocs on this host: network namespaces behind tc-tbf-shaped links "
        "(scripts/cluster.py, as bench links); needs root, ip and tc")  # fmt: skip
    add("--rate", type=harness.comma_list("rate", harness.checked(cluster.parse_rate)),
        default=None, metavar="R", help="with --hosts: link rate(s), comma-separated, one "
        f"cluster each (default {DEFAULT_RATE}; e.g. 1gbit,10gbit)")  # fmt: skip
    add("--mtu", type=positive_int, default=None,
        help=f"with --hosts: the links' MTU (default {DEFAULT_MTU})")  # fmt: skip


def _settings(args: argparse.Namespace) -> Settings:
    quick, hosts = bool(args.quick), args.hosts
    return Settings(
        nprocs=hosts or args.nprocs,
        libs=args.libs or _default_libs(hosts),
        bytes=args.bytes or (QUICK_BYTES if quick else DEFAULT_BYTES),
        matrix=args.matrix,
        repeats=args.repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS),
        warmup=args.warmup,
        quick=quick,
        hosts=hosts,
        rates=(args.rate or [DEFAULT_RATE]) if hosts else [],
        mtu=(args.mtu or DEFAULT_MTU) if hosts else None,
    )


def _default_libs(hosts: list[int] | None) -> list[str]:
    """Every library, and on emulated hosts the reference too (on one host asyncreduce and Open
    MPI move the data through shared memory, so raw TCP bounds only Gloo there)."""
    return [*harness.LIBS, TCP] if hosts else list(harness.LIBS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = harness.parse(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.worker:
        return harness.worker_main(args, worker, connect)
    why = _why_not(args)
    if why:
        print(f"{_SAY}{why}", file=sys.stderr)
        return 2
    return _parent(_settings(args), argv, args)


def _parent(s: Settings, argv: Sequence[str], args: argparse.Namespace) -> int:
    """Every set on this host (``harness.parent_main``), or in emulated clusters (``--hosts``)."""
    spec = functools.partial(_spec, s, args.timeout)
    bench = harness.Benchmark("overlap", Path(__file__), spec, report, summary, plot)
    run = harness.Run("overlap", asdict(s))
    if s.hosts is None or args.from_json is not None:
        return harness.parent_main(bench, run, s.libs, s.nprocs, argv, args)
    sets = functools.partial(_on_hosts, s, args.timeout)
    return harness.parent_main(
        bench, run, s.libs, s.nprocs, argv, args, sets, harness.cluster_unavailable
    )


def _why_not(args: argparse.Namespace) -> str | None:
    """Why these options cannot run here (``--rate``/``--mtu`` without ``--hosts``, or no way
    to emulate hosts), or None."""
    if args.hosts is None:
        return "--rate and --mtu need --hosts" if args.rate or args.mtu else None
    why = None if args.from_json is not None else cluster.available()
    return f"--hosts needs root, ip and tc to emulate hosts: {why}" if why else None


def _spec(
    s: Settings, timeout: float | None, lib: str, nprocs: int, rate: str | None = None
) -> harness.SetSpec:
    """One set: N ranks here, or (``rate``) one per host of a cluster of N at ``rate``."""
    slow_bytes_per_s = 30e6  # far below what a busy 2-core machine does
    one = s.bytes * nprocs / slow_bytes_per_s  # one allreduce, pessimistic
    if rate is not None:  # and the ring over the link, at half its rate
        one += 2 * (nprocs - 1) / nprocs * s.bytes * 8 / (0.5 * cluster.parse_rate(rate))
    step = 60.0 + (s.warmup + 3) * 2 * one
    limit = timeout or harness.STARTUP_S + 2 * step + s.repeats * 4 * one
    where = "" if rate is None else _setting_name(nprocs, rate)
    row = _where_row(nprocs, rate, s.mtu)
    env = dict(_ONE_THREAD)
    return harness.SetSpec(
        Path(__file__), lib, nprocs, asdict(s), limit, step, env, where=where, row=row
    )


def _setting_name(nprocs: int, rate: str | None) -> str:
    """Where a set ran, in words: ``"1 host"`` (the loopback) or ``"2 hosts @ 1gbit"``."""
    return "1 host" if rate is None else f"{nprocs} hosts @ {rate}"


def _where_row(nprocs: int, rate: str | None, mtu: int | None) -> dict[str, Any]:
    """What each result row records of where it ran."""
    if rate is None:
        return {"hosts": 1, "rate": None, "rate_bps": None, "mtu": None}
    return {"hosts": nprocs, "rate": rate, "rate_bps": cluster.parse_rate(rate), "mtu": mtu}


# ---- the parent on emulated hosts: one cluster per (K, rate) -------------------------------


def _on_hosts(
    s: Settings, timeout: float | None, run: harness.Run, libs: Sequence[str],
    progress: harness.Progress,
) -> None:  # fmt: skip
    """``parent_main``'s sets with ``--hosts``: one cluster per (K, rate), K by K."""
    for hosts in s.hosts or ():
        for rate in s.rates:
            _on_cluster(s, timeout, hosts, rate, run, libs, progress)


def _on_cluster(
    s: Settings, timeout: float | None, hosts: int, rate: str, run: harness.Run,
    libs: Sequence[str], progress: harness.Progress,
) -> None:  # fmt: skip
    """Every library's set in one cluster of ``hosts`` at ``rate``, torn down after."""
    try:
        with cluster.Cluster(hosts, rate, mtu=s.mtu or DEFAULT_MTU) as c:
            for lib in libs:
                spec = _spec(s, timeout, lib, hosts, rate)
                harness.run_set_in_cluster(c, spec, run, progress, MASTER_PORT)
    except cluster.ClusterError as exc:
        for lib in libs:
            run.failures.append(harness.failure_of(_spec(s, timeout, lib, hosts, rate), str(exc)))
        progress.end(f"{_SAY}cluster of {hosts} at {rate} failed: {exc}")


# ---- the parent: report ---------------------------------------------------------------------


def summary(run: harness.Run) -> dict[str, Any]:
    """Per N on one host (``"2"``), per ``"K hosts @ RATE"`` on emulated hosts: each library's
    overlap (clipped), its speed-up over comm + compute in turn, and whether it is the
    reference (``tcp``: raw TCP streams, no library)."""
    out: dict[str, Any] = {}
    for r in run.results:
        serial = r["t_comm_s"] + r["t_compute_s"]
        key = str(r["nprocs"]) if r.get("rate") is None else _setting_name(r["nprocs"], r["rate"])
        out.setdefault(key, {})[r["lib"]] = {
            "overlap": r["overlap"],
            "speedup_vs_serial": serial / r["t_both_s"],
            "reference": bool(r.get("reference")),  # raw TCP streams, no library
        }
    return out


def _rates(settings: dict[str, Any]) -> list[str | None]:
    """The link rates of a run: ``[None]`` (the loopback) on one host."""
    return list(settings["rates"]) if settings.get("hosts") else [None]


def _failed(run: harness.Run, lib: str, nprocs: int, rate: str | None) -> bool:
    return any((f["lib"], f["nprocs"], f.get("rate")) == (lib, nprocs, rate) for f in run.failures)


def _cells(r: dict[str, Any]) -> list[str]:
    return [
        r["call"], harness.fmt_ms(r["t_comm_s"]), harness.fmt_ms(r["t_compute_s"]),
        harness.fmt_ms(r["t_both_s"]), harness.fmt_ms(r["t_comm_s"] + r["t_compute_s"]),
        f"{r['overlap']:.2f}", f"{r['overlap_raw']:+.2f}",
        harness.fmt_ms(r["compute_in_both_s"]), harness.fmt_ms(r["wait_in_both_s"]),
        str(r["matmuls"]),
    ]  # fmt: skip


def _table(run: harness.Run, nprocs: int) -> str:
    headers = [
        "setting", "library", "call", "comm ms", "compute ms", "both ms", "serial ms", "overlap",
        "raw", "compute in both ms", "wait after ms", "matmuls",
    ]  # fmt: skip
    rows = []
    for rate in _rates(run.settings):
        where = _setting_name(nprocs, rate)
        for lib in KNOWN:
            found = run.rows(lib=lib, nprocs=nprocs, rate=rate)
            rows += [[where, _label(lib), *_cells(r)] for r in found]
            if not found and _failed(run, lib, nprocs, rate):
                rows.append([where, _label(lib), "fail", *["-"] * (len(headers) - 3)])
    title = _title(run.settings, nprocs)
    if not rows:
        return title + "\n(no results)"
    table = title + "\n" + harness.render_table(headers, rows, left=3)
    return table + _reference_note(run, nprocs)


def _label(lib: str) -> str:
    return f"{lib} (reference)" if lib == TCP else lib


def _reference_note(run: harness.Run, nprocs: int) -> str:
    """The line under a table with a reference row: what that row is."""
    found = run.rows(lib=TCP, nprocs=nprocs)
    if not found:
        return ""
    each_way = harness.format_size(found[0].get("bytes_each_way") or run.settings["bytes"])
    bounds = "any TCP library" if run.settings.get("hosts") else "Gloo (the others use shm here)"
    return (
        f"\n{TCP} (reference): no library and no reduction: each rank sends {each_way} "
        "(2(N-1)/N of the buffer, what a ring allreduce moves) to its right neighbour and "
        "receives as much from its left over plain TCP sockets, in two threads (sendall / "
        f"recv_into); its overlap is the most this machine lets {bounds} hide, up to "
        "run-to-run noise"
    )


def _title(s: dict[str, Any], nprocs: int) -> str:
    if s.get("hosts"):
        where = (
            f"N={nprocs}, one rank per emulated host (network namespaces), each behind a link "
            f"shaped by tc tbf both ways at {', '.join(s['rates'])}, MTU {s['mtu']}"
        )
    else:
        where = f"N={nprocs} on one host (loopback)"
    return (
        f"{where}: one {harness.format_size(s['bytes'])} float32 allreduce posted, then "
        f"matmuls of {s['matrix']}x{s['matrix']} float32 (numpy, 1 thread) sized to take about "
        f"as long, then wait; median of {s['repeats']}, slowest rank\n"
        "overlap = 1 - (both - max(comm, compute)) / min(comm, compute), clipped to [0, 1]; "
        "serial = comm + compute"
    )


def report(run: harness.Run, machine: dict[str, Any]) -> str:
    return harness.report_per_n(run, machine, _table)


def plot(path: Path, run: harness.Run) -> None:
    """One panel per N: comm, compute, both and comm + compute per library (grouped bars),
    and per link rate on emulated hosts."""
    plt = harness.pyplot()
    ns = run.settings["nprocs"]
    width = 2 + 5 * len(_rates(run.settings))  # 7 for one rate (4 rows), +5 per rate
    fig, axes = plt.subplots(1, len(ns), figsize=(width * len(ns), 4.5), squeeze=False)
    parts = [("t_comm_s", "allreduce alone"), ("t_compute_s", "compute alone"),
             ("t_both_s", "post, compute, wait"), ("serial", "comm + compute")]  # fmt: skip
    for ax, nprocs in zip(axes[0], ns, strict=True):
        rows = [
            r
            for rate in _rates(run.settings)
            for lib in KNOWN
            for r in run.rows(lib=lib, nprocs=nprocs, rate=rate)
        ]
        for j, (key, label) in enumerate(parts):
            values = [
                (r["t_comm_s"] + r["t_compute_s"] if key == "serial" else r[key]) * 1e3
                for r in rows
            ]
            xs = [i + (j - 1.5) * 0.2 for i in range(len(rows))]
            ax.bar(xs, values, width=0.2, label=label, hatch="//" if key == "serial" else None)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([_tick(r) for r in rows])
        ax.set_ylabel("ms (slowest rank, median)")
        where = f"{nprocs} hosts" if run.settings.get("hosts") else f"N={nprocs}, 1 host"
        ax.set_title(f"{harness.format_size(run.settings['bytes'])} allreduce vs matmuls, {where}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    harness.save_figure(plt, fig, path)


def _tick(r: dict[str, Any]) -> str:
    rate = f"\n{r['rate']}" if r.get("rate") else ""
    return f"{_label(r['lib'])}{rate}\noverlap {r['overlap']:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
