"""How long survivors take to exclude a lost rank and go on (issue 37's exclusion targets).

``N`` ranks on this host run blocking allreduces of 1 KiB in a loop. At a random moment the
parent SIGKILLs or SIGSTOPs one of them (the last rank, or rank 0, the store's host). Every
other rank notes when its allreduce failed (BrokenError: the failure is *detected*) and when
``asyncreduce.shrink`` returned its communicator of the survivors (the rank is *excluded*, by
every survivor alike), then runs one allreduce on it to check the sum. The table gives, per
fault, p50 and p99 over the trials of the slowest survivor's times since the fault.

There is nothing to compare with in the same run: over Gloo, NCCL or Open MPI a lost rank ends
the job (docs/elastic.md).

Run: ``python benchmarks/exclusion.py [--nprocs 4] [--trials 10] [--peer-timeout 2]
[--json FILE]``. A SIGSTOPped rank is excluded once the peer timeout has passed: its target is
that timeout plus 0.5 s; a killed one's is 1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

FAULTS = (("kill", "last"), ("kill", "rank 0"), ("stop", "last"), ("stop", "rank 0"))


def _rank(rank: int, n: int, port: int, victim: int, out: Any, timeout: str) -> None:
    os.environ["ASYNCREDUCE_PEER_TIMEOUT"] = timeout
    import numpy as np

    import asyncreduce as ar

    comm = ar.init(rank, n, "127.0.0.1", port, timeout=60)
    x = np.ones(256, np.float32)
    comm.allreduce(x.copy())
    out.put(("ready", rank, 0.0, 0.0))
    try:
        while True:
            comm.allreduce(x.copy())
    except ar.BrokenError:
        detected = time.time()
    if rank == victim:  # (a stopped rank continues here, long after: it was excluded)
        return
    survivors = ar.shrink(comm, timeout=60)
    excluded = time.time()
    total = survivors.allreduce(np.ones(4))[0]
    out.put(("done", rank, detected, excluded) if total == n - 1 else ("wrong", rank, 0.0, 0.0))
    survivors.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trial(n: int, fault: str, victim: int, peer_timeout: float) -> dict[str, float]:
    """One fault: seconds from it until the slowest survivor detected it and excluded it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, n, port, victim, out, str(peer_timeout)))
             for r in range(n)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for _ in range(n):
            out.get(timeout=60)
        time.sleep(random.uniform(0.2, 0.5))
        struck = time.time()
        os.kill(procs[victim].pid or 0, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        times = [out.get(timeout=60) for _ in range(n - 1)]
        if any(kind != "done" for kind, *_ in times):
            raise RuntimeError(f"a survivor's sum was wrong: {times}")
        return {"detected_s": max(t[2] for t in times) - struck,
                "excluded_s": max(t[3] for t in times) - struck}  # fmt: skip
    finally:
        if fault == "stop":
            os.kill(procs[victim].pid or 0, signal.SIGCONT)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--peer-timeout", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    machine = harness.machine.machine_info()
    print(harness.machine.machine_line(machine))
    rows = []
    for fault, who in FAULTS:
        victim = args.nprocs - 1 if who == "last" else 0
        runs = [trial(args.nprocs, fault, victim, args.peer_timeout) for _ in range(args.trials)]
        row = {"fault": fault, "victim": who, "trials": len(runs)}
        for key in ("detected_s", "excluded_s"):
            values = [r[key] for r in runs]
            row[key] = {"p50": statistics.median(values), "p99": _percentile(values, 0.99),
                        "all": values}  # fmt: skip
        rows.append(row)
    print(f"{args.nprocs} ranks on one host, ASYNCREDUCE_PEER_TIMEOUT={args.peer_timeout} s; "
          "seconds from the fault to the slowest survivor's")  # fmt: skip
    print(f"{'fault':6} {'victim':8} {'trials':>6} {'detected p50':>13} {'p99':>7} "
          f"{'excluded p50':>13} {'p99':>7}")  # fmt: skip
    for row in rows:
        d, e = row["detected_s"], row["excluded_s"]
        print(f"{row['fault']:6} {row['victim']:8} {row['trials']:>6} {d['p50']:>13.3f} "
              f"{d['p99']:>7.3f} {e['p50']:>13.3f} {e['p99']:>7.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "nprocs": args.nprocs,
                                         "peer_timeout_s": args.peer_timeout, "rows": rows},
                                        indent=1))  # fmt: skip
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
