"""Element types and reductions, applied in place with numpy.

Every reduction is commutative in value; in bits only if both ranks combine two operands in
the same order (see ``combine``), which the algorithms do, so every rank ends bitwise equal.
``avg`` is a sum on the wire, divided by the world size once at the end.

bfloat16 (torch only) travels as its raw 16-bit pattern; it is widened to float32 to combine
and rounded back to nearest-even, which is what PyTorch does on the CPU. bool combines as
torch does: sum and max are "or", prod and min are "and". ``band``, ``bor`` and ``bxor`` take
integers and bool; ``max`` and ``min`` no complex numbers (``reduction_refused`` says why).

Overflow wraps (integers) or saturates to inf (floats) as in MPI; the progress thread turns
numpy's floating-point warnings off for itself, so nothing here pays for an errstate. A
caller's thread (the same-host lane's waiter) uses ``fold_quietly``, which turns them off for
the call alone.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

try:  # numpy 2: errstate is this context variable; setting it directly costs a third of one
    from numpy._core import umath as _umath

    _ERRSTATE: ContextVar[Any] | None = _umath._extobj_contextvar
    _QUIET: Any = _umath._make_extobj(all="ignore")
except (ImportError, AttributeError):  # numpy 1: np.errstate
    _ERRSTATE = None

Result = TypeVar("Result")

__all__ = [
    "DType",
    "DTYPES",
    "DTYPE_BY_CODE",
    "REDUCIBLE",
    "REDUCTIONS",
    "REDUCTION_CODES",
    "combine",
    "finalize",
    "fold",
    "fold_quietly",
    "quiet_numpy",
    "reduction_refused",
]


@dataclass(frozen=True)
class DType:
    """An element type: its wire code, name, and the numpy dtype its bytes are stored as."""

    code: int
    name: str
    storage: np.dtype[np.generic]

    @property
    def itemsize(self) -> int:
        return int(self.storage.itemsize)

    @property
    def is_float(self) -> bool:
        return self.name in ("float16", "float32", "float64", "bfloat16")

    @property
    def is_complex(self) -> bool:
        return self.name in ("complex64", "complex128")

    @property
    def is_integral(self) -> bool:
        """Integers and bool: the types the bitwise reductions take."""
        return not (self.is_float or self.is_complex)


DTYPES: Final[dict[str, DType]] = {
    d.name: d
    for d in (
        DType(1, "float16", np.dtype(np.float16)),
        DType(2, "float32", np.dtype(np.float32)),
        DType(3, "float64", np.dtype(np.float64)),
        DType(4, "int32", np.dtype(np.int32)),
        DType(5, "int64", np.dtype(np.int64)),
        DType(6, "uint8", np.dtype(np.uint8)),
        DType(7, "bfloat16", np.dtype(np.uint16)),
        DType(8, "int8", np.dtype(np.int8)),
        DType(9, "bool", np.dtype(np.bool_)),
        DType(10, "complex64", np.dtype(np.complex64)),
        DType(11, "complex128", np.dtype(np.complex128)),
        DType(12, "int16", np.dtype(np.int16)),
    )
}
DTYPE_BY_CODE: Final[dict[int, DType]] = {d.code: d for d in DTYPES.values()}

REDUCTIONS: Final[tuple[str, ...]] = ("sum", "avg", "max", "min", "prod", "band", "bor", "bxor")
REDUCTION_CODES: Final[dict[str, int]] = {name: i + 1 for i, name in enumerate(REDUCTIONS)}

_UFUNCS: Final[dict[str, np.ufunc]] = {
    "sum": np.add,
    "avg": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
_BOOL_UFUNCS: Final[dict[str, np.ufunc]] = {  # torch's meaning for bool tensors
    "sum": np.logical_or,
    "max": np.logical_or,
    "prod": np.logical_and,
    "min": np.logical_and,
    "band": np.logical_and,
    "bor": np.logical_or,
    "bxor": np.logical_xor,
}


def reduction_refused(dtype: DType, op: str) -> str | None:
    """Why ``op`` cannot reduce ``dtype`` (None: it can), for the caller's UsageError."""
    if op not in REDUCTIONS:
        return f"op={op!r} is not a reduction; use one of {', '.join(REDUCTIONS)}"
    if op == "avg" and dtype.is_integral:
        return (f"op='avg' needs a floating or complex dtype, x is {dtype.name}; use 'sum' "
                "and divide")  # fmt: skip
    if op in ("band", "bor", "bxor") and not dtype.is_integral:
        return f"op={op!r} needs integers or bool, x is {dtype.name}"
    if op in ("max", "min") and dtype.is_complex:
        return f"op={op!r} needs real numbers, x is {dtype.name} (complex numbers have no order)"
    return None


