"""The progress engine of the native backend, one concept per file:

- core.py: ``Engine``, the one thread that owns the wire and feeds the protocol (its theory of
  operation): the entry queue, the loop's turns, progress in the call, closing;
- ownership.py: who runs the loop at any moment, the engine thread or a waiting thread, with
  its safety argument;
- direct.py: a blocking small allreduce or barrier run to the end on its caller's thread;
- sink.py: the transport's events into the Session, the Session's commands carried out;
- lanes.py: the engine thread's part in the same-host lane.
"""

from .core import THREAD_PREFIX, Engine

__all__ = ["THREAD_PREFIX", "Engine"]
