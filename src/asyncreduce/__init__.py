"""asyncreduce: asynchronous, thread-safe collectives (allreduce first) for data-parallel training.

import asyncreduce as ar
with ar.init() as comm:                # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    req = comm.iallreduce(x, op="sum", name="grad")
    ...                                # compute while it runs
    req.wait()                         # x now holds the sum over all ranks
"""

from .bootstrap import init
from .comm import Communicator
from .errors import (
    AsyncReduceError,
    AuthenticationError,
    BrokenError,
    ClosedError,
    MismatchError,
    UsageError,
)
from .request import Request, wait_all, wait_any
from .survivors import shrink

__all__ = [
    "AsyncReduceError",
    "AuthenticationError",
    "BrokenError",
    "ClosedError",
    "Communicator",
    "MismatchError",
    "Request",
    "UsageError",
    "init",
    "shrink",
    "wait_all",
    "wait_any",
]

__version__ = "0.1.0"
