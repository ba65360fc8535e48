"""Suite-wide guards: a test that leaks one of our threads or a socket fails."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # helpers (spmd) import by name


def _our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("asyncreduce")}


def _sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(f"{fd}->{target}")
    return found


@pytest.fixture(autouse=True)
def no_leaked_threads_or_sockets() -> Iterator[None]:
    threads_before, sockets_before = _our_threads(), _sockets()
    yield
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        leaked_threads = _our_threads() - threads_before
        leaked_sockets = _sockets() - sockets_before
        if not leaked_threads and not leaked_sockets:
            return
        time.sleep(0.02)
    assert not leaked_threads, f"the test left threads running: {sorted(leaked_threads)}"
    assert not leaked_sockets, f"the test left sockets open: {sorted(leaked_sockets)}"
