"""FileStore: the store as a directory every rank sees, for jobs that cannot open a port.

Theory of operation. One file per key, written to a temporary name and renamed into place,
so a reader sees a whole value or none. Writers hold an ``flock`` on ``<path>/.lock``; readers
poll with short sleeps until their deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence

from ..errors import ClosedError, UsageError
from .store import Store, _check_amount, _check_timeout, _counter_plus, _key_bytes, _value_bytes

__all__ = ["FileStore"]


def _file_name(key: str) -> str:
    """A safe, unique file name for ``key`` (readable where the key allows it)."""
    raw = _key_bytes(key)
    name = "k_" + urllib.parse.quote(key, safe="")
    return name if len(name) <= 200 else "h_" + hashlib.sha256(raw).hexdigest()


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _write_atomically(directory: str, path: str, data: bytes) -> None:
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class FileStore(Store):
    """A store in a directory that every rank sees (one file per key, written atomically).

    Use a fresh directory per job: keys left by an earlier job would be read as this job's.
    ``set``, ``add`` and ``delete`` hold an ``flock`` on ``<path>/.lock``, so they are atomic
    across processes; ``get`` polls with short sleeps until its deadline.
    """

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        _check_timeout(timeout)
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot use {path!r} as a file store: {exc}") from exc
        self._timeout = timeout
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        path, data = self._file(key), _value_bytes(value)
        with self._locked():
            _write_atomically(self.path, path, data)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self._timeout if timeout is None else timeout
        _check_timeout(wait)
        path = self._file(key)
        deadline = time.monotonic() + wait
        delay = 0.001
        while (data := _read_file(path)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"store get {key!r}: key not set within {wait:g} s (file store {self.path})"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        return data

    def add(self, key: str, amount: int) -> int:
        _check_amount(amount)
        path = self._file(key)
        with self._locked():
            current = _read_file(path)
            total = _counter_plus(repr(key), b"0" if current is None else current, amount)
            _write_atomically(self.path, path, str(total).encode("ascii"))
        return total

    def check(self, keys: Sequence[str]) -> list[bool]:
        paths = [self._file(key) for key in keys]
        return [os.path.exists(path) for path in paths]

    def delete(self, key: str) -> None:
        path = self._file(key)
        with self._locked(), contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        self._closed = True

    def _file(self, key: str) -> str:
        if self._closed:
            raise ClosedError("the store was closed")
        return os.path.join(self.path, _file_name(key))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # A fresh descriptor per call: flock excludes other descriptors, threads included.
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
