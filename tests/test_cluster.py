"""``scripts/cluster.py``: emulated hosts (network namespaces) behind rate-limited links.

Each test builds a real cluster (root, ``ip`` and ``tc`` needed; skipped otherwise): two
namespaces on a switch at 1 Gbit/s. They check that an asyncreduce allreduce across the two
hosts is right and that each rank really ran in its own network namespace, that a TCP stream
between the hosts is shaped (well below unshaped veth speed, which is tens of Gbit/s), and
that nothing with the run's prefix is left afterwards: not after ``with``, not after SIGTERM
of the owner, and not after SIGKILL once ``cleanup`` has run. Open MPI across the namespaces
runs when mpirun and mpi4py are installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from faults import report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cluster.py"


def _load() -> ModuleType:
    name = "asyncreduce_scripts.cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cluster = _load()
pytestmark = pytest.mark.skipif(
    cluster.available() is not None, reason=f"no emulated cluster here: {cluster.available()}"
)

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os
    import numpy as np
    import asyncreduce as ar

    with ar.init(timeout=30) as comm:
        x = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
        comm.allreduce(x)
        print(json.dumps({"rank": comm.rank, "sum": float(x.sum()), "first": float(x[1]),
                          "netns": os.readlink("/proc/self/ns/net")}), flush=True)
    """
)


