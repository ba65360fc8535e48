"""A timeline of what each rank did, as Chrome trace JSON (chrome://tracing, ui.perfetto.dev).

Theory of operation: a ``Timeline`` collects complete events (name, track, start, end) in
``time.perf_counter`` seconds from any thread (appending to a list is atomic in CPython, and
recording costs two floats and a tuple, nothing when no timeline is attached). ``write``
emits them as "X" events in microseconds with the rank as the process, so one file per rank
can be opened together. Made from a communicator, a timeline counts from its
``clock_origin``, an instant every rank shares, so the ranks' files line up on one time axis.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

__all__ = ["Timeline"]


class _Clocked(Protocol):
    rank: int

    @property
    def clock_origin(self) -> float: ...


class Timeline:
    """Events of one rank; tracks are named rows (``train``, ``comm``) in the viewer.

    ``Timeline(comm)`` counts from the communicator's shared ``clock_origin``; ``Timeline(rank)``
    from the moment it is made (one process alone)."""

    def __init__(self, source: _Clocked | int) -> None:
        if isinstance(source, int):
            self.rank, self._origin = source, time.perf_counter()
        else:
            self.rank, self._origin = source.rank, source.clock_origin
        self.events: list[tuple[str, str, float, float]] = []

    def add(self, name: str, track: str, start: float, end: float) -> None:
        self.events.append((name, track, start, end))

    @contextmanager
    def span(self, name: str, track: str = "train") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter())

    def to_chrome(self) -> dict[str, object]:
        tracks = sorted({track for _, track, _, _ in self.events})
        tid = {track: i for i, track in enumerate(tracks)}
        events: list[dict[str, object]] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            }
        ]
        events += [
            {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid[t], "args": {"name": t}}
            for t in tracks
        ]
        for name, track, start, end in self.events:
            ts, dur = (start - self._origin) * 1e6, max(0.0, (end - start) * 1e6)
            events.append({"ph": "X", "name": name, "cat": track, "pid": self.rank,
                           "tid": tid[track], "ts": ts, "dur": dur})  # fmt: skip
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the Chrome trace JSON to ``path``; returns the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_chrome()))
        return target
