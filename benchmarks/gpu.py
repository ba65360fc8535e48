"""GPU training: DataParallel's modes against DDP over Gloo, NCCL and asyncreduce; staged allreduce.

Theory of operation
-------------------
One run, N ranks (``--ranks``, default 2) started by ``asyncreduce run`` on one GPU (or one GPU
per rank where there are enough), measures in interleaved rounds every training row of
``gpu_setup`` (DataParallel in each mode over ``ar.init()``, DDP over Gloo, over NCCL and over
the "asyncreduce" backend, DataParallel over ``ar.init(backend="torch")`` on NCCL, and the
no-communication ceiling) on ResNet-50 with 64 images per rank (torchvision's where it is
importable, else the same network built in ``gpu_models``), then the staged-allreduce rows of
``gpu_staged`` at 4 and 100 MiB. It reports steps/s, each row's ratio to DDP over Gloo and to
the ceiling, DataParallel's hidden share, a parameter check (the final parameters' digest
against DDP over Gloo's), host synchronizations per step on the training thread (CUDA's sync
debug mode), and the targets of issue 34 as "met", "not met" or "unmeasured"
(``gpu_report``). On one GPU the defaults take 1-2 minutes, at most ``--limit`` (225 s).

Without a GPU (``--standin``, and the default where ``torch.cuda.is_available()`` is False)
the same run goes through the CPU stand-in (``asyncreduce.torch.standin``, registered inside
each rank): every CPU tensor is then staged through a "device" that counts its copies and
synchronizations, and ``DeviceReads`` lists the transfers made outside it on the training
thread. A tiny MLP, a few steps and sizes of 64 KiB and 6 MiB (over the 4 MiB chunk: two
chunks) make it a test of the plumbing (tests/test_bench_gpu.py), and every number it prints
is labelled "stand-in, not a GPU"; the GPU targets stay "unmeasured".

A row that fails is reported with its error and the others go on. A phase that makes no
progress for ``--row-timeout`` seconds ends its worker set (``gpu_rank``); the parent then
starts a new set for the rows not yet measured, without the one that hung, while ``--limit``
allows.

Run it as ``asyncreduce bench gpu [options]`` or ``python benchmarks/gpu.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # the harness and gpu_*.py, next to this file
import harness  # noqa: E402
from gpu_setup import LABELS, ROWS, STANDIN  # noqa: E402

MARK = "@bench-gpu "
GPU: dict[str, Any] = {"model": "resnet50", "batch": 64, "steps": 10, "rounds": 3, "warmup": 3,
       "count_steps": 3, "sizes": [4 << 20, 100 << 20], "reps": [20, 8],
       "row_timeout": 60.0, "limit": 225.0}  # fmt: skip
STAND_IN: dict[str, Any] = {"model": "mlp", "batch": 16, "steps": 10, "rounds": 3, "warmup": 3,
            "count_steps": 3, "sizes": [64 << 10, 6 << 20], "reps": [10, 5],
            "row_timeout": 30.0, "limit": 80.0}  # fmt: skip
_SAY = "bench gpu: "


# ---- command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncreduce bench gpu",
        description="DataParallel on GPUs against DDP over Gloo/NCCL/asyncreduce, and the "
        "staged allreduce; on the CPU stand-in where there is no GPU.",
        epilog="example: asyncreduce bench gpu --json results/gpu.json --plot results/gpu.png",
    )
    add = p.add_argument
    add("--ranks", type=int, default=2, help="ranks (default 2)")
    add("--standin", action="store_true",
        help="run on the CPU stand-in (the default where torch sees no CUDA GPU)")  # fmt: skip
    add("--model", choices=("resnet50", "mlp"), default=None,
        help="default: resnet50 on a GPU, mlp on the stand-in")  # fmt: skip
    add("--rows", type=harness.lib_list(ROWS, "rows"), default=list(ROWS),
        help=f"training rows, of {','.join(ROWS)} (default all)")  # fmt: skip
    for name, kind, what in (
        ("batch", int, "images per rank"),
        ("steps", int, "timed steps per round and row"),
        ("rounds", int, "interleaved rounds"),
        ("warmup", int, "untimed steps per row"),
        ("count-steps", int, "counted steps per row (copies, syncs)"),
        ("row-timeout", float, "seconds one phase of one row may take"),
        ("limit", float, "seconds for the whole run"),
    ):
        key = name.replace("-", "_")
        add(f"--{name}", type=kind, default=None,
            help=f"{what} (default {GPU[key]:g}; stand-in {STAND_IN[key]:g})")  # fmt: skip
    add("--sizes", type=harness.comma_list("size", harness.parse_size), default=None,
        help="staged-allreduce sizes (default 4M,100M; stand-in 64K,6M)")  # fmt: skip
    add("--reps", type=int, default=None,
        help="repetitions per staged size (default 20 and 8; stand-in 10 and 5)")  # fmt: skip
    add("--json", type=Path, help="write the results here")
    add("--plot", type=Path, help="write a PNG here (matplotlib)")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--settings", default="{}", help=argparse.SUPPRESS)
    add("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _settings(args: argparse.Namespace, standin: bool) -> dict[str, Any]:
    """The defaults of the run's kind, overridden by what the command line gave."""
    s = dict(STAND_IN if standin else GPU)
    for key in ("model", "batch", "steps", "rounds", "warmup", "count_steps", "row_timeout",
                "limit"):  # fmt: skip
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if args.sizes is not None:
        s["sizes"] = args.sizes
    reps = s.pop("reps")
    s["reps"] = {str(size): args.reps or reps[min(i, len(reps) - 1)]
                 for i, size in enumerate(s["sizes"])}  # fmt: skip
    s.update(standin=standin, ranks=args.ranks, rows=list(args.rows), staged=bool(s["sizes"]))
    return s


