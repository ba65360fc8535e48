"""How ranks find each other: a small key-value store shared by every rank of a job.

Theory of operation
-------------------
Before any connection between ranks exists, each rank must learn where the others listen.
Rank 0 serves a :class:`TCPStore`; every rank (rank 0 included) holds one client connection
to it. :func:`gather` is the only collective built on the store: each rank publishes a value
under ``prefix/rank`` and waits for everyone else's. A :class:`FileStore` offers the same
through a directory that every rank sees, for jobs that cannot open a port on rank 0.

The package has Gloo's shape, one concept per module:

    store.py       the Store interface, PrefixStore, and the argument checks every store shares
    wire.py        the TCP store's greetings and frames
    server.py      the server thread (its listener is transport/listener.py, shared with the mesh)
    client.py      the pooled, thread-safe client
    tcp_store.py   TCPStore: a server (on rank 0) plus a client
    file_store.py  FileStore
    gather.py      gather, and how a timeout names the missing ranks
    config.py      store_from_env_or_args: init_method URLs, MASTER_ADDR/MASTER_PORT
"""

from __future__ import annotations

from .config import store_from_env_or_args
from .file_store import FileStore
from .gather import _describe_ranks as _describe_ranks  # for the tests
from .gather import gather
from .server import _MAX_PENDING as _MAX_PENDING  # for the tests
from .store import MAX_KEY_BYTES, MAX_VALUE_BYTES, PrefixStore, Store
from .tcp_store import TCPStore
from .wire import _CONTEXT as _CONTEXT  # for the tests
from .wire import _MAX_FRAME as _MAX_FRAME  # for the tests

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "FileStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "gather",
    "store_from_env_or_args",
]
