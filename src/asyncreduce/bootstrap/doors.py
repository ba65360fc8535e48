"""Doors: how a restarted rank finds a running elastic job through any live member.

Theory of operation. Every member of an elastic job keeps a door: a store it serves itself
(rendezvous/server.py: authenticated with the job's secret, values are bytes, nothing
pickled) at its place in ``ASYNCREDUCE_DOORS``, one ``host:port`` per slot (the job's first
ranks, in order; ``asyncreduce run --elastic`` sets it). No door is special.

A process that restarts slot ``s`` (``ASYNCREDUCE_RESTART`` above 0, ``RANK`` its slot)
knocks on the other doors in turn (``knock``): on the first that answers it writes
``join/<s>`` = a fresh nonce, then waits there for ``admit/<s>/<nonce>``. The members look at
their doors at a step boundary and let it in together (survivors.py, ``let_in``); each of them
writes the same ``Admission`` on its own door, so the door the joiner knocked on answers
whichever member it was. A door that stops answering (its member died) sends the joiner to
the next one; so does a knock nobody answers within ``patience`` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import BrokenError, UsageError
from ..rendezvous import TCPStore

__all__ = [
    "BEFORE_KNOCK", "Admission", "Door", "doors_from_env", "knock", "restart_count", "stand_in",
]  # fmt: skip

log = logging.getLogger("asyncreduce.comm")
DOORS_ENV, RESTART_ENV, SPARE_ENV = "ASYNCREDUCE_DOORS", "ASYNCREDUCE_RESTART", "ASYNCREDUCE_SPARE"
_MAX_NONCE = 2**62

#: Run before the first knock: once let in, the members wait for this process, so what costs
#: it time once per process (torch's first optimizer: asyncreduce.torch adds it) comes first.
BEFORE_KNOCK: list[Callable[[], None]] = []


def doors_from_env(env: Mapping[str, str] = os.environ) -> list[tuple[str, int]] | None:
    """The job's doors (``ASYNCREDUCE_DOORS``: ``host:port,host:port,...``), None if unset."""
    text = env.get(DOORS_ENV, "").strip()
    if not text:
        return None
    doors = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(
                f"{DOORS_ENV}={text!r}: {item!r} is not host:port; give one host:port per rank, "
                "comma-separated, in rank order"
            )  # fmt: skip
        doors.append((host, int(port)))
    return doors


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How often this rank was restarted (``ASYNCREDUCE_RESTART``; 0: a first start)."""
    text = env.get(RESTART_ENV, "0").strip() or "0"
    if not text.isdigit():
        raise UsageError(f"{RESTART_ENV}={text!r} is not a count of restarts (0, 1, 2, ...)")
    return int(text)


def stand_in() -> None:
    """(a spare: ``ASYNCREDUCE_SPARE=1``, started ahead by ``asyncreduce run --max-restarts``)
    Make ready what costs time once per process, then wait on stdin for ``<rank> <restart>``:
    the rank this process now restarts. It takes them as ``RANK`` and ``ASYNCREDUCE_RESTART``
    (``ar.init()`` then rejoins). A launcher that never calls it in ends it; an end of input
    ends it quietly."""
    if os.environ.get(SPARE_ENV) != "1":
        return
    for warm_up in BEFORE_KNOCK:
        warm_up()
    words = sys.stdin.readline().split()
    if not words:
        raise SystemExit(0)  # (the job ended without needing this spare)
    if len(words) != 2 or not all(w.isdigit() for w in words):
        raise UsageError(f"a spare was told {' '.join(words)!r}, not '<rank> <restart>'")
    os.environ.update(RANK=words[0], LOCAL_RANK=words[0], ASYNCREDUCE_RESTART=words[1])
    del os.environ[SPARE_ENV]


@dataclass(frozen=True)
class Admission:
    """What a joiner is told: where the new membership meets (``rendezvous``, under
    ``namespace``), its rank there and size, and the slot of each rank."""

    rendezvous: tuple[str, int]
    namespace: str
    rank: int
    world_size: int
    slots: tuple[int, ...]

    def to_bytes(self) -> bytes:
        host, port = self.rendezvous
        return json.dumps({"host": host, "port": port, "namespace": self.namespace,
                           "rank": self.rank, "slots": list(self.slots)}).encode()  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> Admission:
        """Parse and check an admission; ValueError says what is wrong with it."""
        found = json.loads(data.decode())
        if not isinstance(found, dict) or set(found) != {"host", "port", "namespace", "rank",
                                                          "slots"}:  # fmt: skip
            raise ValueError(f"an admission has other fields: {sorted(found)}")
        host, port, namespace = found["host"], found["port"], found["namespace"]
        rank, slots = found["rank"], found["slots"]
        if not (isinstance(host, str) and _whole(port) and 0 < port < 65536
                and isinstance(namespace, str) and isinstance(slots, list)
                and all(_whole(s) and s >= 0 for s in slots) and len(set(slots)) == len(slots)
                and _whole(rank) and 0 <= rank < len(slots)):  # fmt: skip
            raise ValueError(f"an admission does not hold together: {found}")
        return cls((host, port), namespace, rank, len(slots), tuple(slots))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Door:
    """This member's door: a store it serves at ``address``, and what was knocked on it."""

    def __init__(self, address: tuple[str, int], timeout: float = 10.0) -> None:
        self.address = address
        self._store = TCPStore(address[0], address[1], is_server=True, timeout=timeout)

    def knocks(self, slots: Sequence[int]) -> dict[int, int]:
        """The nonce of each of ``slots`` that somebody knocked for here."""
        keys = [f"join/{s}" for s in slots]
        heard = {}
        for slot, key, present in zip(slots, keys, self._store.check(keys), strict=True):
            text = self._store.get(key, 1.0).decode(errors="replace") if present else ""
            if text.isdigit() and 0 < int(text) < _MAX_NONCE:
                heard[slot] = int(text)
            elif present:
                log.warning("door %s: ignored a knock for slot %d: %r", self.address, slot, text)
                self._store.delete(key)
        return heard

    def admit(self, slot: int, nonce: int, admission: Admission) -> None:
        self._store.set(f"admit/{slot}/{nonce}", admission.to_bytes())

    def forget(self, slot: int, nonce: int) -> None:
        """The knock of ``slot`` with ``nonce`` is answered (or failed): forget it here."""
        key = f"join/{slot}"
        if self._store.check([key])[0] and self._store.get(key, 1.0) == str(nonce).encode():
            self._store.delete(key)

    def close(self) -> None:
        self._store.close()


