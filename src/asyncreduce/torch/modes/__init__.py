"""The modes of ``DataParallel``: when the averaged gradients are waited for and applied.

Theory of operation. A mode is a policy object (base.py) that ``DataParallel`` composes, as
DDP composes a communication hook; the wrapper never branches on the mode's name.

* ``blocking``, ``backward`` (averaged.py): ``p.grad`` is the average when ``backward()``
  returns; ``blocking`` overlaps nothing, ``backward`` overlaps the rest of backward.
* ``forward`` (forward.py): each layer's update is applied in its forward pre-hook, so
  communication overlaps the rest of backward and the next forward.
* ``double_buffer`` (double_buffer.py): each step applies the previous step's gradients.

``mode_for(name)`` makes a fresh mode (one per wrapper: a mode may remember what it saw).
"""

from __future__ import annotations

from .averaged import Backward, Blocking
from .base import Mode
from .double_buffer import DoubleBuffer
from .forward import Forward

__all__ = ["MODES", "Mode", "mode_for"]

_BY_NAME: dict[str, type[Mode]] = {m.name: m for m in (Blocking, Backward, Forward, DoubleBuffer)}
MODES = tuple(_BY_NAME)  # ("blocking", "backward", "forward", "double_buffer")


def mode_for(name: str) -> Mode:
    """A new mode of this name (one of ``MODES``; checked by the caller)."""
    return _BY_NAME[name]()
