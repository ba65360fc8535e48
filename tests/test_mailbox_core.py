"""The C mailbox (samehost/_mailbox_core.pyx, mailbox.NativeMailbox) against the Python one.

Both mailboxes over the same regions must be interchangeable: what one publishes the other
reads, and their folds give the same bits for every element type and reduction the
communicator takes, with NaN, infinities, overflowing integers and every world size the lane
meets; what C does not fold (bool, float16, bfloat16, complex) goes to numpy. The C wait
gives up the GIL (another thread publishes meanwhile) and gives up after its time. A released
mailbox refuses every call but a wait. Where a C compiler is, the set-up command must have built it.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

import numpy as np
import pytest

from asyncreduce.algorithms import KINDS, REDUCTION_CODES
from asyncreduce.kernels.reduction import DTYPES, reduction_refused
from asyncreduce.samehost.mailbox import (
    AGREED,
    DIFFERENT,
    HERE,
    SLOTS,
    WAITING,
    Core,
    Mailbox,
    NativeMailbox,
    header,
    region_bytes,
)
from asyncreduce.transport.frame import Descriptor

BUILT = pytest.mark.skipif(Core is None, reason="asyncreduce.samehost._mailbox_core not built")

FOLDED = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8")
NOT_FOLDED = ("bool", "float16", "bfloat16", "complex64", "complex128")


def regions(n: int) -> list[np.ndarray[Any, Any]]:
    return [np.zeros(region_bytes(), np.uint8) for _ in range(n)]


def mailboxes(kind: type[Mailbox], raw: list[np.ndarray[Any, Any]]) -> list[Mailbox]:
    n = len(raw)
    return [kind(r, raw[r], {p: raw[p] for p in range(n) if p != r}) for r in range(n)]


def values(dtype: str, count: int, rank: int) -> np.ndarray[Any, Any]:
    """Awkward contributions: NaN, infinities, signed values, integers near their limits."""
    rng = np.random.default_rng([count, rank, len(dtype)])
    if dtype == "bool":
        return rng.random(count) < 0.5
    if dtype == "bfloat16":
        return rng.integers(0, 1 << 16, count, dtype=np.uint16)
    kind = np.dtype(dtype)
    if kind.kind in "iu":
        info = np.iinfo(kind)
        return rng.integers(info.min, int(info.max) + 1, count, dtype=kind)
    x = (rng.standard_normal(count) * 1e3).astype(kind)
    if kind.kind == "c":
        x = x + 1j * x[::-1]
    if count > 8:  # at a place that differs by rank, so NaN meets numbers, and -0.0 meets 0.0
        x[:5] = np.roll(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0]), rank)
    return x


def folded(kind: type[Mailbox], n: int, dtype: str, op: str, count: int) -> bytes:
    """What rank 0 of ``n`` computes from every rank's ``values`` through ``kind``."""
    boxes = mailboxes(kind, regions(n))
    code = DTYPES[dtype]
    desc = Descriptor(KINDS["allreduce"], code.code, REDUCTION_CODES[op], 0, count)
    for r, box in enumerate(boxes):
        box.publish(5, header(HERE, desc), values(dtype, count, r))
    out = np.empty(count, code.storage)
    with np.errstate(all="raise"):  # no warning may escape either fold
        assert boxes[0].collect(5, header(HERE, desc), out, code, op) == AGREED
    return out.tobytes()


def ops_for(dtype: str) -> list[str]:
    return [op for op in REDUCTION_CODES if reduction_refused(DTYPES[dtype], op) is None]


