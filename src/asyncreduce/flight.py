"""The flight recorder: the last operations of one rank, and who is to blame when a job fails.

Every rank keeps its last ``capacity`` operations (key, kind, dtype, count, state, wall-clock
timestamps, the error of a failed one). ``Communicator.flight_record()`` returns them; they
are written as JSON when the communicator breaks (to ``ASYNCREDUCE_FLIGHT_DIR``, if set) or on
demand with ``Communicator.dump_flight_record(path)``. ``culprit`` reads every rank's dump and
says what went wrong first: operations that some ranks posted and others never did, ranks that
disagree on an operation, and the first failure in time. ``asyncreduce culprit DIR`` prints it.

Wall-clock times (``time.time``) are used so that dumps from several hosts can be compared;
they are as good as the hosts' clock synchronisation.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import ranks_phrase

__all__ = ["FlightRecorder", "Record", "culprit", "load_dumps", "settle"]

log_ops = logging.getLogger("asyncreduce.ops")  # see comm.py: off unless set to DEBUG

_FORMAT = "asyncreduce-flight-record/1"
_Ran = tuple[bytes, int, Any, int, float, float]  # FlightRecorder.ran's arguments


@dataclass(slots=True)
class Record:
    """One operation as this rank saw it: kept raw (posting costs no formatting), worded only
    when a snapshot is taken."""

    name: bytes
    instance: int
    desc: Any  # what was posted, worded by the recorder's ``describe``
    priority: int
    posted_at: float
    state: str = "pending"  # pending, done, failed
    finished_at: float | None = None
    error: str | None = None


def settle(
    flight: FlightRecorder | None, rank: int, label: str, key: tuple[bytes, int], desc: Any,
    priority: int, posted: float, ended: float, error: BaseException | None = None,
    record: Record | None = None,
) -> None:  # fmt: skip
    """How an operation ended, recorded the same way whichever way it went (the engine, a
    direct run, the lane; protocol/route.py): its ``record`` finished, or, where none was kept
    and it completed (it ran on its caller's thread: ``posted`` and ``ended`` monotonic), one
    kept for it (``FlightRecorder.ran``); and the per-operation DEBUG line. Call it before the
    request completes: its waiter may log next."""
    if flight is not None:
        if record is not None:
            flight.finish(record, error)
        elif error is None:
            flight.ran((key[0], key[1], desc, priority, posted, ended))
    if log_ops.isEnabledFor(logging.DEBUG):
        log_ops.debug("rank %d ends %s: %s", rank, label, error or "done")


class FlightRecorder:
    """A bounded ring of ``Record``s; written by the engine thread, read from any thread."""

    def __init__(
        self, rank: int, world_size: int, capacity: int = 1000, describe: Callable[[Any], str] = str
    ) -> None:
        self.rank = rank
        self._describe = describe
        self.world_size = world_size
        self._records: deque[Record] = deque(maxlen=max(1, capacity))
        self._ran: deque[_Ran] = deque(maxlen=max(1, capacity))
        # An operation that ran to the end on its caller's thread (a direct run, the lane;
        # times by ``time.monotonic``): kept as a tuple (name, instance, desc, priority,
        # posted, ended), one append (atomic, in C) without the lock, and worded as a done
        # record by ``snapshot``. A record per call would cost a tenth of the call; none
        # would let ``culprit`` blame a rank for what it ran this way.
        self.ran: Callable[[_Ran], None] = self._ran.append
        self._lock = threading.Lock()
        self.broken: str | None = None

    def add(self, record: Record) -> Record:
        with self._lock:
            self._records.append(record)
        return record

    @staticmethod
    def finish(record: Record, error: BaseException | None = None) -> None:
        record.finished_at = time.time()
        if error is None:
            record.state = "done"
        else:
            record.state, record.error = "failed", f"{type(error).__name__}: {error}"

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy: who this is, why it broke (if it did), and its records."""
        with self._lock:
            kept = list(self._records)
        ran = self._ran.copy()  # (in C: not interrupted by an append)
        if ran:
            kept = self._with_ran(kept, ran)
        records = [self._worded(r) for r in kept]
        return {
            "format": _FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "dumped_at": time.time(),
            "broken": self.broken,
            "records": records,
        }

    def _with_ran(self, records: list[Record], ran: Iterable[_Ran]) -> list[Record]:
        """``records`` and the operations that ran on their callers' threads, as records, in
        the order they were posted; the last ``capacity`` of them."""
        shift = time.time() - time.monotonic()
        done = [Record(name, instance, desc, priority, posted + shift, "done", ended + shift)
                for name, instance, desc, priority, posted, ended in ran]  # fmt: skip
        merged = sorted(records + done, key=lambda r: r.posted_at)
        return merged[-(self._records.maxlen or 1) :]

    def _worded(self, r: Record) -> dict[str, Any]:
        return {
            "name": r.name.decode(errors="replace"),
            "instance": r.instance,
            "what": self._describe(r.desc),  # e.g. "allreduce float32[1000] sum"
            "priority": r.priority,
            "posted_at": r.posted_at,
            "state": r.state,
            "finished_at": r.finished_at,
            "error": r.error,
        }

    def dump(self, path: str) -> str:
        """Write the snapshot to ``path`` (a file, or a directory to hold flight-rank<R>.json)."""
        if os.path.isdir(path):
            path = os.path.join(path, f"flight-rank{self.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.snapshot(), f, indent=1)
        os.replace(tmp, path)
        return path


def load_dumps(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Read flight-record dumps: files, or directories holding flight-rank*.json."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(
                os.path.join(p, f)
                for f in os.listdir(p)
                if f.startswith("flight-rank") and f.endswith(".json")
            )
        else:
            files.append(p)
    dumps = []
    for f in files:
        with open(f, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{f} is not an asyncreduce flight record")
        dumps.append(data)
    return dumps


def culprit(dumps: list[dict[str, Any]]) -> list[str]:
    """Findings, most telling first, from the dumps of several ranks of one job."""
    if not dumps:
        return ["no flight records given"]
    world = int(dumps[0]["world_size"])
    ranks = {int(d["rank"]) for d in dumps}
    findings = []
    missing_dumps = sorted(set(range(world)) - ranks)
    if missing_dumps:
        who = ranks_phrase(missing_dumps)
        findings.append(f"no flight record from {who} (died before dumping?)")
    findings += _posted_by_some(dumps, ranks)
    findings += _disagreements(dumps)
    findings += _first_failure(dumps)
    return findings or ["every rank posted the same operations and none failed"]


def _by_key(dumps: list[dict[str, Any]]) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    table: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for d in dumps:
        for r in d["records"]:
            table.setdefault((r["name"], int(r["instance"])), {})[int(d["rank"])] = r
    return table


def _oldest_common(dumps: list[dict[str, Any]]) -> float:
    """Records older than every rank's oldest one may have rolled out of some ring: skip them."""
    starts = [min((r["posted_at"] for r in d["records"]), default=0.0) for d in dumps]
    return max(starts)


def _posted_by_some(dumps: list[dict[str, Any]], ranks: set[int]) -> list[str]:
    since = _oldest_common(dumps)
    out = []
    for (name, instance), seen in sorted(_by_key(dumps).items(), key=_first_posted):
        if min(r["posted_at"] for r in seen.values()) < since or set(seen) == ranks:
            continue
        missing = ranks_phrase(ranks - set(seen))
        what, posters = next(iter(seen.values()))["what"], sorted(seen)
        out.append(
            f"{_label(name, instance)} ({what}) was posted by {ranks_phrase(posters)} but never "
            f"by {missing}: {missing} skipped it or fell behind"
        )
    return out


def _disagreements(dumps: list[dict[str, Any]]) -> list[str]:
    out = []
    for (name, instance), seen in sorted(_by_key(dumps).items(), key=_first_posted):
        whats = {r["what"] for r in seen.values()}
        if len(whats) > 1:
            sides = "; ".join(f"rank {k}: {v['what']}" for k, v in sorted(seen.items()))
            out.append(f"ranks disagree on {_label(name, instance)}: {sides}")
    return out


def _first_failure(dumps: list[dict[str, Any]]) -> list[str]:
    failed = [
        (r["finished_at"] or 0.0, int(d["rank"]), r)
        for d in dumps
        for r in d["records"]
        if r["state"] == "failed"
    ]
    if not failed:
        return []
    at, rank, r = min(failed, key=lambda f: (f[0], f[1]))
    return [f"first failure: rank {rank}, {_label(r['name'], r['instance'])}: {r['error']}"]


def _first_posted(item: tuple[tuple[str, int], dict[int, dict[str, Any]]]) -> float:
    return float(min(r["posted_at"] for r in item[1].values()))


def _label(name: str, instance: int) -> str:
    return f"{name!r}#{instance}" if name else f"unnamed #{instance}"
