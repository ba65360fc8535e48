"""One rank of ``bench gpu``: every training row in interleaved rounds, then the staged rows.

``worker(settings, tell)`` joins Gloo (the default group, env:// from ``asyncreduce run``), an
"asyncreduce" process group, NCCL where every rank has a GPU of its own and there are at least
2, and asyncreduce itself (``ar.init()``, which meets in the torch job's store; over NCCL too,
``backend="torch"``). On the CPU stand-in the whole body runs inside
``asyncreduce.torch.standin.standing_in()``: every CPU tensor is then a "device" tensor,
staged through the stand-in, which counts every copy and synchronization.

A training row (``gpu_setup.ROWS``) goes through phases, all rows one phase at a time: set-up
(model from one seed, wrapper, optimizer), warm-up, ``rounds`` timed rounds (each row in turn,
after a barrier: ``steps`` steps, then everything in flight applied and the device drained), a
counting phase (``count_steps`` more steps: copies and synchronizations per step), and the
report (the slowest rank per round, steps/s from their median, hidden share, a digest of the
final parameters). Every rank ends each phase of each row by telling the others whether it
failed there; a row that failed anywhere is reported with its error and leaves the run, the
others go on. A phase that makes no progress for ``row_timeout`` seconds (a collective that
hangs) ends the process through ``faulthandler``: the parent restarts the set without that row.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import hashlib
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpu_setup import ROWS, STANDIN, agree, error_text, make_trainer, skipped_why

__all__ = ["Env", "Row", "worker"]

Tell = Callable[..., None]


@dataclass
class Env:
    """What every row needs: this rank, its device, the groups and communicators."""

    rank: int
    size: int
    device: Any
    standin: Any  # the stand-in's HostDevice, or None on a GPU
    comm: Any  # asyncreduce over its own engine
    settings: dict[str, Any]
    tell: Tell
    groups: dict[str, Any] = field(default_factory=dict)  # "asyncreduce", "nccl": group or error
    nccl_comm: Any = None  # asyncreduce over the NCCL group (backend="torch"), or an error

    def sync_device(self) -> None:
        """Wait for this rank's device to drain (nothing on the stand-in)."""
        if self.standin is None:
            import torch

            torch.cuda.synchronize(self.device)


@dataclass
class Row:
    """One training row: its trainer while it runs, then what is reported of it."""

    key: str
    trainer: Any = None
    times: list[float] = field(default_factory=list)
    stats: dict[str, float] | None = None
    result: dict[str, Any] = field(default_factory=dict)


# ---- agreement and the row timeout --------------------------------------------------------------


