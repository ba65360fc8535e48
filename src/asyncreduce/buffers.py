"""Turning what the caller passed (numpy array, torch tensor, buffer) into a flat numpy view.

The collective works on a flat, contiguous numpy array over the caller's own memory (no copy
for in-place operations), and the result goes back as the caller's type: the same object when
the operation is in place, a new object of the same kind otherwise. PyTorch is imported only
if the caller passed a tensor. bfloat16 tensors travel as their 16-bit patterns. A tensor
handed over in place has its version counter bumped, as a torch in-place op would, so autograd
refuses a backward that saved it before the collective overwrote it.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .algorithms import DTYPES, Array, DType
from .errors import UsageError

__all__ = ["Buffer", "as_buffer", "device_buffer", "elements", "numpy_dtype"]

_SUPPORTED = ", ".join(DTYPES)


@dataclass
class Buffer:
    """A caller's data as a flat numpy view, and how to hand a numpy result back."""

    original: Any
    flat: Array
    shape: tuple[int, ...]
    dtype: DType
    like: Callable[[Array], Any]  # a numpy array (same dtype) -> the caller's type


def _same(a: Array) -> Any:
    """A numpy array's ``like``: the result is the array itself."""
    return a


def as_buffer(x: Any, what: str, *, inplace: bool = True, copy: bool = True) -> Buffer:
    """View ``x`` as a flat array the operation writes (``inplace``), or a copy of it
    (``inplace=False``), or, with ``copy=False`` too, a view the operation only reads."""
    if not inplace and not copy:
        return _read_only(x, what)
    if isinstance(x, np.ndarray):
        return _numpy(x, what, inplace)
    if type(x).__module__.startswith("torch") and hasattr(x, "data_ptr"):
        return _torch(x, what, inplace)
    try:
        view = memoryview(x)
    except TypeError:
        raise UsageError(
            f"{what} must be a numpy array, a torch tensor or a buffer (bytearray, "
            f"array.array, ...); got {type(x).__name__}"
        ) from None
    return _buffer(x, view, what, inplace)


def device_buffer(x: Any, what: str) -> Buffer | None:
    """A torch tensor on a device (CUDA) as it is, for an engine that takes device memory
    (backend="torch"); None for anything else. ``flat`` is then a flat tensor, not numpy."""
    if not (type(x).__module__.startswith("torch") and hasattr(x, "device")):
        return None
    if x.device.type == "cpu":
        return None
    import torch

    if not x.is_contiguous():
        raise UsageError(f"{what} is not contiguous; pass {what}.contiguous() instead")
    dtype = DTYPES.get(str(x.dtype).removeprefix("torch."))
    if dtype is None:
        raise UsageError(f"{what} has dtype {x.dtype}; supported: {_SUPPORTED}")
    torch.autograd.graph.increment_version(x)
    return Buffer(x, x.detach().view(-1), tuple(x.shape), dtype, _same)


def elements(flat: Any) -> int:
    """How many elements a ``Buffer.flat`` holds: a numpy array's ``size``, or a device
    tensor's ``numel()`` (a tensor's ``size`` is a method, not a number)."""
    return flat.size if isinstance(flat, np.ndarray) else int(flat.numel())


def _read_only(x: Any, what: str) -> Buffer:
    """A view of ``x`` for an operation that only reads it (no copy, no version bump)."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise UsageError(f"{what} is not contiguous; pass np.ascontiguousarray({what})")
        return Buffer(x, x.reshape(-1), x.shape, _dtype_of(x.dtype, what), _same)
    if type(x).__module__.startswith("torch") and hasattr(x, "data_ptr"):
        found = _torch(x.detach(), what, inplace=True, bump=False)
        return Buffer(x, found.flat, found.shape, found.dtype, found.like)
    return as_buffer(x, what, inplace=False)  # other buffers: a copy is cheap and safe


def numpy_dtype(np_dtype: np.dtype[Any]) -> DType | None:
    """The element type of a numpy dtype, None if it is not one we take."""
    return _BY_NUMPY.get(np_dtype)


def _dtype_of(np_dtype: np.dtype[Any], what: str) -> DType:
    found = _BY_NUMPY.get(np_dtype)  # a dict hit: numpy's dtype.name costs ~10 us a call
    if found is None:
        raise UsageError(
            f"{what} has dtype {np_dtype}; supported: {_SUPPORTED} (bfloat16 as torch)"
        )
    return found


#: Native-order numpy dtypes of the supported types (bfloat16 has none: torch only).
_BY_NUMPY: dict[np.dtype[Any], DType] = {
    d.storage: d for d in DTYPES.values() if d.name != "bfloat16"
}


def _numpy(x: Array, what: str, inplace: bool) -> Buffer:
    dtype = _dtype_of(x.dtype, what)
    flags = x.flags  # (a new object at every look)
    if not flags.c_contiguous:
        raise UsageError(f"{what} is not contiguous; pass np.ascontiguousarray({what}) instead")
    if inplace and not flags.writeable:
        raise UsageError(f"{what} is read-only; pass a writable array or inplace=False")
    data = x if inplace else x.copy()
    return Buffer(data, data.reshape(-1), x.shape, dtype, _same)


def _torch(t: Any, what: str, inplace: bool, bump: bool = True) -> Buffer:
    import torch

    if t.device.type != "cpu":
        raise UsageError(f"{what} is on {t.device}; this release takes CPU tensors (use .cpu())")
    if not t.is_contiguous():
        raise UsageError(f"{what} is not contiguous; pass {what}.contiguous() instead")
    data = t.detach() if inplace else t.detach().clone()
    original = t if inplace else data
    if inplace and bump:
        torch.autograd.graph.increment_version(t)
    if data.dtype == torch.bfloat16:
        flat = data.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        return Buffer(original, flat, tuple(t.shape), DTYPES["bfloat16"], _bf16_tensor)
    try:
        array_view = data.numpy()
    except TypeError as exc:
        raise UsageError(f"{what} has dtype {t.dtype}; supported: {_SUPPORTED}") from exc
    dtype = _dtype_of(array_view.dtype, what)
    return Buffer(original, array_view.reshape(-1), tuple(t.shape), dtype, torch.from_numpy)


def _bf16_tensor(a: Array) -> Any:
    import torch

    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def _buffer(x: Any, view: memoryview, what: str, inplace: bool) -> Buffer:
    if not view.c_contiguous:
        raise UsageError(f"{what} is a non-contiguous buffer; copy it into a contiguous one")
    if inplace and view.readonly:
        raise UsageError(
            f"{what} is read-only ({type(x).__name__}); pass a writable buffer or inplace=False"
        )
    arr = np.asarray(view)
    dtype = _dtype_of(arr.dtype, what)
    if inplace:
        data: Any = x
    elif isinstance(x, bytes | bytearray):
        data = type(x)(arr.tobytes()) if isinstance(x, bytearray) else bytearray(x)
    elif isinstance(x, array.array):
        data = array.array(x.typecode, x)
    else:
        data = arr.copy()
    flat = (
        np.asarray(memoryview(data)).reshape(-1)
        if not isinstance(data, np.ndarray)
        else data.reshape(-1)
    )
    return Buffer(data, flat, arr.shape, dtype, _same)
