"""PyTorch adapters: the overlapping data-parallel wrapper, and allreduce of any tensor.

import asyncreduce.torch as art
model = art.DataParallel(module, comm, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         mode="forward")
art.iallreduce(comm, cuda_tensor, name="x").wait()    # CPU: no copy; CUDA: staged
dist.init_process_group("asyncreduce")                 # registered on import: DDP, dist.*
"""

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as _missing:  # pragma: no cover - exercised in a torch-less venv
    if _missing.name != "torch":
        raise
    raise ModuleNotFoundError(
        "asyncreduce.torch needs PyTorch, which is not installed: pip install 'asyncreduce[torch]'",
        name="torch",
    ) from None

from .backend import communicator, register
from .data_parallel import MODES, DataParallel
from .elastic import Elastic, ElasticSampler
from .optimizer import DataParallelOptimizer
from .staging import iallreduce

register()  # dist.init_process_group("asyncreduce")

__all__ = [
    "DataParallel", "DataParallelOptimizer", "Elastic", "ElasticSampler", "MODES", "communicator",
    "iallreduce",
]  # fmt: skip
