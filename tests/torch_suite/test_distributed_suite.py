"""PyTorch's own backend-agnostic test suite (``torch.testing._internal.distributed.
distributed_test``), run the way PyTorch's ``test/distributed/test_distributed_spawn.py`` runs
it, for the asyncreduce backend or for Gloo beside it.

Not collected by the normal test run: ``scripts/torch_suite.py`` sets BACKEND, WORLD_SIZE and
TEMP_DIR and runs it (see docs/launchers.md). The spawned ranks import this module again, so
the backend is registered there too, and asyncreduce is named a plugin backend with DDP and
subgroup support (``DistTestCases.backend_feature``), as a third-party backend must be.
"""

from __future__ import annotations

import os

import pytest

if "BACKEND" not in os.environ or "TEMP_DIR" not in os.environ:
    pytest.skip("run by scripts/torch_suite.py", allow_module_level=True)

import torch  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import asyncreduce.torch  # noqa: E402,F401  (registers the "asyncreduce" backend)

for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("asyncreduce")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
