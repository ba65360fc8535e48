"""Training through rotating faults: goodput, exclusion, rejoin and digests (issue 37).

Four ranks, one per emulated host (network namespaces behind one switch, links shaped to
``--rate`` with tbf: scripts/cluster.py; needs root), train a small regression with
``asyncreduce.torch.Elastic`` (benchmarks/elastic_rank.py). Every ``--every`` seconds one of
them is struck, in turn: SIGKILL of slot 3, SIGSTOP of slot 2 (SIGCONT after the peer timeout
plus 1 s), link down of slot 1 (up again as long after), SIGKILL of slot 0 (the store's host).
This process restarts whatever exited (``ASYNCREDUCE_RESTART``), and it rejoins through the
doors. As ``asyncreduce run --max-restarts`` does, the process that restarts a slot is a
spare, started ahead on that host and waiting in ``ar.init()`` (a new one is started 5 s after
each call); ``--no-spares`` starts a new process instead. A fault waits until the last victim
is back, at most another ``--every`` seconds.

Each run lasts ``--seconds``; the first is fault-free, on the same hosts. The table gives:
* goodput: samples committed per second over the run, and its ratio to the fault-free run's;
* exclusion: seconds from a fault until every survivor had its new membership (p50, p99);
* rejoin: seconds from the restart (a spare called in, or a process started) until its first
  committed step (p50, p99),
  beside the target of 3 s plus its state's size over the link rate; "of it ours": from the
  moment it calls ``ar.init()`` (Python, torch and torch's first optimizer are loaded by then);
* divergent: committed steps whose parameter digests differ between members (must be 0);
* hangs: runs that stopped committing for 30 s, or did not end within 60 s of the stop;
* replay: the largest difference between the parameters and a one-process replay of the
  committed steps (each step's membership and samples), which must stay within 1e-5.

There is nothing to compare with in the same run: over Gloo, NCCL or Open MPI a lost rank ends
the job (docs/elastic.md). Run: ``asyncreduce bench elastic [--every 10 30] [--seconds 120]
[--rate 1gbit] [--peer-timeout 2] [--json FILE] [--plot FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import elastic_rank  # noqa: E402
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KILL, STOP, LINK = "kill", "stop", "link down"
FAULTS = ((KILL, 3), (STOP, 2), (LINK, 1), (KILL, 0))
HOSTS, DOOR_PORT, MASTER_PORT = 4, 29700, 29500
STALL_S, END_S, SPARE_AFTER_S = 30.0, 60.0, 5.0


class Job:
    """The four ranks of one run, restarted when they exit, and the lines they print."""

    def __init__(self, cluster: Any, peer_timeout: float, folder: Path, run: int,
                 spares: bool = True) -> None:  # fmt: skip
        self.cluster, self.folder = cluster, folder
        self.stop_file = folder / f"stop-{run}"
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.env = {"ASYNCREDUCE_PEER_TIMEOUT": str(peer_timeout),
                    "ASYNCREDUCE_DOORS": ",".join(f"{a}:{DOOR_PORT + run}"
                                                  for a in cluster.addrs)}  # fmt: skip
        self.port = MASTER_PORT + run
        self.procs: list[subprocess.Popen[str]] = []
        self.restarts = [0] * HOSTS
        self.spawned: dict[tuple[int, int], float] = {}  # (slot, restart) -> when started
        self.stopping = False
        self.exits: list[tuple[int, float]] = []  # (slot, when its exit was seen)
        self.spares: dict[int, subprocess.Popen[str]] = {}  # slot -> a spare on its host
        self.spare_due: dict[int, float] = {s: 0.0 for s in range(HOSTS)} if spares else {}
        self.keep_spares()
        for slot in range(HOSTS):
            self.procs.append(self._spawn(slot))

    def _spawn(self, slot: int, spare: bool = False) -> subprocess.Popen[str]:
        """A rank for ``slot`` on its host; a ``spare`` runs up to ``ar.init()`` and waits there
        until it is told the slot (as ``asyncreduce run --max-restarts`` does)."""
        env = {**harness.cluster.cluster_env(self.cluster, slot, self.port), **self.env,
               "ASYNCREDUCE_RESTART": str(self.restarts[slot])}  # fmt: skip
        if spare:
            env["ASYNCREDUCE_SPARE"] = "1"
        argv = [sys.executable, str(Path(elastic_rank.__file__)), "--stop", str(self.stop_file),
                "--out", str(self.folder)]  # fmt: skip
        proc = self.cluster.popen(slot, argv, env, stdout=subprocess.PIPE,
                                  stdin=subprocess.PIPE if spare else subprocess.DEVNULL)
        if not spare:
            self.spawned[(slot, self.restarts[slot])] = time.time()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
        return proc

    def _stand_in(self, slot: int) -> subprocess.Popen[str]:
        """The slot's spare, told to restart it, else a process started now."""
        spare = self.spares.pop(slot, None)
        if slot in self.spare_due:
            self.spare_due[slot] = time.time() + SPARE_AFTER_S
        if spare is None or spare.poll() is not None:
            return self._spawn(slot)
        assert spare.stdin is not None
        spare.stdin.write(f"{slot} {self.restarts[slot]}\n")
        spare.stdin.close()
        self.spawned[(slot, self.restarts[slot])] = time.time()
        return spare

    def keep_spares(self) -> None:
        """A new spare for each slot whose last one stood in a while ago (SPARE_AFTER_S: its
        imports would otherwise slow the rejoin on a small machine)."""
        for slot, due in self.spare_due.items():
            if slot not in self.spares and time.time() >= due and not self.stopping:
                self.spares[slot] = self._spawn(slot, spare=True)

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def restart_exited(self) -> list[int]:
        """Start again every rank that exited (not after the stop); their slots."""
        again = []
        for slot, proc in enumerate(self.procs):
            if proc.poll() is not None and not self.stopping:
                self.exits.append((slot, time.time()))
                self.restarts[slot] += 1
                self.procs[slot] = self._stand_in(slot)
                again.append(slot)
        self.keep_spares()
        return again

    def strike(self, fault: str, slot: int) -> None:
        if fault == KILL:
            os.kill(self.procs[slot].pid, signal.SIGKILL)
        elif fault == STOP:
            os.kill(self.procs[slot].pid, signal.SIGSTOP)
        else:
            self._link(slot, "down")

    def heal(self, fault: str, slot: int) -> None:
        if fault == STOP:
            os.kill(self.procs[slot].pid, signal.SIGCONT)
        elif fault == LINK:
            self._link(slot, "up")

    def _link(self, slot: int, state: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.cluster.netns[slot], "ip", "link", "set",
                        "eth0", state], check=True)  # fmt: skip

    def end(self, trained: set[tuple[int, int]]) -> bool:
        """Ask every rank to stop; True if they all exited within END_S. Spares are killed,
        and so is a restarted rank that has not trained yet (``trained``: the (slot, restart)
        that committed a step): the members stop without letting it in."""
        self.stopping = True
        for slot, proc in [*self.spares.items(), *enumerate(self.procs)]:
            if proc in self.spares.values() or (slot, self.restarts[slot]) not in trained:
                proc.kill()
                proc.wait()
        self.stop_file.touch()
        deadline = time.monotonic() + END_S
        ended = True
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                ended = False
                proc.kill()
                proc.wait()
        return ended