#: Every (dtype code, op) that ``reduction_refused`` allows: one set look per post.
REDUCIBLE: Final[frozenset[tuple[int, str]]] = frozenset(
    (d.code, op) for d in DTYPES.values() for op in REDUCTIONS if reduction_refused(d, op) is None
)


def _bf16_to_f32(bits: NDArray[np.uint16]) -> NDArray[np.float32]:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: NDArray[np.float32], out: NDArray[np.uint16]) -> None:
    """Round float32 to bfloat16 to nearest-even (NaN stays a quiet NaN) into ``out``."""
    bits = values.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    out[...] = rounded


def combine(
    dtype: DType,
    op: str,
    acc: NDArray[np.generic],
    incoming: NDArray[np.generic],
    incoming_first: bool = False,
) -> None:
    """acc = acc (op) incoming, in place; ``incoming (op) acc`` if ``incoming_first``.

    The operations are commutative in value but not always in bits (max(-0.0, +0.0), which NaN
    payload a sum keeps), so an algorithm in which two ranks combine the same two operands
    must give them in the same order on both, e.g. lower rank first.
    """
    ufunc = _BOOL_UFUNCS[op] if dtype.name == "bool" else _UFUNCS[op]
    first, second = (incoming, acc) if incoming_first else (acc, incoming)
    if dtype.name == "bfloat16":
        widened = ufunc(_bf16_to_f32(first), _bf16_to_f32(second))  # type: ignore[arg-type]
        _f32_to_bf16(widened, acc)  # type: ignore[arg-type]
    else:
        ufunc(first, second, out=acc)


def fold(dtype: DType, op: str, parts: list[NDArray[np.generic]], out: NDArray[np.generic]) -> None:
    """out = parts[0] (op) parts[1] (op) ..., left to right, so every rank that folds the same
    parts in the same order gets the same bits; ``parts`` are raw bytes of ``dtype``'s storage
    (``out`` may be any of them only if it is the first)."""
    kind = out.dtype
    if dtype.name in ("bool", "bfloat16"):
        np.copyto(out, parts[0].view(kind))
        for part in parts[1:]:
            combine(dtype, op, out, part.view(kind))
        return
    ufunc = _UFUNCS[op]
    ufunc(parts[0].view(kind), parts[1].view(kind), out=out)
    for part in parts[2:]:
        ufunc(out, part.view(kind), out=out)


def fold_quietly(
    dtype: DType, op: str, parts: list[NDArray[np.generic]], out: NDArray[np.generic],
    world_size: int,
) -> None:  # fmt: skip
    """``fold`` then ``finalize``, with numpy's floating-point warnings off for the call only
    (a caller's thread: overflow is the data's, as on the progress thread, and the caller's
    own warning settings stay as they were)."""
    if _ERRSTATE is None:
        with np.errstate(all="ignore"):
            fold(dtype, op, parts, out)
            finalize(dtype, op, out, world_size)
        return
    token = _ERRSTATE.set(_QUIET)
    try:
        fold(dtype, op, parts, out)
        finalize(dtype, op, out, world_size)
    finally:
        _ERRSTATE.reset(token)


def quiet_numpy(call: Callable[..., Result], *args: Any) -> Result:
    """``call(*args)`` with numpy's floating-point warnings off for it alone (a caller's thread
    that runs the engine's loop, which reduces as the progress thread does)."""
    if _ERRSTATE is None:
        with np.errstate(all="ignore"):
            return call(*args)
    token = _ERRSTATE.set(_QUIET)
    try:
        return call(*args)
    finally:
        _ERRSTATE.reset(token)


def finalize(dtype: DType, op: str, values: NDArray[np.generic], world_size: int) -> None:
    """Apply what an operation does once after combining: ``avg`` divides by the world size
    (integers: exactly, rounding toward zero; the communicator accepts ``avg`` for floats only)."""
    if op != "avg" or world_size == 1:
        return
    if dtype.is_integral:  # exact integer division, rounding toward zero as C does
        ints: NDArray[Any] = values
        inexact = np.remainder(ints, world_size) != 0
        np.floor_divide(ints, world_size, out=ints)
        ints += (inexact & (ints < 0)).astype(ints.dtype)
    elif dtype.name == "bfloat16":
        _f32_to_bf16(_bf16_to_f32(values) / np.float32(world_size), values)  # type: ignore[arg-type]
    elif dtype.is_complex:  # each part by the real n: rounded once, unlike a complex division
        parts = values.view(np.float32 if dtype.name == "complex64" else np.float64)
        np.divide(parts, world_size, out=parts, casting="unsafe")
    else:
        np.divide(values, world_size, out=values, casting="unsafe")