def knock(doors: Sequence[tuple[str, int]], slot: int, deadline: float,
          patience: float = 10.0) -> Admission:  # fmt: skip
    """Knock on every door but ``slot``'s, in turn, until a member lets this process in.

    Raises TimeoutError at ``deadline`` when no door admitted it."""
    if not 0 <= slot < len(doors):
        raise UsageError(f"rank {slot} has no place among the {len(doors)} doors of the job")
    others = [d for s, d in enumerate(doors) if s != slot]
    for warm_up in BEFORE_KNOCK:
        warm_up()
    tried: list[str] = []
    while time.monotonic() < deadline:
        for host, port in others:
            nonce = secrets.randbelow(_MAX_NONCE - 1) + 1
            wait = min(patience, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                return _knock_once(host, port, slot, nonce, wait)
            except (OSError, BrokenError) as exc:  # (TimeoutError, ConnectionError: OSErrors)
                tried.append(f"{host}:{port} ({type(exc).__name__})")
                log.info("slot %d: no admission at %s:%d: %s", slot, host, port, exc)
        time.sleep(0.05)
    raise TimeoutError(f"slot {slot}: no member let this process in; knocked at {tried[-8:]}")


def _knock_once(host: str, port: int, slot: int, nonce: int, wait: float) -> Admission:
    store = TCPStore(host, port, is_server=False, timeout=min(wait, 2.0))
    key = f"join/{slot}"
    try:
        store.set(key, str(nonce).encode())
        try:
            data = store.get(f"admit/{slot}/{nonce}", wait)
        except TimeoutError:
            store.delete(key)  # (this knock goes elsewhere: no member is to admit it here)
            raise
    finally:
        store.close()
    try:
        return Admission.from_bytes(data)
    except ValueError as exc:
        raise ConnectionError(f"the door at {host}:{port} sent a bad admission: {exc}") from exc
