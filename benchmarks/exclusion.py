"""How long survivors take to exclude a lost rank and go on (issue 37's exclusion targets).

``N`` ranks run blocking allreduces of 1 KiB in a loop, on this host or, with ``--hosts``, one
per emulated host (network namespaces behind one switch, links shaped to ``--rate`` with tbf:
scripts/cluster.py; needs root). At a random moment the parent strikes one rank, the last or
rank 0 (the store's host): SIGKILL, SIGSTOP, or, across hosts, its link down. Every other rank
notes when its allreduce failed (BrokenError: the failure is *detected*) and when
``asyncreduce.shrink`` returned its communicator of the survivors (the rank is *excluded*, by
every survivor alike), then runs one allreduce on it to check the sum. The table gives, per
fault, p50 and p99 over the trials of the slowest survivor's times since the fault.

There is nothing to compare with in the same run: over Gloo, NCCL or Open MPI a lost rank ends
the job (docs/elastic.md).

Run: ``python benchmarks/exclusion.py [--nprocs 4] [--hosts 4 --rate 1gbit] [--trials 10]
[--peer-timeout 2] [--json FILE]``. A stopped or cut-off rank is excluded once the peer timeout
has passed: its target is that timeout plus 0.5 s; a killed one's is 1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from asyncreduce.launch import free_port  # noqa: E402

KILL, STOP, LINK = "kill", "stop", "link down"
ROOT = Path(__file__).resolve().parent.parent


def _rank(rank: int, n: int, addr: str, port: int, victim: int, say: Any) -> None:
    """One rank: allreduce until broken, then shrink and check a sum (``say`` reports)."""
    import numpy as np

    import asyncreduce as ar

    comm = ar.init(rank, n, addr, port, timeout=60)
    x = np.ones(256, np.float32)
    comm.allreduce(x.copy())
    say(("ready", rank, 0.0, 0.0))
    try:
        while True:
            comm.allreduce(x.copy())
    except ar.BrokenError:
        detected = time.time()
    if rank == victim:  # (a stopped or cut-off rank gets here long after: it was excluded)
        return
    survivors = ar.shrink(comm, timeout=60)
    excluded = time.time()
    total = survivors.allreduce(np.ones(4))[0]
    say(("done", rank, detected, excluded) if total == n - 1 else ("wrong", rank, 0.0, 0.0))
    survivors.close()


def _local_rank(rank: int, n: int, port: int, victim: int, out: Any, timeout: str) -> None:
    os.environ["ASYNCREDUCE_PEER_TIMEOUT"] = timeout
    _rank(rank, n, "127.0.0.1", port, victim, out.put)


class Local:
    """Ranks as processes of this host."""

    def start(self, n: int, victim: int, peer_timeout: float) -> tuple[list[int], Any]:
        ctx = mp.get_context("spawn")
        out, port = ctx.Queue(), free_port()
        self.procs = [ctx.Process(target=_local_rank,
                                  args=(r, n, port, victim, out, str(peer_timeout)))
                      for r in range(n)]  # fmt: skip
        for p in self.procs:
            p.start()
        return [p.pid or 0 for p in self.procs], out

    def strike(self, fault: str, pid: int, victim: int) -> None:
        os.kill(pid, signal.SIGKILL if fault == KILL else signal.SIGSTOP)

    def end(self, fault: str, pid: int, victim: int) -> None:
        if fault == STOP:
            os.kill(pid, signal.SIGCONT)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class Hosts:
    """One rank per emulated host (scripts/cluster.py), its lines read by a thread each."""

    def __init__(self, cluster: Any) -> None:
        self.cluster, self.trial = cluster, 0

    def start(self, n: int, victim: int, peer_timeout: float) -> tuple[list[int], Any]:
        c, out = self.cluster, queue.Queue()
        self.trial += 1
        port = 29500 + self.trial % 1000
        self.procs = []
        for r in range(n):  # (rank 0's address as the store's, each its own: cluster_env)
            env = {**harness.cluster.cluster_env(c, r, port),
                   "ASYNCREDUCE_PEER_TIMEOUT": str(peer_timeout)}  # fmt: skip
            argv = [sys.executable, __file__, "--worker", str(r), str(n), c.addrs[0],
                    str(port), str(victim)]  # fmt: skip
            self.procs.append(c.popen(r, argv, env, stdout=subprocess.PIPE))
        for proc in self.procs:
            threading.Thread(target=_pump, args=(proc, out), daemon=True).start()
        return [p.pid for p in self.procs], out

    def strike(self, fault: str, pid: int, victim: int) -> None:
        if fault == LINK:
            netns = self.cluster.netns[victim]
            subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "down"],
                           check=True)  # fmt: skip
        else:
            os.kill(pid, signal.SIGKILL if fault == KILL else signal.SIGSTOP)

    def end(self, fault: str, pid: int, victim: int) -> None:
        if fault == STOP:
            os.kill(pid, signal.SIGCONT)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if fault == LINK:
            netns = self.cluster.netns[victim]
            subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "up"],
                           check=True)  # fmt: skip
            time.sleep(0.5)


def _pump(proc: subprocess.Popen[str], out: queue.Queue[Any]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            out.put(tuple(json.loads(line)["say"]))


def trial(place: Any, n: int, fault: str, victim: int, peer_timeout: float) -> dict[str, float]:
    """One fault: seconds from it until the slowest survivor detected it and excluded it."""
    pids, out = place.start(n, victim, peer_timeout)
    try:
        for _ in range(n):
            out.get(timeout=90)
        time.sleep(random.uniform(0.2, 0.5))
        struck = time.time()
        place.strike(fault, pids[victim], victim)
        times = [out.get(timeout=90) for _ in range(n - 1)]
        if any(kind != "done" for kind, *_ in times):
            raise RuntimeError(f"a survivor's sum was wrong: {times}")
        return {"detected_s": max(t[2] for t in times) - struck,
                "excluded_s": max(t[3] for t in times) - struck}  # fmt: skip
    finally:
        place.end(fault, pids[victim], victim)


def _print_said(said: Any) -> None:
    print(json.dumps({"say": said}), flush=True)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _measure(args: argparse.Namespace, place: Any, faults: list[str]) -> list[dict[str, Any]]:
    rows = []
    for fault in faults:
        for who, victim in (("last", args.nprocs - 1), ("rank 0", 0)):
            runs = [trial(place, args.nprocs, fault, victim, args.peer_timeout)
                    for _ in range(args.trials)]  # fmt: skip
            row: dict[str, Any] = {"fault": fault, "victim": who, "trials": len(runs)}
            for key in ("detected_s", "excluded_s"):
                values = [r[key] for r in runs]
                row[key] = {"p50": statistics.median(values), "p99": _percentile(values, 0.99),
                            "all": values}  # fmt: skip
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:  # a rank inside an emulated host
        rank, n, port, victim = int(args[1]), int(args[2]), int(args[4]), int(args[5])
        _rank(rank, n, args[3], port, victim, _print_said)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--hosts", type=int, default=0, help="one rank per emulated host")
    parser.add_argument("--rate", default="1gbit", help="the emulated hosts' links")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--peer-timeout", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    parsed = parser.parse_args(args)
    machine = harness.machine.machine_info()
    print(harness.machine.machine_line(machine))
    if parsed.hosts:
        parsed.nprocs = parsed.hosts
        cluster = harness.cluster.load_module("cluster", ROOT / "scripts" / "cluster.py")
        with cluster.Cluster(parsed.hosts, parsed.rate) as c:
            rows = _measure(parsed, Hosts(c), [KILL, STOP, LINK])
        where = f"{parsed.hosts} emulated hosts at {parsed.rate}, one rank each"
    else:
        rows = _measure(parsed, Local(), [KILL, STOP])
        where = f"{parsed.nprocs} ranks on one host"
    print(f"{where}, ASYNCREDUCE_PEER_TIMEOUT={parsed.peer_timeout} s; seconds from the fault "
          "to the slowest survivor's")  # fmt: skip
    print(f"{'fault':9} {'victim':8} {'trials':>6} {'detected p50':>13} {'p99':>7} "
          f"{'excluded p50':>13} {'p99':>7}")  # fmt: skip
    for row in rows:
        d, e = row["detected_s"], row["excluded_s"]
        print(f"{row['fault']:9} {row['victim']:8} {row['trials']:>6} {d['p50']:>13.3f} "
              f"{d['p99']:>7.3f} {e['p50']:>13.3f} {e['p99']:>7.3f}")  # fmt: skip
    if parsed.json:
        record = {"machine": machine, "where": where, "rows": rows,
                  "peer_timeout_s": parsed.peer_timeout}  # fmt: skip
        parsed.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {parsed.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
