"""Uneven inputs: ranks that run out of data early shadow the others, as under DDP's Join.

Theory of operation. Inside ``with model.join():`` every forward of a rank that still trains
begins with a small allreduce (named ``.join``) of one code per rank: "training", and whether
this forward broadcasts the buffers and whether its backward will be synced. A rank whose loop
has ended leaves the ``with`` block and enters the same allreduces with 0 until every rank has:

* each round tells every rank which ranks still train; the highest of them is the
  authoritative copy of the buffers (DDP picks the same one, since rank 0 may have finished);
* a finished rank mirrors what that round's forward and backward post: the buffer broadcast
  if the others broadcast, and one zero-gradient post per bucket if their backward is synced,
  so every rank posts the same operations and nobody hangs; its zeros (flag 0) change no
  average, and averages still divide by the whole world size (DDP's
  ``divide_by_initial_world_size=True``);
* once a round finds nobody training, every rank applies what it has pending and takes the
  parameters (and buffers) of the highest of the ranks that trained longest, as DDP's
  ``_sync_final_model`` does.

As with DDP's Join, each iteration is one forward and at most one synced backward.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from torch import nn

from ..comm import Communicator
from .replicas import BufferSync, broadcast_tensors

__all__ = ["Joining", "Joiner"]


class Joiner(Protocol):
    """All the join state uses of the wrapper it belongs to (DataParallel is one): a protocol,
    so this module never imports the wrapper that holds it."""

    module: nn.Module
    _comm: Communicator
    _prefix: str  # the wrapper's operation names start with it
    _buffer_sync: BufferSync

    def synchronize(self) -> None:
        """Apply every pending update."""
        ...

    def _shadow_backward(self) -> None:
        """Take part in a synced backward pass with zero gradients (this rank's data ended)."""
        ...


_TRAINING, _BUFFERS, _SYNCED = 1, 2, 4


class Joining:
    """The join state of one wrapper (see the module docstring)."""

    def __init__(self, wrapper: Joiner) -> None:
        self._wrapper = wrapper
        self.active = False
        self._last: list[int] = []  # the ranks still training in the last round with any

    def notify(self, buffers_due: bool, synced: bool) -> int:
        """A forward of a rank that still trains: its round; returns the rank whose buffers
        count this forward."""
        code = _TRAINING | (_BUFFERS if buffers_due else 0) | (_SYNCED if synced else 0)
        return max(self._round(code))

    def shadow_until_all_joined(self) -> None:
        """This rank's data ended: mirror the others' rounds, then take the final model."""
        wrapper = self._wrapper
        while True:
            states = self._states(0)
            active = [r for r, state in enumerate(states) if state]
            if not active:
                break
            if any(states[r] & _BUFFERS for r in active) and wrapper._buffer_sync.enabled:
                wrapper._buffer_sync.broadcast(max(active))
            if any(states[r] & _SYNCED for r in active):
                wrapper._shadow_backward()
        self._take_final_model()

    def _take_final_model(self) -> None:
        wrapper = self._wrapper
        wrapper.synchronize()
        root = max(self._last) if self._last else wrapper._comm.world_size - 1
        params = list(wrapper.module.parameters())
        broadcast_tensors(wrapper._comm, params, f"{wrapper._prefix}.final", root)
        if wrapper._buffer_sync.enabled:
            buffers = wrapper._buffer_sync.buffers()
            broadcast_tensors(wrapper._comm, buffers, f"{wrapper._prefix}.final-buffers", root)

    def _round(self, code: int) -> list[int]:
        """The ranks still training this round (this rank's ``code`` counted)."""
        return [r for r, state in enumerate(self._states(code)) if state]

    def _states(self, code: int) -> list[int]:
        comm = self._wrapper._comm
        states = np.zeros(comm.world_size, np.int64)
        states[comm.rank] = code
        comm.allreduce(states, name=f"{self._wrapper._prefix}.join")
        found: list[int] = [int(state) for state in states]
        if any(found):
            self._last = [r for r, state in enumerate(found) if state]
        return found
