"""PyTorch adapters: the overlapping data-parallel wrapper, and allreduce of any tensor.

import asyncreduce.torch as art
model = art.DataParallel(module, comm, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         mode="forward")
art.iallreduce(comm, cuda_tensor, name="x").wait()    # CPU: no copy; CUDA: staged
"""

from .data_parallel import MODES, DataParallel
from .staging import iallreduce

__all__ = ["DataParallel", "MODES", "iallreduce"]