def _cuda() -> bool:
    """Whether torch sees a CUDA GPU (the ranks name them: this process makes no context)."""
    import torch

    return bool(torch.cuda.is_available())


# ---- one worker set -------------------------------------------------------------------------


class _Set:
    """One ``asyncreduce run`` of the ranks: rank 0's reports as they come, and the end."""

    def __init__(self, settings: dict[str, Any], limit: float) -> None:
        cmd = [sys.executable, "-m", "asyncreduce", "run", "-n", str(settings["ranks"]),
               str(Path(__file__).resolve()), "--worker", "--settings", json.dumps(settings),
               "--parent-pid", str(os.getpid())]  # fmt: skip
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_HERE.parent / "src"),
                                                        env.get("PYTHONPATH")) if p)  # fmt: skip
        self.reports: list[dict[str, Any]] = []
        self.tail: list[str] = []
        self.hung = False  # a rank's phase ran over the row timeout (faulthandler said so)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)  # fmt: skip
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        self.code = self._wait(limit)
        reader.join(5)
        self.seconds = time.monotonic() - self.started

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if MARK in line:
                self.reports.append(json.loads(line.split(MARK, 1)[1]))
            else:
                self.hung = self.hung or "Timeout (" in line  # faulthandler's first line
                self.tail = [*self.tail[-40:], line.rstrip()]

    def _wait(self, limit: float) -> int:
        try:
            return self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.tail.append(f"{_SAY}the set ran over {limit:.0f} s: stopped")
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)  # the launcher, which stops its ranks
                    return self.proc.wait(timeout=grace)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return -9

    def last(self, event: str) -> dict[str, Any]:
        found = [r for r in self.reports if r.get("event") == event]
        return found[-1] if found else {}