class Record:
    """What one run's ranks said, read as they say it."""

    def __init__(self) -> None:
        self.digests: dict[int, dict[tuple[int, int], str]] = {}  # step -> (slot, restart) ->
        self.last_step: dict[tuple[int, int], int] = {}  # (slot, restart) -> its last step
        self.ended: set[tuple[int, int]] = set()  # the processes that ended normally
        self.worlds: dict[int, int] = {}  # step -> world size
        self.step_t: dict[int, float] = {}  # step -> when its first member committed it
        self.changes: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # every line but the steps
        self.starts: list[dict[str, Any]] = []
        self.joined: list[dict[str, Any]] = []  # each restarted rank's first committed step
        self.last_step_t = time.time()
        self.first_t: float | None = None
        self.last_world = 0
        self._fresh: set[int] = set()

    def take(self, line: dict[str, Any]) -> None:
        kind = line["event"]
        if kind != "step":
            self.events.append(line)
        if kind == "start":
            self.starts.append(line)
            if line["restart"]:
                self._fresh.add(line["slot"])
        elif kind == "change":
            self.changes.append(line)
        elif kind == "end":
            self.ended.add((line["slot"], line["restart"]))
        elif kind == "step":
            who = (line["slot"], line["restart"])
            self.digests.setdefault(line["step"], {})[who] = line["digest"]
            self.last_step[who] = line["step"]
            self.worlds[line["step"]] = line["world"]
            self.step_t.setdefault(line["step"], line["t"])
            self.last_step_t, self.last_world = time.time(), line["world"]
            if self.first_t is None:
                self.first_t = line["t"]
            if line["slot"] in self._fresh:
                self._fresh.discard(line["slot"])
                self.joined.append(line)

    def divergent(self) -> list[dict[str, Any]]:
        """The steps whose digests differ between ranks. The last step of a process that was
        struck is left out: it may have finished a step that no other member finished (the
        group then redid it without that process), so it was never committed."""
        cut = {(who, step) for who, step in self.last_step.items() if who not in self.ended}
        found = []
        for step, by_who in sorted(self.digests.items()):
            kept = {who: d for who, d in by_who.items() if (who, step) not in cut}
            if len(set(kept.values())) > 1:
                found.append({"step": step, "digests": {f"{s}.{r}": d for (s, r), d in
                                                        kept.items()}})  # fmt: skip
        return found


