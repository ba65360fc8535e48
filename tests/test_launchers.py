"""Joining a job under the launchers people use, each started for real (torchrun in all its
forms, mpirun), or, where no such launcher exists here (srun), in exactly the environment it
sets and nothing more; and the environments that contradict themselves, which must fail at
once naming the variables."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncreduce.errors import UsageError
from asyncreduce.launchers import detect
from spmd import free_port

SCRIPT = """
import numpy as np, asyncreduce as ar
with ar.init(timeout=30) as comm:
    x = np.full(4, comm.rank + 1.0)
    comm.allreduce(x)
    lane = getattr(comm._backend, "lane", None)  # the same-host lane, where it is open
    print(f"rank {comm.rank} of {comm.world_size} local {comm.local_rank} of "
          f"{comm.local_world_size} sum {x[0]:g} lane {comm.data_plane.lane} "
          f"took {0 if lane is None else lane.completed}", flush=True)
"""

#: launcher variables that must not leak from the test's own environment into a job
_LAUNCHER_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|"
    r"ASYNCREDUCE_RUN|SLURM_.*|OMPI_.*|PMI_.*|PMIX_.*|MV2_.*|MPI_LOCAL.*)$"
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    return {**env, **extra}


def sums(output: str, world: int) -> list[tuple[int, int, int]]:
    """(rank, local rank, local world size) of every rank that printed the right sum."""
    total = world * (world + 1) // 2
    found = re.findall(rf"rank (\d+) of {world} local (\d+) of (\d+) sum {total}(?!\d)", output)
    return sorted((int(r), int(lr), int(lw)) for r, lr, lw in found)


def on_the_lane(output: str) -> int:
    """How many ranks said their small allreduce went through the same-host lane (every rank
    of these jobs is on this one host, so every one should)."""
    return len(re.findall(r"sum \d+ lane True took 1(?!\d)", output))


def torchrun(*args: str, script: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(script)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or clean_env())  # fmt: skip


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


# ---- torchrun, for real ------------------------------------------------------------------------

needs_torch = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torchrun needs torch"
)


@needs_torch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["standalone", "static", "c10d"])
def test_torchrun_joins_through_its_agents_store(script: Path, form: str) -> None:
    port = str(free_port())
    args = {
        "standalone": ["--standalone"],
        "static": ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", port],
        "c10d": ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"],
    }[form]  # fmt: skip
    job = torchrun(*args, "--nproc-per-node", "3", script=script)
    out, _ = job.communicate(timeout=100)
    assert job.returncode == 0, out
    assert sums(out, 3) == [(0, 0, 3), (1, 1, 3), (2, 2, 3)], out
    assert on_the_lane(out) == 3, out
    assert "Address already in use" not in out


@needs_torch
@pytest.mark.timeout(120)
def test_torchrun_across_nodes(script: Path) -> None:
    """Two agents (``--nnodes 2 --node-rank 0|1``), two ranks each."""
    port = str(free_port())
    nodes = [
        torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", port, script=script)
        for node in (0, 1)
    ]  # fmt: skip
    out = "".join(node.communicate(timeout=100)[0] for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], out
    assert sums(out, 4) == [(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)], out
    assert on_the_lane(out) == 4, out  # two "nodes", one host: still one host's mailboxes


@needs_torch
@pytest.mark.timeout(120)
def test_torchrun_with_a_secret_still_authenticates_our_connections(script: Path) -> None:
    job = torchrun("--standalone", "--nproc-per-node", "2", script=script,
                   env=clean_env(ASYNCREDUCE_SECRET="s3cret-for-this-test"))  # fmt: skip
    out, _ = job.communicate(timeout=100)
    assert job.returncode == 0 and sums(out, 2) == [(0, 0, 2), (1, 1, 2)], out
    # a rank without the secret cannot join the others' mesh
    mixed = tmp_script = script.with_name("mixed.py")
    tmp_script.write_text(
        "import os\nif os.environ['RANK'] == '1': os.environ.pop('ASYNCREDUCE_SECRET')\n"
        + SCRIPT.replace("timeout=30", "timeout=10")
    )
    job = torchrun("--standalone", "--nproc-per-node", "2", script=mixed,
                   env=clean_env(ASYNCREDUCE_SECRET="s3cret-for-this-test"))  # fmt: skip
    out, _ = job.communicate(timeout=100)
    assert job.returncode != 0 and "AuthenticationError" in out, out


# ---- srun: the environment it sets, exactly ----------------------------------------------------


def srun_env(task: int, ntasks: int, port: int) -> dict[str, str]:
    """What ``srun -N1 -n NTASKS`` gives task TASK of a job allocated 4 nodes, the step on the
    first (job id chosen so the derived port is ``port``): no MASTER_ADDR, no RANK."""
    job_id = f"77{port - 15000:04d}"
    return clean_env(
        SLURM_PROCID=str(task), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks),
        SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NUM_NODES="4",
        SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost,gpu[02-04]",
        SLURM_NODELIST="localhost,gpu[02-04]", SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE=str(ntasks), SLURM_TASKS_PER_NODE=f"{ntasks}(x4)",
        SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_STEP_ID="0", SLURMD_NODENAME="localhost",
    )  # fmt: skip


def free_slurm_port() -> int:
    for _ in range(50):
        port = free_port()
        if 15000 <= port < 25000:
            return port
    return 15000 + os.getpid() % 10000


@pytest.mark.timeout(90)
def test_srun_environment_alone_is_enough(script: Path) -> None:
    port = free_slurm_port()
    ranks = [subprocess.Popen([sys.executable, str(script)], env=srun_env(t, 3, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for t in range(3)]  # fmt: skip
    out = "".join(r.communicate(timeout=60)[0] for r in ranks)
    assert [r.returncode for r in ranks] == [0, 0, 0], out
    assert sums(out, 3) == [(0, 0, 3), (1, 1, 3), (2, 2, 3)], out


# ---- mpirun, for real --------------------------------------------------------------------------

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")


def mpirun(n: int, script: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = ["mpirun", "-n", str(n), "--allow-run-as-root", "--oversubscribe", *extra,
           sys.executable, str(script)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=clean_env())


@needs_mpirun
@pytest.mark.timeout(120)
def test_mpirun_on_one_host_needs_nothing_more(script: Path) -> None:
    out = mpirun(3, script)
    assert out.returncode == 0, out.stdout + out.stderr
    # mpirun forwards every rank's output through one pipe: lines may run together
    assert len(re.findall(r"rank \d of 3 local \d of 3 sum 6", out.stdout)) == 3, out.stdout
    assert on_the_lane(out.stdout) == 3, out.stdout


@needs_mpirun
@pytest.mark.timeout(120)
def test_a_rank_left_in_the_environment_of_mpirun_is_refused(script: Path) -> None:
    start = time.monotonic()
    out = mpirun(2, script, "-x", "RANK=0", "-x", "WORLD_SIZE=2")
    assert out.returncode != 0
    assert "RANK=0 but OMPI_COMM_WORLD_RANK=1" in out.stdout + out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 60


# ---- contradictions, in real processes ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_ranks_told_different_world_sizes_all_fail_at_once(script: Path) -> None:
    port = str(free_port())
    sizes = {0: "2", 1: "3"}
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE=sizes[r],
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]  # fmt: skip
    start = time.monotonic()
    outs = [r.communicate(timeout=50)[0] for r in ranks]
    assert time.monotonic() - start < 15, "a disagreement must not wait out the timeout"
    for rank, out in enumerate(outs):
        assert ranks[rank].returncode != 0, out
        assert "UsageError" in out and "rank 0 was told 2, rank 1 3" in out, out


# ---- the environment read, in one process -------------------------------------------------------


def test_torchrun_inside_srun_is_torchrun() -> None:
    env = {**srun_env(0, 2, 15001), "TORCHELASTIC_RUN_ID": "x",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "5", "WORLD_SIZE": "8",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
           "MASTER_PORT": "29500"}  # fmt: skip
    place = detect(env=env)
    assert (place.rank, place.world_size, place.local_rank) == (5, 8, 1)
    assert place.launcher == "torchrun"
    meeting = place.rendezvous
    assert (meeting.kind, meeting.host, meeting.port) == ("agent", "h", 29500)


def test_mpirun_inside_an_sbatch_script_is_mpirun() -> None:
    env = {**srun_env(0, 1, 15001), "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500"}  # fmt: skip
    place = detect(env=env)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (3, 4, 1, 2)
    assert place.launcher == "mpirun (Open MPI)"


@pytest.mark.parametrize(
    ("family", "variables"),
    [
        ("Hydra", {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0",
                   "MPI_LOCALNRANKS": "1"}),
        ("MVAPICH", {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "3",
                     "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1"}),
        ("PMIx", {"PMIX_RANK": "2", "SLURM_NTASKS": "3"}),
    ],
)  # fmt: skip
def test_other_mpi_launchers(family: str, variables: dict[str, str]) -> None:
    place = detect(env={**variables, "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (place.rank, place.world_size, place.launcher) == (2, 3, f"mpirun ({family})")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE not set though RANK is"),
        ({"WORLD_SIZE": "2"}, "RANK not set though WORLD_SIZE is"),
        ({"RANK": "two", "WORLD_SIZE": "2"}, "RANK='two' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         "rank 2 is not within"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0"},
         "RANK=0 but OMPI_COMM_WORLD_RANK=1"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0"},
         "OMPI_COMM_WORLD_RANK=1 but PMIX_RANK=0"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
         "WORLD_SIZE=4 but OMPI_COMM_WORLD_SIZE=2"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "RANK": "0",
          "SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"},
         "RANK=0 but SLURM_PROCID=1"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "set MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
         "MASTER_PORT must be a port number"),
        ({"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0",
          "WORLD_SIZE": "2"}, "not MASTER_ADDR and MASTER_PORT"),
        ({}, "rank and world_size are unknown"),
    ],
)  # fmt: skip
def test_contradicting_or_missing_environments_are_usage_errors(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        detect(env=env)


def test_arguments_win_over_the_environment() -> None:
    place = detect(1, 2, "127.0.0.1", 1234, env={"RANK": "0", "WORLD_SIZE": "5"})
    assert (place.rank, place.world_size, place.launcher) == (1, 2, "arguments")
    assert (place.rendezvous.kind, place.rendezvous.port) == ("serve", 1234)


@pytest.mark.parametrize("pmi", [{"PMIX_RANK": "1"}, {"PMI_RANK": "1", "PMI_SIZE": "3"}])
def test_srun_with_a_pmi_plugin_is_still_srun(pmi: dict[str, str]) -> None:
    """Clusters with MpiDefault=pmix (or pmi2) give srun's tasks PMI variables too."""
    from asyncreduce.launchers import detect

    place = detect(env={**srun_env(1, 3, 15123), **pmi})
    assert place.launcher == "srun" and (place.rank, place.world_size) == (1, 3)
    assert place.local_rank == 1


def test_mpirun_inside_an_allocation_is_mpirun() -> None:
    """Every rank of an mpirun in an salloc shell inherits SLURM_PROCID=0."""
    from asyncreduce.launchers import detect

    env = {**srun_env(0, 1, 15123), "PMIX_RANK": "2", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_SIZE": "4"}  # fmt: skip
    place = detect(env=env)
    assert place.launcher.startswith("mpirun") and (place.rank, place.world_size) == (2, 4)

