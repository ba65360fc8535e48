"""Sizes and rates: the units every benchmark measures in.

Buffers are float32 (``DTYPE_BYTES``); a size on the command line is bytes with an optional
K/M/G (binary) suffix and must hold whole elements; a size in a report is the largest whole
binary unit (``format_size``). Bus bandwidth is NCCL's: ``bytes * 2 (N-1) / N / time``, the
rate of each rank's link in a ring allreduce, so that numbers of different N compare.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["DTYPE_BYTES", "busbw_gbps", "format_size", "parse_size"]


DTYPE_BYTES = 4  # float32


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1M"``/``"1MiB"`` -> 1048576, ``"512"`` -> 512 (bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 1M, 128M or bytes)")
    nbytes = int(match.group(1)) * _UNITS[match.group(2)]
    if nbytes < DTYPE_BYTES or nbytes % DTYPE_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {DTYPE_BYTES} bytes (float32)"
        )
    return nbytes


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"``; sizes that are not whole KiB/MiB stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def busbw_gbps(nbytes: int, nprocs: int, seconds: float) -> float:
    """Bus bandwidth in GB/s: ``bytes * 2 (N-1) / N / time``."""
    return nbytes * 2 * (nprocs - 1) / nprocs / seconds / 1e9
