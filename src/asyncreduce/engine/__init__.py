"""The progress engine of the native backend: the one thread that owns the wire and feeds the
protocol (core.py, with its theory of operation), the session's commands carried out and the
transport's events handed in (sink.py), and who holds the loop at any moment (ownership.py)."""

from .core import THREAD_PREFIX, Engine

__all__ = ["THREAD_PREFIX", "Engine"]