@contextlib.contextmanager
def _deadline(env: Env, where: str, phase: str) -> Iterator[None]:
    """Tell the parent where we are; end the process if this takes over ``row_timeout``."""
    env.tell("start", row=where, phase=phase)
    faulthandler.dump_traceback_later(env.settings["row_timeout"], exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _phase(env: Env, live: dict[str, Row], phase: str, body: Callable[[Row], None]) -> None:
    """``body`` for every live row in turn; a row that failed on any rank leaves ``live``."""
    for key in list(live):
        row = live[key]
        with _deadline(env, key, phase):
            error = None
            try:
                body(row)
            except Exception as exc:  # noqa: BLE001 - reported in the row, the others go on
                error = error_text(exc)
            error = agree(error)
        if error is not None:
            row.result = {"key": key, "status": f"error: {error} (in {phase})"}
            env.tell("row", **row.result)
            del live[key]
            row.trainer = None
            gc.collect()


# ---- the phases of a training row -----------------------------------------------------------


def _warm(env: Env, row: Row) -> None:
    for _ in range(env.settings["warmup"]):
        row.trainer.step()
    row.trainer.finish()
    env.sync_device()
    if row.trainer.dp is not None:
        row.trainer.dp.stats(reset=True)  # the timed rounds' share only


def _timed_round(env: Env, row: Row) -> None:
    """``steps`` steps after a barrier, everything applied and the device drained."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in range(env.settings["steps"]):
        row.trainer.step()
    row.trainer.finish()
    env.sync_device()
    row.times.append(time.perf_counter() - started)


def _counted(env: Env, row: Row) -> None:
    """``count_steps`` more steps, counted: copies each way and synchronizations of the
    training thread per step (stand-in: its log, and ``DeviceReads``; GPU: sync debug mode)."""
    n = env.settings["count_steps"]
    if row.trainer.dp is not None:
        row.stats = row.trainer.dp.stats()  # the timed rounds' (this phase is not timed)
    if env.standin is None:
        with _sync_warnings() as found:
            for _ in range(n):
                row.trainer.step()
        row.trainer.finish()
        env.sync_device()
        row.result["counts"] = {"syncs": len(found) / n, "how": "torch sync debug mode 'warn'"}
        return
    if row.trainer.dp is None:  # not staged on the stand-in: nothing to count
        for _ in range(n):
            row.trainer.step()
        return
    row.result["counts"] = _standin_counts(env, row, n)


def _standin_counts(env: Env, row: Row, n: int) -> dict[str, Any]:
    from asyncreduce.torch.standin import DeviceReads

    before = env.standin.counts()
    with DeviceReads(env.standin) as reads:
        for _ in range(n):
            row.trainer.step()
    row.trainer.finish()  # the last step's copies back land here: counted, not a sync of ours
    made = env.standin.counts() - before
    me = threading.current_thread().name

    def total(what: str, mine: bool = False) -> int:
        return sum(k for (w, who), k in made.items() if w == what and (who == me or not mine))

    return {
        "to_host": total("to_host") / n,
        "to_device": total("to_device") / n,
        "syncs": total("synchronize", mine=True) / n,
        "reads": len(reads.found) / n,
        "reads_found": [f"{name}{list(shape)}" for name, shape in reads.found[:5]],
        "buckets": len(row.trainer.dp._buckets),
        "how": STANDIN,
    }


@contextlib.contextmanager
def _sync_warnings() -> Iterator[list[str]]:
    """Synchronizing CUDA calls made by this thread, as sync debug mode "warn" reports them."""
    import torch

    me, found = threading.current_thread(), []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message):
                if threading.current_thread() is me:
                    found.append(str(message))
                return  # another thread's: not the training thread's, and not shown
            shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _report(env: Env, row: Row) -> None:
    """The slowest rank per round, the digest everywhere; the row's result (told by rank 0)."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor(row.times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    digest = _digest(row.trainer.params())
    digests: list[str | None] = [None] * env.size
    dist.all_gather_object(digests, digest)
    median = statistics.median(slowest.tolist())
    stats = row.stats or {}
    row.result = {
        "key": row.key,
        "status": "ok",
        "steps_per_s": env.settings["steps"] / median,
        "round_s": [round(t, 4) for t in slowest.tolist()],
        "hidden_share": stats.get("hidden_share"),
        "digest": digest,
        "ranks_agree": len(set(digests)) == 1,
        "counts": row.result.get("counts"),
        "steps_total": _steps_total(env.settings),
    }


def _digest(params: list[Any]) -> str:
    """sha256 of every parameter's bytes, in order, on the host: equal means bit for bit."""
    import torch

    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _steps_total(settings: dict[str, Any]) -> int:
    s = settings
    return int(s["warmup"] + s["rounds"] * s["steps"] + s["count_steps"])


def _training(env: Env) -> None:
    """Every training row of this set, phase by phase (see the module docstring)."""
    live: dict[str, Row] = {}
    for key in env.settings["rows"]:
        why = skipped_why(key, env)
        if why:
            env.tell("row", key=key, status=f"skipped: {why}")
        elif key in ROWS:
            live[key] = Row(key)

    def setup(row: Row) -> None:
        row.trainer = make_trainer(env, row.key)

    _phase(env, live, "set-up", setup)
    _phase(env, live, "warm-up", lambda row: _warm(env, row))
    for r in range(env.settings["rounds"]):
        _phase(env, live, f"round {r + 1}", lambda row: _timed_round(env, row))
    _phase(env, live, "counting", lambda row: _counted(env, row))
    _phase(env, live, "report", lambda row: _report(env, row))
    for row in live.values():
        env.tell("row", **row.result)
        if row.trainer.dp is not None:
            row.trainer.dp.close()
        row.trainer = None
    gc.collect()
    if env.standin is None:
        import torch

        torch.cuda.empty_cache()


# ---- the worker ---------------------------------------------------------------------------------


def worker(settings: dict[str, Any], tell: Tell) -> None:
    """One rank: join, the training rows, then the staged rows (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import asyncreduce.torch  # noqa: F401  (registers the "asyncreduce" backend)

    if settings["standin"]:
        torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def told(event: str, **fields: Any) -> None:
        if rank == 0:
            tell(event, **fields)

    if settings["standin"]:
        from asyncreduce.torch.standin import standing_in

        with standing_in() as host:  # in this process: the stand-in is per process
            _body(Env(rank, size, torch.device("cpu"), host, None, settings, told))
    else:
        told("gpus", names=_gpu_names())
        _body(Env(rank, size, _cuda_device(rank, size), None, None, settings, told))
    dist.barrier()
    dist.destroy_process_group()


def _cuda_device(rank: int, size: int) -> Any:
    """One GPU per rank where there are enough, else every rank on GPU 0."""
    import torch

    count = torch.cuda.device_count()
    device = torch.device("cuda", rank if count >= size else 0)
    torch.cuda.set_device(device)
    return device


def _gpu_names() -> list[str]:
    """Every GPU this rank sees, with its memory (for the report's header)."""
    import torch

    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append(f"{p.name} ({p.total_memory / 2**30:.0f} GiB)")
    return found


def _body(env: Env) -> None:
    import asyncreduce as ar

    with _deadline(env, "set-up", "joining"):
        _join_groups(env)
        env.comm = ar.init()
    if env.settings["rows"]:
        _training(env)
    if env.settings["staged"]:
        from gpu_staged import staged_rows

        staged_rows(env, lambda size: _deadline(env, "staged", f"{size} bytes"))
    _close(env)


def _join_groups(env: Env) -> None:
    """The "asyncreduce" process group, and NCCL (group and communicator) where it runs; a
    group that cannot be made is the error of the rows that need it."""
    import torch.distributed as dist

    import asyncreduce as ar

    try:
        env.groups["asyncreduce"] = dist.new_group(backend="asyncreduce")
    except Exception as exc:  # noqa: BLE001 - the DDP-over-asyncreduce row reports it
        env.groups["asyncreduce"] = error_text(exc)
    if skipped_why("ddp_nccl", env):
        return
    try:
        env.groups["nccl"] = dist.new_group(backend="nccl")
        env.nccl_comm = ar.init(backend="torch", group=env.groups["nccl"])
    except Exception as exc:  # noqa: BLE001 - the NCCL rows report it
        env.groups.setdefault("nccl", error_text(exc))
        env.nccl_comm = error_text(exc)


def _close(env: Env) -> None:
    """Our communicators (the process groups go with ``destroy_process_group``)."""
    for comm in (env.comm, env.nccl_comm):
        if comm is not None and not isinstance(comm, str):
            comm.close()
