"""The scaling benchmark's fixed terms, shared by its parent, its workers and its report.

What is compared (``METHODS`` on ``MODELS``), where the ranks meet (rank 0's ports: the
emulated hosts are private), and the link's arithmetic: a ring allreduce moves
``2 (K-1) / K`` times the gradient bytes over each host's link, at best at ``TCP_SHARE`` of
the tbf rate, and ``compute_for`` picks the emulated compute that makes the blocking allreduce
at ``REFERENCE_HOSTS`` hosts ``--ratio`` of it. This module imports neither torch nor the
cluster: ``scaling_models`` (torch) is imported where ResNet-50's size is needed.
"""

from __future__ import annotations

__all__ = [
    "ASYNCREDUCE_PORT",
    "CNN_ITERATIONS",
    "DEFAULT_RATIO",
    "GLOO_PORT",
    "METHODS",
    "MODELS",
    "MODES",
    "REFERENCE_HOSTS",
    "TCP_SHARE",
    "compute_for",
    "ideal_comm_s",
    "resnet50_bytes",
    "ring_bytes",
]

MODES = ("blocking", "backward", "forward", "double_buffer")  # asyncreduce.torch.DataParallel
METHODS = (*MODES, "ddp", "local")
MODELS = ("resnet50", "cnn")
REFERENCE_HOSTS = 4  # where blocking communication is --ratio of compute, as in the issue
DEFAULT_RATIO = 0.5  # the seed: 66.7% = 1 / (1 + 0.5)
TCP_SHARE = 0.95  # TCP payload over the tbf rate at MTU 1500 (docs/cluster.md)
CNN_ITERATIONS = 3  # the cnn's iterations are ~10x shorter: this many times --iterations
ASYNCREDUCE_PORT, GLOO_PORT = 29500, 29600  # rank 0's stores (the hosts are private)


def resnet50_bytes() -> int:
    """float32 bytes of ResNet-50's gradients: what one allreduce of model A carries."""
    import scaling_models

    return 4 * sum(layer.params for layer in scaling_models.resnet50_layers())


def ring_bytes(nbytes: int, hosts: int) -> float:
    """Bytes a ring allreduce sends (and receives) over each host's link: 2 (K-1)/K x size."""
    return 2 * (hosts - 1) / hosts * nbytes


def ideal_comm_s(nbytes: int, hosts: int, rate_bps: float) -> float:
    """Seconds of a ring allreduce of ``nbytes`` at the TCP payload ceiling of the link."""
    return ring_bytes(nbytes, hosts) * 8 / (TCP_SHARE * rate_bps)


def compute_for(rate_bps: float, ratio: float) -> float:
    """Model A's compute per iteration: blocking comm at K = 4 is ``ratio`` of it."""
    return ideal_comm_s(resnet50_bytes(), REFERENCE_HOSTS, rate_bps) / ratio