def run_once(cluster: Any, args: argparse.Namespace, every: float | None, run: int,
             folder: Path) -> dict[str, Any]:  # fmt: skip
    """One run of ``args.seconds``: fault-free when ``every`` is None."""
    job, record = Job(cluster, args.peer_timeout, folder, run, not args.no_spares), Record()
    faults: list[dict[str, Any]] = []
    hung = False
    try:
        _wait_for_steps(job, record)
        settled = time.monotonic() + (SPARE_AFTER_S if job.spare_due else 0.0)
        while time.monotonic() < settled:  # (the spares' imports are done before the timing)
            _drain(job, record, 0.1)
        began = time.time()
        next_fault, turn = began + (every or 0), 0
        while time.time() - began < args.seconds:
            _drain(job, record, 0.05)
            job.restart_exited()
            if time.time() - record.last_step_t > STALL_S:
                hung = True
                break
            if every and time.time() >= next_fault and _all_back(job, record, next_fault, every):
                fault, slot = FAULTS[turn % len(FAULTS)]
                faults.append({"fault": fault, "slot": slot, "t": time.time()})
                job.strike(fault, slot)
                if fault != KILL:
                    threading.Timer(args.peer_timeout + 1.0, job.heal, (fault, slot)).start()
                next_fault, turn = time.time() + every, turn + 1
        ended_t = time.time()
        hung = not job.end(set(record.last_step)) or hung
        _drain(job, record, 0.5)
    finally:
        job.stopping = True
        for proc in [*job.procs, *job.spares.values()]:
            if proc.poll() is None:
                proc.kill()
    for fault in faults:  # (when the victim's process was gone)
        exits = [t for slot, t in job.exits if slot == fault["slot"] and t >= fault["t"]]
        fault["exited_after_s"] = min(exits) - fault["t"] if exits else None
    return _summary(record, faults, began, ended_t, hung, folder, args, job.spawned)


def _wait_for_steps(job: Job, record: Record) -> None:
    deadline = time.monotonic() + 120
    while record.last_world < HOSTS:
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks did not start training within 120 s")
        _drain(job, record, 0.1)


def _all_back(job: Job, record: Record, due: float, every: float) -> bool:
    """Every slot trains again (the last victim rejoined), or the fault waited ``every``."""
    return record.last_world == HOSTS or time.time() > due + every


def _drain(job: Job, record: Record, wait: float) -> None:
    try:
        record.take(job.lines.get(timeout=wait))
        while True:
            record.take(job.lines.get_nowait())
    except queue.Empty:
        pass