def _collect(
    settings: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Run sets until every row and size is reported or ``limit`` is spent: (rows by key,
    staged entries, what each set did)."""
    rows: dict[str, Any] = {}
    staged: list[dict[str, Any]] = []
    sets: list[dict[str, Any]] = []
    tail: list[str] = []
    deadline = time.monotonic() + settings["limit"]
    pending, want_staged = list(settings["rows"]), settings["staged"]
    while (pending or want_staged) and deadline - time.monotonic() > 15 and len(sets) < 4:
        one = _Set({**settings, "rows": pending, "staged": want_staged},
                   deadline - time.monotonic())  # fmt: skip
        for report in one.reports:
            if report.get("event") == "row":
                rows[report["key"]] = {k: v for k, v in report.items() if k != "event"}
            elif report.get("event") == "staged":
                staged.append({k: v for k, v in report.items() if k != "event"})
        if one.last("model"):
            settings["model_label"] = one.last("model")["label"]
        if one.last("gpus"):
            settings["gpus"] = one.last("gpus")["names"]
        pending = [k for k in pending if k not in rows]
        want_staged = want_staged and len(staged) < len(settings["sizes"])
        sets.append({"rows": len(rows), "code": one.code, "seconds": round(one.seconds, 1)})
        if one.code == 0:
            break
        tail = one.tail[-25:]
        if not _blame(one, settings, rows, staged, pending):
            break  # it died where no row was running: another set would too
        pending = [k for k in pending if k not in rows]
        want_staged = want_staged and not any(e.get("status") for e in staged)
    for key in pending:
        rows[key] = {"key": key, "status": "error: not run (the worker sets failed; see 'sets')"}
    if tail:
        sets[-1]["tail"] = tail  # the last failed set's output
    return rows, staged, sets


def _blame(one: _Set, settings: dict[str, Any], rows: dict[str, Any],
           staged: list[dict[str, Any]], pending: list[str]) -> bool:  # fmt: skip
    """Mark the row (or staged size) the dead set was in; False where none was."""
    where = one.last("start")
    how = (f"no progress for {settings['row_timeout']:g} s (the row timeout)" if one.hung
           else f"a rank died (exit code {one.code})")  # fmt: skip
    text = f"error: {how} in {where.get('phase', '?')}; the run went on without it"
    if where.get("row") in pending:
        rows[where["row"]] = {"key": where["row"], "status": text}
        return True
    if where.get("row") == "staged":
        staged.append({"bytes": 0, "ms": {}, "errors": {"all": text}, "status": text})
        return True
    print(f"{_SAY}the worker set failed:\n" + "\n".join(one.tail[-25:]), file=sys.stderr)
    return False


# ---- the parent -----------------------------------------------------------------------------


def _document(settings: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    started, load = time.monotonic(), harness.LoadWatch()
    rows, staged, sets = _collect(settings)
    gpus = settings.get("gpus", [])
    machine = {**harness.machine_info(), "gpus": gpus, "library": harness.library_state()}
    machine.update(load.ended())
    where = STANDIN if settings["standin"] else f"GPU: {', '.join(gpus) or '(not named)'}"
    label = STANDIN if settings["standin"] else "GPU"
    ordered = [{**rows[k], "label": LABELS[k], "measured_on": label} for k in settings["rows"]]
    return {
        "benchmark": "gpu",
        "standin": settings["standin"],
        "measured_on": where,
        "machine": machine,
        "machine_line": harness.machine_line(machine),
        "model": settings.get("model_label", settings["model"]),
        "settings": settings,
        "rows": ordered,
        "staged": [{**e, "measured_on": label} for e in staged if e.get("bytes")],
        "staged_failures": [e for e in staged if not e.get("bytes")],
        "sets": sets,
        "elapsed_s": round(time.monotonic() - started, 1),
        "command": {"argv": list(argv)},
    }


def _worker(args: argparse.Namespace) -> int:
    from gpu_rank import worker

    harness.watchdog(args.parent_pid, None)

    def tell(event: str, **fields: Any) -> None:
        print(MARK + json.dumps({"event": event, **fields}), flush=True)

    worker(json.loads(args.settings), tell)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.ranks < 2:
        print(f"{_SAY}--ranks must be at least 2", file=sys.stderr)
        return 2
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"{_SAY}--plot needs matplotlib, which is not installed", file=sys.stderr)
        return 2
    cuda = _cuda()
    settings = _settings(args, standin=args.standin or not cuda)
    if not cuda and not args.standin:
        print(f"{_SAY}torch sees no CUDA GPU: running on the CPU stand-in ({STANDIN})")
    from gpu_report import complete, plot, render

    doc = _document(settings, argv)
    complete(doc)
    print(render(doc))
    print(f"\n{_SAY}{doc['elapsed_s']:.1f} s in all")
    if args.json:
        harness.save_json(args.json, doc)
    if args.plot:
        plot(args.plot, doc)
    failed = [r["key"] for r in doc["rows"] if str(r.get("status", "")).startswith("error")]
    return 1 if failed or doc["staged_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
