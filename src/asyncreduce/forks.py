"""Knowing whether this process is a fork child of the one that made an object.

A communicator's progress thread and connections belong to the process that made it: after
``fork()`` the child has copies of the sockets but no thread to drive them, so a collective
there would never progress and its goodbye would cut the parent's connections. Objects record
``generation()`` when made and compare it later; the count moves in every fork child.
"""

from __future__ import annotations

import os

__all__ = ["generation"]

_generation = 0


def generation() -> int:
    """How many forks this process is away from its ancestor that first imported us."""
    return _generation


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)