def _summary(record: Record, faults: list[dict[str, Any]], began: float, ended: float,
             hung: bool, folder: Path, args: argparse.Namespace,
             spawned: dict[tuple[int, int], float]) -> dict[str, Any]:  # fmt: skip
    committed = [s for s in record.worlds if record.digests[s]]
    steps_in = [s for s in committed if began <= record.step_t[s] <= ended]
    samples = sum(record.worlds[s] * elastic_rank.BATCH for s in steps_in)
    exclusion = {k: _exclusions(record, faults, k) for k in (KILL, STOP, LINK)}
    rejoin = [j["t"] - spawned[(j["slot"], j["restart"])] for j in record.joined]
    ours = [j["t"] - max(_event(record, "ready", j), spawned[(j["slot"], j["restart"])])
            for j in record.joined]  # (from ar.init(), or from a spare's call, if later)
    state_bytes = sum(p.numel() * 8 * 2 for p in elastic_rank.model().parameters())  # +momentum
    return {
        "seconds": ended - began, "began": began, "faults": len(faults), "samples": samples,
        "samples_per_s": samples / (ended - began), "divergent": len(record.divergent()),
        "divergent_steps": record.divergent()[:10], "back_s": _back(record, faults),
        "steps": len(committed), "hung": hung, "exclusion_s": exclusion,
        "rejoin_s": rejoin, "rejoin_ours_s": ours, "state_bytes": state_bytes,
        "rejoin_target_s": 3.0 + state_bytes * 8 / harness.cluster.load_module(
            "cluster", ROOT / "scripts" / "cluster.py").parse_rate(args.rate),
        "replay_max_diff": _replay_diff(folder),
        "fault_log": faults, "events": record.events,
        "spawned": [[*who, t] for who, t in spawned.items()],
        "timeline": sorted((record.step_t[s] - began, record.worlds[s]) for s in committed),
    }  # fmt: skip


def _back(record: Record, faults: list[dict[str, Any]]) -> list[float]:
    """Per fault: seconds until a step of the whole membership again, after the exclusion."""
    back = []
    for fault in faults:
        shrunk = [c["t"] for c in record.changes if c["what"] == "shrunk" and c["t"] > fault["t"]]
        if not shrunk:
            continue
        later = [t for step, t in record.step_t.items()
                 if t > min(shrunk) and record.worlds[step] == HOSTS]  # fmt: skip
        if later:
            back.append(min(later) - fault["t"])
    return back


def _event(record: Record, kind: str, joined: dict[str, Any]) -> float:
    """When the process that ``joined`` was said ``kind``."""
    return next(e["t"] for e in record.events if e["event"] == kind
                and (e["slot"], e["restart"]) == (joined["slot"], joined["restart"]))  # fmt: skip


def _exclusions(record: Record, faults: list[dict[str, Any]], kind: str) -> list[float]:
    """Per fault of ``kind``: seconds until the last survivor's "shrunk" change after it."""
    found = []
    for i, fault in enumerate(faults):
        if fault["fault"] != kind:
            continue
        until = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        shrunk = [c for c in record.changes
                  if c["what"] == "shrunk" and fault["t"] <= c["t"] < until
                  and c["slot"] != fault["slot"]]  # fmt: skip
        by_slot: dict[int, float] = {}
        for c in shrunk:  # (each survivor's first)
            by_slot.setdefault(c["slot"], c["t"])
        if by_slot:
            found.append(max(by_slot.values()) - fault["t"])
    return found