@BUILT
@pytest.mark.parametrize("dtype", FOLDED + NOT_FOLDED)
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_the_c_fold_gives_numpys_bits_for_every_type_and_reduction(dtype: str, n: int) -> None:
    """Bit for bit, but for which NaN a sum of two different NaNs keeps (x86 keeps one
    operand's, and either compiler may order a sum's operands): there any NaN will do. Every
    rank folds with the same code, so the ranks agree bit for bit all the same."""
    storage = DTYPES[dtype].storage
    for op in ops_for(dtype):
        for count in (1, 9, 1000, 65536 // storage.itemsize):
            want = folded(Mailbox, n, dtype, op, count)
            got = folded(NativeMailbox, n, dtype, op, count)
            if got != want and storage.kind == "f" and op in ("sum", "avg", "prod"):
                ours, theirs = np.frombuffer(got, storage), np.frombuffer(want, storage)
                differ = ours.view(f"u{storage.itemsize}") != theirs.view(f"u{storage.itemsize}")
                assert np.isnan(ours[differ]).all() and np.isnan(theirs[differ]).all(), (op, count)
                continue
            assert got == want, (dtype, op, count)


@BUILT
def test_what_c_does_not_fold_is_left_untouched_for_numpy() -> None:
    """Agreed but not folded (3): bool, a bitwise reduction of floats, an integer average, an
    unknown reduction; ``out`` as it was, for NativeMailbox.collect to fold with numpy."""
    boxes = mailboxes(NativeMailbox, regions(2))
    out = np.full(4, 7, np.uint8)
    core: Any = boxes[0]._core  # type: ignore[attr-defined]
    unfolded = [("bool", REDUCTION_CODES["sum"]), ("float32", REDUCTION_CODES["band"]),
                ("int32", REDUCTION_CODES["avg"]), ("int32", 99)]  # fmt: skip
    for seq, (dtype, op) in enumerate(unfolded):
        desc = header(HERE, Descriptor(KINDS["allreduce"], DTYPES[dtype].code, op, 0, 4))
        for box in boxes:
            box.publish(seq, desc, np.ones(4, np.uint8))
        assert core.collect(seq, desc, out) == 3, (dtype, op)
    assert out.tolist() == [7] * 4


@BUILT
@pytest.mark.parametrize("writer,reader", [(Mailbox, NativeMailbox), (NativeMailbox, Mailbox)])
def test_either_mailbox_reads_what_the_other_wrote(
    writer: type[Mailbox], reader: type[Mailbox]
) -> None:
    raw = regions(2)
    mine, theirs = writer(1, raw[1], {0: raw[0]}), reader(0, raw[0], {1: raw[1]})
    desc = Descriptor(KINDS["allreduce"], DTYPES["float64"].code, 1, 0, 3)
    other = Descriptor(KINDS["allreduce"], DTYPES["float64"].code, 1, 0, 4)
    for seq in range(3 * SLOTS):
        assert theirs.state(seq, header(HERE, desc)) == WAITING
        mine.publish(seq, header(HERE, desc), np.full(3, seq, np.float64))
        theirs.publish(seq, header(HERE, desc), np.ones(3, np.float64))
        assert theirs.state(seq, header(HERE, other)) == DIFFERENT
        out = np.full(3, -1.0)
        assert theirs.collect(seq, header(HERE, other), out, DTYPES["float64"], "sum") == DIFFERENT
        assert out.tolist() == [-1.0] * 3  # untouched
        assert theirs.state(seq, header(HERE, desc)) == AGREED
        assert theirs.collect(seq, header(HERE, desc), out, DTYPES["float64"], "sum") == AGREED
        assert out.tolist() == [1.0 + seq] * 3
        for box in (mine, theirs):
            box.done_through(seq + 1)


@BUILT
def test_the_wait_gives_up_the_gil_and_gives_up_after_its_time() -> None:
    a, b = mailboxes(NativeMailbox, regions(2))
    desc = header(HERE, Descriptor(KINDS["allreduce"], 2, 1, 0, 1))
    start = time.monotonic()
    assert a.wait(0, 0.05) is False
    assert 0.04 < time.monotonic() - start < 2
    publisher = threading.Timer(0.05, lambda: b.publish(0, desc, np.ones(1, np.float32)))
    start = time.monotonic()
    publisher.start()  # runs Python: only while the waiter has let go of the GIL
    assert a.wait(0, 10.0) is True
    assert time.monotonic() - start < 5
    publisher.join()


@BUILT
def test_a_long_wait_sleeps_between_looks() -> None:
    """After a short spin the wait sleeps between looks, so that a peer that is not running
    (four ranks on two cores) gets the core: most of a long wait costs no CPU."""
    a, _ = mailboxes(NativeMailbox, regions(2))
    wall, cpu = time.monotonic(), time.thread_time()
    assert a.wait(0, 0.3) is False
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert wall >= 0.29 and cpu < 0.5 * wall, (wall, cpu)


@BUILT
def test_a_released_mailbox_refuses_every_call_but_a_wait() -> None:
    """A waiter that lost the race with the lane's close looks again (and finds its request
    failed) instead of raising ValueError out of ``result()``."""
    a, _ = mailboxes(NativeMailbox, regions(2))
    a.release()
    desc = header(HERE, Descriptor(KINDS["allreduce"], 2, 1, 0, 1))
    out = np.ones(1, np.float32)
    f32 = DTYPES["float32"]
    for call in (lambda: a.publish(0, desc, None), lambda: a.state(0, desc),
                 lambda: a.collect(0, desc, out, f32, "sum")):  # fmt: skip
        with pytest.raises(ValueError, match="released"):
            call()
    start = time.monotonic()
    assert a.wait(0, 5.0) is True and time.monotonic() - start < 1


@BUILT
def test_a_release_ends_a_wait_under_way() -> None:
    """The lane's close, from another thread, while a waiter spins: it returns True at its
    next look, not at the end of its time."""
    a, _ = mailboxes(NativeMailbox, regions(2))
    closing = threading.Timer(0.05, a.release)
    start = time.monotonic()
    closing.start()
    assert a.wait(0, 30.0) is True
    assert time.monotonic() - start < 5
    closing.join()


@BUILT
def test_c_folds_every_type_and_reduction_it_claims_itself() -> None:
    """(Else the comparison with numpy above would compare numpy with itself.)"""
    for dtype in FOLDED:
        for op in ops_for(dtype):
            boxes = mailboxes(NativeMailbox, regions(2))
            desc = header(HERE, Descriptor(KINDS["allreduce"], DTYPES[dtype].code,
                                           REDUCTION_CODES[op], 0, 3))  # fmt: skip
            for box in boxes:
                box.publish(0, desc, np.ones(3, DTYPES[dtype].storage))
            core: Any = boxes[0]._core  # type: ignore[attr-defined]
            assert core.collect(0, desc, np.empty(3, DTYPES[dtype].storage)) == AGREED, (dtype, op)


@BUILT
def test_a_negative_number_or_a_wrong_layout_is_refused() -> None:
    a, _ = mailboxes(NativeMailbox, regions(2))
    desc = header(HERE, Descriptor(KINDS["allreduce"], 2, 1, 0, 1))
    with pytest.raises(ValueError, match="sequence number"):
        a.publish(-1, desc, None)
    with pytest.raises(ValueError, match="region 1"):
        Core(0, [regions(1)[0], np.zeros(100, np.uint8)], SLOTS, 8, 8, 8 * (8 + SLOTS * 8), 65536)


@BUILT
def test_a_slot_too_small_or_a_short_header_is_refused() -> None:
    a, _ = mailboxes(NativeMailbox, regions(2))
    desc = header(HERE, Descriptor(KINDS["allreduce"], 2, 1, 0, 1))
    with pytest.raises(ValueError, match="slot"):
        a.publish(0, desc, np.ones(65537, np.uint8))
    with pytest.raises(ValueError, match="header"):
        a.publish(0, desc[:3], None)


def test_the_set_up_command_built_it_where_a_compiler_is() -> None:
    """(Every other test here is skipped where it was not built: this one fails instead where
    it should have been.)"""
    assert shutil.which("cc") is None or Core is not None