def _ours(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name contains ``prefix``."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (netns + links).splitlines() if prefix in line]


def _rank_env(c: Any, host: int) -> dict[str, str]:
    return {
        "RANK": str(host),
        "WORLD_SIZE": str(c.hosts),
        "MASTER_ADDR": c.addrs[0],
        "MASTER_PORT": "29500",
        "ASYNCREDUCE_ADDR": c.addrs[host],
        "PYTHONPATH": str(ROOT / "src"),
    }


def test_allreduce_across_two_shaped_hosts_then_nothing_is_left(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    lines: list[tuple[int, str]] = []
    with cluster.Cluster(hosts=2, rate="1gbit") as c:
        prefix = c.prefix
        assert len(_ours(prefix)) == 3  # h0, h1, the switch; no link in the root namespace
        codes = c.run(
            [sys.executable, str(script)],
            lambda i: _rank_env(c, i),
            timeout=60,
            on_line=lambda host, line: lines.append((host, line)),
        )
        assert codes == [0, 0], lines
        tcp = c.measure_tcp(0, 1, seconds=0.5)

    reports = [json.loads(line) for _, line in lines if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1], lines
    expected = float(sum(range(1000))) * 3  # ranks add x*1 and x*2
    assert all(r["sum"] == expected and r["first"] == 3.0 for r in reports)
    own_netns = Path("/proc/self/ns/net").readlink().as_posix()
    assert len({r["netns"] for r in reports} | {own_netns}) == 3  # each rank in its own host

    assert 0.2e9 < tcp["bits_per_s"] < 2e9, tcp  # shaped to 1 Gbit/s (unshaped: >10 Gbit/s)
    assert _ours(prefix) == []


def _start_owner() -> tuple[subprocess.Popen[bytes], str]:
    """``cluster.py run -- sleep 60`` in a child; returns it and its prefix once it is up."""
    owner = subprocess.Popen(
        [sys.executable, str(SCRIPT), "run", "--hosts", "2", "--", "sleep", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prefix = f"{cluster.PREFIX}{owner.pid}-"
    deadline = time.monotonic() + 15
    while len(_ours(prefix)) < 3:
        assert time.monotonic() < deadline and owner.poll() is None, "the cluster never came up"
        time.sleep(0.1)
    time.sleep(0.3)  # let the sleeps start inside the hosts
    return owner, prefix


def test_sigterm_tears_down_and_cleanup_sweeps_after_sigkill() -> None:
    owner, prefix = _start_owner()
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=15) == -signal.SIGTERM
    assert _ours(prefix) == []

    owner, prefix = _start_owner()
    owner.kill()  # no chance to clean up: the namespaces and the sleeps stay
    owner.wait(timeout=15)
    assert len(_ours(prefix)) == 3
    assert any(name.startswith(prefix) for name in cluster.cleanup(dry_run=True))
    cluster.cleanup()  # owner dead: its namespaces go, and the processes inside them
    assert _ours(prefix) == []


@pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI and mpi4py",
)
def test_open_mpi_across_hosts(tmp_path: Path) -> None:
    script = tmp_path / "mpi_rank.py"
    script.write_text(
        "import os\nfrom mpi4py import MPI\n"
        "c = MPI.COMM_WORLD\n"
        "total = c.allreduce(c.rank + 1)\n"
        f"path = {str(tmp_path)!r} + f'/rank{{c.rank}}.txt'\n"
        "open(path, 'w').write(f\"{c.rank} {os.environ['HOST_INDEX']} {total}\")\n"
    )  # files, not stdout: mpirun may interleave the ranks' output within a line
    lines: list[str] = []
    with cluster.Cluster(hosts=2, rate="1gbit") as c:
        codes = c.run(
            c.mpirun_argv([sys.executable, str(script)]),
            timeout=60,
            on_line=lambda _, line: lines.append(line),
            on=[0],
        )
    assert codes == [0], lines
    written = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert written == ["0 0 3", "1 1 3"], (written, lines)


@pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI and mpi4py",
)
@pytest.mark.timeout(120)
def test_asyncreduce_under_mpirun_across_hosts_needs_no_master_address(tmp_path: Path) -> None:
    """No MASTER_ADDR, no -x: rank 0 tells the others through MPI where its store listens."""
    script = tmp_path / "ar_rank.py"
    script.write_text(
        "import os, numpy as np, asyncreduce as ar\n"
        "assert 'MASTER_ADDR' not in os.environ\n"
        "with ar.init(timeout=30) as comm:\n"
        "    x = np.full(8, comm.rank + 1.0)\n"
        "    comm.allreduce(x)\n"
        f"    path = {str(tmp_path)!r} + f'/rank{{comm.rank}}.txt'\n"
        "    open(path, 'w').write(f'{comm.rank} {comm.local_rank} {comm.local_world_size} '\n"
        "                          f\"{os.environ['HOST_INDEX']} {x[0]:g}\")\n"
    )
    lines: list[str] = []
    with cluster.Cluster(hosts=2, rate="1gbit") as c:
        codes = c.run(c.mpirun_argv([sys.executable, str(script)], per_host=2), timeout=90,
                      on_line=lambda _, line: lines.append(line), on=[0])  # fmt: skip
    assert codes == [0], lines
    written = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert written == ["0 0 2 0 10", "1 1 2 0 10", "2 0 2 1 10", "3 1 2 1 10"], (written, lines)


# ---- faults on the network: a reset connection, a black-holed link ---------------------------

FAULT_SCRIPT = textwrap.dedent(
    """
    import json, time
    import numpy as np
    import asyncreduce as ar

    comm = ar.init(timeout=30)
    x = np.ones(1 << 18, np.float32)
    comm.allreduce(x, name="op")
    print("ready", flush=True)
    try:
        for _ in range(100_000):
            comm.allreduce(x, name="op")
        raise SystemExit("the fault was never noticed")
    except (ar.BrokenError, TimeoutError) as exc:
        print(json.dumps({"rank": comm.rank, "at": time.time(), "type": type(exc).__name__,
                          "message": str(exc)}), flush=True)
    comm.abort("done")
    """
)


def _inject_when_ready(c: Any, fault: list[str], lines: list[tuple[int, str]]) -> dict[str, float]:
    """Start a thread that injects ``fault`` in host 2 once every rank printed "ready"."""
    when: dict[str, float] = {}

    def inject() -> None:
        deadline = time.monotonic() + 60
        while sum(line == "ready" for _, line in lines) < c.hosts:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(0.5)  # the ranks are busy allreducing
        when["at"] = time.time()
        subprocess.run(c.exec_argv(2, fault), capture_output=True, timeout=10)

    threading.Thread(target=inject, daemon=True).start()
    return when


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "argv"),
    [
        ("reset", ["ss", "-K", "state", "established"]),  # every connection of host 2: RST
        ("black-hole", ["ip", "link", "set", "eth0", "down"]),  # host 2 silently cut off
    ],
    ids=["reset", "black-hole"],
)
def test_network_faults_are_named_by_every_rank(
    tmp_path: Path, fault: str, argv: list[str]
) -> None:
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    lines: list[tuple[int, str]] = []
    peer_timeout = 2.0
    with cluster.Cluster(hosts=3, rate="1gbit") as c:
        when = _inject_when_ready(c, argv, lines)
        codes = c.run(
            [sys.executable, str(script)],
            lambda i: {**_rank_env(c, i), "ASYNCREDUCE_PEER_TIMEOUT": str(peer_timeout)},
            timeout=90,
            on_line=lambda host, line: lines.append((host, line)),
        )
    assert codes == [0, 0, 0], lines
    assert "at" in when, "the fault was never injected"
    reports = {r["rank"]: r for r in (json.loads(s) for _, s in lines if s.startswith("{"))}
    assert sorted(reports) == [0, 1, 2], lines
    delays = {rank: r["at"] - when["at"] for rank, r in reports.items()}
    for rank in (0, 1):  # the survivors name the rank that was cut off
        assert "rank 2" in reports[rank]["message"], reports[rank]
    if fault == "reset":
        assert max(delays.values()) < 1.0, delays
        promise = "every rank raises BrokenError naming the cut-off rank, at once"
    else:  # nothing arrives any more: the heartbeat timeout decides, never early
        assert reports[0]["type"] == reports[1]["type"] == "BrokenError", reports
        assert all(peer_timeout - 0.1 <= d <= peer_timeout + 1.0 for d in delays.values()), delays
        promise = f"BrokenError naming it after ASYNCREDUCE_PEER_TIMEOUT={peer_timeout:g} s"
    report(
        f"{fault} of every connection of 1 of 3 emulated hosts (netns, 1 Gbit/s)", promise,
        runs=1, hangs=0, min_s=min(delays.values()), max_s=max(delays.values()),
    )  # fmt: skip
