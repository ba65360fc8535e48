"""asyncreduce.torch.DataParallel against single-process training, on real processes.

Every exact mode (blocking, backward, forward), trained on R ranks that each take an equal shard
of the batch (loss = mean over the shard), must end (after ``synchronize()``) where single-process
training on the whole batch (loss = mean over the whole batch) ends, with the same optimizer.
``double_buffer`` must end where single-process training with a one-step gradient delay ends.
Parameters must be bitwise identical on every rank.

Starting a rank costs an interpreter and ``import torch`` (seconds on 2 cores), so scenarios are
run in groups: one ``run_ranks`` call trains every scenario of a group in turn, each with its own
wrapper on the same communicator, and the results are cached for the tests that check them. The
single-process references are computed here, in the test process, with the same seeds and data.
All models are float64, so the 1e-5 tolerance has a wide margin (differences are ~1e-14).
Non-zero ranks initialise their modules from a different seed: the wrapper's broadcast of rank
0's parameters at construction is what makes them agree.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import asyncreduce as ar  # noqa: E402
import asyncreduce.torch as art  # noqa: E402
from spmd import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch]

SEED = 1234
PER_RANK = 4  # samples per rank per step (equal shards)
STEPS = 12  # >= 10 steps everywhere
DYN_STEPS = 14  # ends on a step where every rank skips the branch (pending update at synchronize)
ATOL = 1e-5

# ---- models -------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x: Any) -> Any:
        return self.fc3(F.relu(self.fc2(torch.tanh(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: Any) -> Any:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 8x8 -> 4x4
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # 4x4 -> 2x2
        return self.fc(h.flatten(1))


SEQ = 5


class LSTMNet(nn.Module):
    """nn.LSTM over SEQ steps, then the head applied once per time step (used SEQ times)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Any) -> Any:
        out, _ = self.lstm(x)
        return torch.stack([self.head(out[:, i]) for i in range(out.shape[1])], dim=1)


VOCAB, TOKENS = 11, 4


