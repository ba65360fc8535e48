"""The same-host lane: small allreduces and barriers through the shared-memory mailboxes of
samehost/, moved by the thread that waits for them. ``core.py`` keeps the lane and its unnamed
operations (a slot per sequence number); ``named.py`` its named ones (found by key)."""

from .core import Lane, LaneOp, lane_wanted

__all__ = ["Lane", "LaneOp", "lane_wanted"]