def _replay_diff(folder: Path) -> float | None:
    """The largest difference between a member's final parameters and the replay."""
    import numpy as np
    import torch

    ends = sorted(folder.glob("slot-*.npz"))
    if not ends:
        return None
    saved = np.load(ends[0])
    history = [tuple(int(v) for v in row) for row in saved["history"]]
    x, y = elastic_rank.data()
    net = elastic_rank.model()
    opt = elastic_rank.optimizer(list(net.parameters()))
    sampler = elastic_rank.sampler()
    for epoch, position, world in history:
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for member in range(world):
            batch = sampler.block(epoch, position, world, member).tolist()
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
            for g, p in zip(grads, net.parameters(), strict=True):
                g += p.grad / world
        for g, p in zip(grads, net.parameters(), strict=True):
            p.grad = g
        opt.step()
    mine = [p.detach().numpy() for p in net.parameters()]
    worst = 0.0
    for path in ends:
        theirs = np.load(path)
        for i, p in enumerate(mine):
            worst = max(worst, float(np.abs(theirs[f"arr_{i}"] - p).max()))
    return worst


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.2f}/{p99:.2f}"


def _table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["samples_per_s"]
    lines = [f"{'run':12} {'s':>5} {'faults':>6} {'samples/s':>9} {'goodput':>7} "
             f"{'kill p50/p99':>12} {'stop p50/p99':>12} {'link p50/p99':>12} "
             f"{'rejoin p50/p99':>14} {'of it ours':>10} {'divergent':>9} {'hangs':>5} "
             f"{'replay':>8}"]  # fmt: skip
    for row in rows:
        ex = row["exclusion_s"]
        replay = "-" if row["replay_max_diff"] is None else f"{row['replay_max_diff']:.1e}"
        lines.append(
            f"{row['name']:12} {row['seconds']:>5.0f} {row['faults']:>6} "
            f"{row['samples_per_s']:>9.0f} {row['samples_per_s'] / base:>7.1%} "
            f"{_percentiles(ex[KILL]):>12} {_percentiles(ex[STOP]):>12} "
            f"{_percentiles(ex[LINK]):>12} {_percentiles(row['rejoin_s']):>14} "
            f"{_percentiles(row['rejoin_ours_s']):>10} "
            f"{row['divergent']:>9} {int(row['hung']):>5} {replay:>8}"
        )  # fmt: skip
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for row in rows:
        times = [t for t, _ in row["timeline"] if t >= 0]
        samples, total = [], 0
        for _, world in (r for r in row["timeline"] if r[0] >= 0):
            total += world * elastic_rank.BATCH
            samples.append(total)
        share = row["samples_per_s"] / rows[0]["samples_per_s"]
        ax.plot(times, samples, label=f"{row['name']} ({share:.0%})")
        for fault in row["fault_log"]:
            ax.axvline(fault["t"] - row["began"], color="grey", lw=0.5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("samples committed")
    ax.set_title("asyncreduce elastic: training through rotating faults (4 emulated hosts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, nargs="+", default=[10.0, 30.0],
                        help="seconds between faults, one run each")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=120.0, help="length of each run")
    parser.add_argument("--rate", default="1gbit", help="the emulated hosts' links")
    parser.add_argument("--peer-timeout", type=float, default=2.0)
    parser.add_argument("--no-spares", action="store_true",
                        help="restart a rank as a new process, not by calling in a spare")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    machine = harness.machine.machine_info()
    print(harness.machine.machine_line(machine))
    cluster = harness.cluster.load_module("cluster", ROOT / "scripts" / "cluster.py")
    rows = []
    with cluster.Cluster(HOSTS, args.rate) as c, tempfile.TemporaryDirectory() as tmp:
        for run, every in enumerate([None, *args.every]):
            folder = Path(tmp) / f"run{run}"
            folder.mkdir()
            row = run_once(c, args, every, run, folder)
            row["name"] = "fault-free" if every is None else f"every {every:g} s"
            rows.append(row)
            print(f"{row['name']}: {row['steps']} steps, {row['faults']} faults", flush=True)
    print(f"{HOSTS} emulated hosts at {args.rate}, one rank each; ASYNCREDUCE_PEER_TIMEOUT="
          f"{args.peer_timeout} s; exclusion and rejoin in seconds (rejoin target "
          f"{rows[0]['rejoin_target_s']:.2f} s: 3 s + {rows[0]['state_bytes']} bytes of state "
          "over the link)")  # fmt: skip
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))  # fmt: skip
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")
    bad = any(r["divergent"] or r["hung"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