class TiedLM(nn.Module):
    """Embedding weight shared with the output projection (one parameter, two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.mix = nn.Linear(6, 6)
        self.proj = nn.Linear(6, VOCAB, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, x: Any) -> Any:
        return self.proj(torch.tanh(self.mix(self.embed(x))))


class DynamicNet(nn.Module):
    """``branch`` runs only when ``skip`` is False; ``unused`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 8)
        self.skip = False

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.inp(x))
        if not self.skip:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def skips(step: int, rank: int, world: int) -> bool:
    """Every rank skips on step 1 mod 4; only the last rank on 2 mod 4; only rank 0 on 3 mod 4."""
    phase = step % 4
    return phase == 1 or (phase == 2 and rank == world - 1) or (phase == 3 and rank == 0)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "lstm": LSTMNet,
    "tied": TiedLM,
    "dynamic": DynamicNet,
}

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def make_batch(model: str, world: int, step: int, micro: int = 0) -> tuple[Any, Any]:
    """The whole batch (world * PER_RANK samples) of one step; rank r takes rows [r*P, (r+1)*P)."""
    g = torch.Generator().manual_seed(
        100_003 * (1 + sorted(BUILDERS).index(model)) + 1009 * step + micro
    )
    n = world * PER_RANK
    f64 = torch.float64
    if model == "mlp":
        return torch.randn(n, 10, generator=g, dtype=f64), torch.randn(n, 3, generator=g, dtype=f64)
    if model == "cnn":
        x = torch.randn(n, 1, 8, 8, generator=g, dtype=f64)
        return x, torch.randint(0, 3, (n,), generator=g)
    if model == "lstm":
        x = torch.randn(n, SEQ, 3, generator=g, dtype=f64)
        return x, torch.randn(n, SEQ, 2, generator=g, dtype=f64)
    if model == "tied":
        x = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
        return x, torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    if model == "dynamic":
        return torch.randn(n, 6, generator=g, dtype=f64), torch.randn(n, 2, generator=g, dtype=f64)
    raise AssertionError(model)


def loss_fn(model: str, out: Any, y: Any) -> Any:
    if model == "cnn":
        return F.cross_entropy(out, y)
    if model == "tied":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss(out, y)


def shard(t: Any, rank: int) -> Any:
    return t[rank * PER_RANK : (rank + 1) * PER_RANK]


def flat(module: nn.Module) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ---- scenarios: "model/optimizer/mode" or "model/optimizer/mode/no_sync" ------------------------


def parse(key: str) -> tuple[str, str, str, str]:
    parts = key.split("/")
    return parts[0], parts[1], parts[2], (parts[3] if len(parts) > 3 else "train")


def steps_of(model: str) -> int:
    return DYN_STEPS if model == "dynamic" else STEPS


def run_scenario(comm: ar.Communicator, key: str) -> dict[str, Any]:
    """One rank's side: build, wrap, train, synchronize; report parameters and what was seen."""
    model, opt, mode, kind = parse(key)
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(SEED + 7919 * rank)  # only rank 0's initial values may survive construction
    module = BUILDERS[model]().double()
    dp = art.DataParallel(module, comm, optimizer=OPTIMIZERS[opt], mode=mode)
    assert dp.module is module, "model.module is not the module that was wrapped"
    init = flat(module).numpy().copy()
    unused_init = flat(module.unused).numpy().copy() if model == "dynamic" else None
    grads_left: list[int] = []  # steps after which step() left a gradient that is not None
    started = time.perf_counter()
    for t in range(steps_of(model)):
        if kind == "no_sync":
            micro = [make_batch(model, world, t, i) for i in range(3)]
            with dp.no_sync():
                for x, y in micro[:2]:
                    (loss_fn(model, dp(shard(x, rank)), shard(y, rank)) / 3).backward()
            x, y = micro[2]
            (loss_fn(model, dp(shard(x, rank)), shard(y, rank)) / 3).backward()
        else:
            x, y = make_batch(model, world, t)
            if model == "dynamic":
                module.skip = skips(t, rank, world)
            loss_fn(model, dp(shard(x, rank)), shard(y, rank)).backward()
        dp.step()
        if any(p.grad is not None for p in module.parameters()):
            grads_left.append(t)
    dp.synchronize()
    train_s = time.perf_counter() - started  # every allreduce stats() counts lies in here
    stats = dp.stats()
    final = flat(module).numpy().copy()
    return {
        "init": init,
        "final": final,
        "bytes": final.tobytes(),
        "grads_left": grads_left,
        "stats": dict(stats),
        "train_s": train_s,
        "unused_moved": (
            None if unused_init is None else not np.array_equal(unused_init, flat(module.unused))
        ),
    }


def body_group(comm: ar.Communicator, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Every scenario in turn. A scenario that raises is reported (and printed at once, so that
    it shows in the test's captured stderr even if another rank then hangs) and the next one runs:
    an error raised the same way on every rank leaves the ranks in step."""
    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    for key in keys:
        try:
            results[key] = run_scenario(comm, key)
        except Exception:  # noqa: BLE001 - reported to the test of that scenario
            tb = traceback.format_exc()
            print(f"--- scenario {key!r} failed on rank {comm.rank} ---\n{tb}", file=sys.stderr)
            results[key] = {"error": tb}
    return results


# ---- single-process references (in the test process) --------------------------------------------


def _grads(module: nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _apply(module: nn.Module, optimizer: Any, grads: list[Any]) -> None:
    for p, g in zip(module.parameters(), grads, strict=True):
        p.grad = g
    optimizer.step()
    module.zero_grad(set_to_none=True)


@functools.cache
def reference(key: str, world: int) -> tuple[np.ndarray, np.ndarray]:
    """(initial, final) flat parameters of single-process training for this scenario."""
    model, opt, mode, kind = parse(key)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        module = BUILDERS[model]().double()
        init = flat(module).numpy().copy()
        optimizer = OPTIMIZERS[opt](module.parameters())
        pending = None
        for t in range(steps_of(model)):
            if kind == "no_sync":  # three micro-batches accumulated, each loss / 3
                for i in range(3):
                    x, y = make_batch(model, world, t, i)
                    (loss_fn(model, module(x), y) / 3).backward()
                grads = _grads(module)
            elif model == "dynamic":  # R ranks simulated: per-shard grads, absent -> 0, sum / R
                x, y = make_batch(model, world, t)
                total: list[Any] = [None] * len(list(module.parameters()))
                for r in range(world):
                    module.zero_grad(set_to_none=True)
                    module.skip = skips(t, r, world)  # type: ignore[assignment]
                    loss_fn(model, module(shard(x, r)), shard(y, r)).backward()
                    for i, g in enumerate(_grads(module)):
                        if g is not None:
                            total[i] = g if total[i] is None else total[i] + g
                module.zero_grad(set_to_none=True)
                grads = [None if g is None else g / world for g in total]
            else:  # the whole batch, loss = mean over it
                x, y = make_batch(model, world, t)
                loss_fn(model, module(x), y).backward()
                grads = _grads(module)
            module.zero_grad(set_to_none=True)
            if mode == "double_buffer":  # step t applies the gradient of step t-1
                if pending is not None:
                    _apply(module, optimizer, pending)
                pending = grads
            else:
                _apply(module, optimizer, grads)
        if pending is not None:  # synchronize() applies the last one
            _apply(module, optimizer, pending)
        return init, flat(module).numpy().copy()
    finally:
        torch.set_num_threads(threads)


# ---- groups of scenarios, one run_ranks call each, results cached -------------------------------

GROUPS: dict[str, tuple[int, float, list[str]]] = {
    # name: (world size, run_ranks timeout, scenarios); one process start-up per group
    "R2": (2, 100.0, [
        "mlp/sgd/blocking", "mlp/sgd/backward", "mlp/sgd/forward", "mlp/sgd/double_buffer",
        "mlp/adam/blocking", "mlp/adam/backward", "mlp/adam/forward",
        "mlp/sgd/blocking/no_sync", "mlp/sgd/backward/no_sync", "mlp/sgd/forward/no_sync",
        "cnn/sgd/blocking", "cnn/sgd/backward", "cnn/sgd/forward", "cnn/adam/forward",
        "lstm/sgd/blocking", "lstm/sgd/backward", "lstm/sgd/forward", "lstm/adam/forward",
        "lstm/sgd/double_buffer",
        "tied/sgd/blocking", "tied/sgd/backward", "tied/sgd/forward", "tied/adam/backward",
        "dynamic/sgd/blocking", "dynamic/sgd/backward", "dynamic/sgd/forward",
        "dynamic/adam/backward", "dynamic/adam/forward",
    ]),
    "R3": (3, 120.0, [
        "mlp/sgd/blocking", "mlp/sgd/backward", "mlp/sgd/forward", "mlp/sgd/double_buffer",
        "mlp/adam/forward", "mlp/sgd/forward/no_sync",
        "cnn/sgd/forward", "lstm/sgd/forward", "lstm/adam/backward", "tied/sgd/forward",
        "dynamic/sgd/backward", "dynamic/sgd/forward", "dynamic/adam/forward",
    ]),
}  # fmt: skip

_CACHE: dict[str, Any] = {}


def group_results(name: str) -> dict[int, dict[str, dict[str, Any]]]:
    """Run a group once per test session; a failure is cached too (and re-raised per test)."""
    if name not in _CACHE:
        world, timeout, keys = GROUPS[name]
        try:
            _CACHE[name] = run_ranks(world, body_group, keys, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised for every test of the group
            if not isinstance(exc, Exception):
                raise  # a pytest-timeout or Ctrl-C: do not cache
            _CACHE[name] = f"group {name!r} failed:\n{exc}"
    found = _CACHE[name]
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return found


CASES = [
    pytest.param(name, key, id=f"{key}-R{GROUPS[name][0]}")
    for name, (_, _, keys) in GROUPS.items()
    for key in keys
]
TIMEOUT = max(t for _, t, _ in GROUPS.values()) + 30  # the first test of a group starts it


def scenario(group: str, key: str) -> list[dict[str, Any]]:
    """Every rank's report of one scenario; fails with the traceback of a rank that raised."""
    results = group_results(group)
    reports = [results[rank][key] for rank in range(GROUPS[group][0])]
    for rank, got in enumerate(reports):
        if "error" in got:
            pytest.fail(f"{key} raised on rank {rank}:\n{got['error']}", pytrace=False)
    return reports


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("group", "key"), CASES)
def test_training_matches_single_process(group: str, key: str) -> None:
    reports = scenario(group, key)
    _, want = reference(key, GROUPS[group][0])
    for rank, report in enumerate(reports):
        got = report["final"]
        diff = np.abs(got - want)
        at = int(diff.argmax())
        assert diff.max() <= ATOL, (
            f"rank {rank}: max |got - reference| = {diff.max():.3g} at flat index {at} "
            f"(got {got[at]!r}, want {want[at]!r}); "
            f"{int((diff > ATOL).sum())} of {diff.size} elements off"
        )


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("group", "key"), CASES)
def test_parameters_bitwise_identical_on_every_rank(group: str, key: str) -> None:
    reports = scenario(group, key)
    differ = [r for r, got in enumerate(reports) if got["bytes"] != reports[0]["bytes"]]
    assert not differ, f"ranks {differ} end with parameters that differ from rank 0's"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("group", "key"), CASES)
def test_construction_broadcasts_rank0_parameters_and_step_clears_grads(
    group: str, key: str
) -> None:
    reports = scenario(group, key)
    want, _ = reference(key, GROUPS[group][0])
    for rank, got in enumerate(reports):
        assert np.array_equal(got["init"], want), f"rank {rank}: parameters after construction"
        assert not got["grads_left"], (
            f"rank {rank}: step() left gradients after steps {got['grads_left']}"
        )


DYNAMIC = [c for c in CASES if c.values[1].startswith("dynamic/")]  # type: ignore[union-attr]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("group", "key"), DYNAMIC)
def test_parameter_unused_on_every_rank_never_moves(group: str, key: str) -> None:
    for rank, got in enumerate(scenario(group, key)):
        assert got["unused_moved"] is False, f"rank {rank}: 'unused' moved"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_stats_in_forward_mode(group: str) -> None:
    """stats() after 12 steps: time in flight counted once however many buckets overlap (no
    more than the training took), every wait in a layer's pre-hook timed as exposed, and
    hidden_share what the other two say."""
    for rank, got in enumerate(scenario(group, "mlp/sgd/forward")):
        stats, train_s = got["stats"], got["train_s"]
        seen = f"rank {rank}: stats()={stats}, training took {train_s:.3f} s"
        assert set(stats) == {"exposed_s", "comm_s", "hidden_share"}, seen
        for field in ("exposed_s", "comm_s"):
            assert isinstance(stats.get(field), float), seen
        # 36 allreduces, three layers' in flight at once: their spans summed may exceed the
        # training time, their union (what comm_s is) cannot
        assert 0 < stats["comm_s"] <= train_s, seen
        assert 0 < stats["exposed_s"] <= train_s, seen  # 36 waits, each timed
        hidden = min(1.0, max(0.0, 1 - stats["exposed_s"] / stats["comm_s"]))
        assert stats["hidden_share"] == pytest.approx(hidden, abs=1e-12), seen


# ---- bad input ----------------------------------------------------------------------------------


class Shaped(nn.Module):
    """fc2's weight shape is chosen per rank (fc2 never runs: only construction is tested)."""

    def __init__(self, fc2_in: int, fc2_out: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 3)
        self.fc2 = nn.Linear(fc2_in, fc2_out, bias=bias)

    def forward(self, x: Any) -> Any:
        return self.fc1(x)


def _attempt(fn: Callable[[], Any]) -> dict[str, Any] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        return {
            "type": type(exc).__name__,
            "usage": isinstance(exc, ar.UsageError),
            "mismatch": isinstance(exc, ar.MismatchError),
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
    return None


def body_bad_input(comm: ar.Communicator) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rank = comm.rank
    sgd = OPTIMIZERS["sgd"]
    out: dict[str, Any] = {}
    out["unknown_mode"] = _attempt(
        lambda: art.DataParallel(MLP().double(), comm, optimizer=sgd, mode="sideways")
    )
    out["lbfgs_forward"] = _attempt(
        lambda: art.DataParallel(
            MLP().double(), comm, optimizer=lambda ps: torch.optim.LBFGS(ps), mode="forward"
        )
    )
    # element counts differ: fc2 is 6->4 on rank 0, 6->5 elsewhere
    out["shape_count"] = _attempt(
        lambda: art.DataParallel(
            Shaped(6, 4 if rank == 0 else 5, True).double(), comm, optimizer=sgd, mode="forward"
        )
    )
    # same element count, different shape: (4, 6) on rank 0, (6, 4) elsewhere
    out["shape_only"] = _attempt(
        lambda: art.DataParallel(
            Shaped(6 if rank == 0 else 4, 4 if rank == 0 else 6, False).double(),
            comm,
            optimizer=sgd,
            mode="blocking",
        )
    )
    # the communicator is still usable afterwards (bounded wait: never hang the group)
    x = np.full(4, rank + 1.0)
    try:
        comm.iallreduce(x, name="after-bad-input").wait(timeout=15)
        out["after"] = x.tolist()
    except Exception as exc:  # noqa: BLE001
        out["after"] = f"{type(exc).__name__}: {exc}"
    return out


_BAD: dict[str, Any] = {}


def bad_results() -> dict[int, dict[str, Any]]:
    if "r" not in _BAD:
        try:
            _BAD["r"] = run_ranks(2, body_bad_input, timeout=60)
        except Exception as exc:  # noqa: BLE001
            _BAD["r"] = f"bad-input group failed:\n{exc}"
    if isinstance(_BAD["r"], str):
        pytest.fail(_BAD["r"], pytrace=False)
    return _BAD["r"]


@pytest.mark.timeout(90)
def test_unknown_mode_is_a_usage_error() -> None:
    for rank, out in bad_results().items():
        got = out["unknown_mode"]
        assert got is not None, f"rank {rank}: mode='sideways' was accepted"
        assert got["usage"], f"rank {rank}: {got['type']}: {got['message']}"


@pytest.mark.timeout(90)
def test_forward_mode_refuses_an_optimizer_that_needs_all_gradients() -> None:
    for rank, out in bad_results().items():
        got = out["lbfgs_forward"]
        assert got is not None, f"rank {rank}: LBFGS was accepted in forward mode"
        assert got["usage"], f"rank {rank}: {got['type']}: {got['message']}"
        assert "backward" in got["message"], f"rank {rank}: {got['message']}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["shape_count", "shape_only"])
def test_parameter_shapes_that_differ_across_ranks_fail_on_every_rank(case: str) -> None:
    for rank, out in bad_results().items():
        got = out[case]
        assert got is not None, f"rank {rank}: fc2's shape differs across ranks but was accepted"
        assert got["usage"] or got["mismatch"], f"rank {rank}: {got['traceback']}"
        assert "fc2" in got["message"], f"rank {rank}: message does not name fc2: {got['message']}"


@pytest.mark.timeout(90)
def test_communicator_usable_after_bad_input() -> None:
    for rank, out in bad_results().items():
        assert out["after"] == [3.0] * 4, f"rank {rank}: {out['after']}"


def test_busy_clock_counts_overlapping_spans_once_and_stays_bounded() -> None:
    from types import SimpleNamespace

    from asyncreduce.torch.stats import _BusyClock

    clock = _BusyClock()
    for i in range(1000):  # spans [2i, 2i+1] and an overlapping [2i+0.5, 2i+1.5]
        clock.add(SimpleNamespace(posted_at=2.0 * i, completed_at=2.0 * i + 1))  # type: ignore[arg-type]
        clock.add(SimpleNamespace(posted_at=2.0 * i + 0.5, completed_at=2.0 * i + 1.5))  # type: ignore[arg-type]
    assert clock.total == pytest.approx(1500.0)
    assert len(clock._spans) <= 2 * clock._KEEP


def body_bucket_path(comm: ar.Communicator) -> list[int]:
    """Window allreduces of a 160 KiB bucket: one per step, on one host only."""
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 200)
    dp = art.DataParallel(model, comm, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          mode="backward")  # fmt: skip
    counts = []
    for _ in range(2):
        dp(torch.ones(4, 200)).sum().backward()
        dp.step()
        records = comm.flight_record()["records"]
        counts.append(sum("in shared window" in r["what"] for r in records))
    return counts


@pytest.mark.parametrize(("env", "want"), [({}, [1, 2]), ({"ASYNCREDUCE_SHM": "0"}, [0, 0])])
def test_cpu_buckets_take_the_shared_window_on_one_host(
    env: dict[str, str], want: list[int]
) -> None:
    results = run_ranks(2, body_bucket_path, env=env)
    assert results == {0: want, 1: want}
