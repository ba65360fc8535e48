"""PyTorch adapters: the overlapping data-parallel wrapper.

import asyncreduce.torch as art
model = art.DataParallel(module, comm, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         mode="forward")
"""

from .data_parallel import MODES, DataParallel

__all__ = ["DataParallel", "MODES"]
