"""Which store a job uses: ``init_method`` URLs, or MASTER_ADDR/MASTER_PORT.

Theory of operation. ``init_method`` wins ('tcp://HOST:PORT': rank 0 serves a TCPStore there;
'file:///PATH': a FileStore); else master_addr/master_port, each read from the environment
when not given. Missing or malformed information is a UsageError that says what to set.
"""

from __future__ import annotations

import os
import urllib.parse

from ..errors import UsageError
from ..launchers import _port_or_none
from .file_store import FileStore
from .store import Store, _check_rank, _check_timeout
from .tcp_store import TCPStore

__all__ = ["store_from_env_or_args"]


def store_from_env_or_args(
    rank: int,
    world_size: int,
    master_addr: str | None,
    master_port: int | None,
    init_method: str | None,
    timeout: float,
) -> Store:
    """The store of this job: ``init_method`` wins, else master_addr/master_port (rank 0 serves).

    ``init_method`` is 'tcp://HOST:PORT' or 'file:///PATH'.

    A ``master_addr`` or ``master_port`` left as None is read from the environment variables
    ``MASTER_ADDR`` and ``MASTER_PORT``. Missing information -> UsageError saying which
    variables to set. Rank 0 serves the store on exactly the address it is given.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    if init_method is not None:
        return _store_from_url(init_method, rank, timeout)
    addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR") or None
    port = master_port if master_port is not None else _port_or_none(os.environ)
    missing = [name for name, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
    if addr is None or port is None:
        raise UsageError(
            f"rendezvous needs to know where rank 0 serves the store: set {' and '.join(missing)} "
            "(or pass master_addr= and master_port=, or init_method='tcp://HOST:PORT' "
            "or 'file:///PATH')"
        )
    return TCPStore(addr, port, is_server=rank == 0, timeout=timeout)


def _store_from_url(init_method: str, rank: int, timeout: float) -> Store:
    forms = (
        "the accepted forms are 'tcp://HOST:PORT' (rank 0 serves the store) and "
        "'file:///ABSOLUTE/PATH' (a directory every rank sees)"
    )
    parts = urllib.parse.urlsplit(init_method)
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise UsageError(f"init_method {init_method!r} needs a host and a port; {forms}")
        return TCPStore(parts.hostname, port, is_server=rank == 0, timeout=timeout)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise UsageError(f"init_method {init_method!r} is not an absolute file URL; {forms}")
        return FileStore(urllib.parse.unquote(parts.path), timeout=timeout)
    raise UsageError(f"init_method {init_method!r} is not understood; {forms}")
