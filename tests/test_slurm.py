"""SLURM host lists, tasks per node, and the task that srun's environment describes.

Expected host lists are what ``scontrol show hostnames`` prints (SchedMD's
``src/common/hostlist.c``). Environments are built the way srun sets them for each task: the
job's variables (``SLURM_JOB_*``, ``SLURM_TASKS_PER_NODE``) and the step's (``SLURM_STEP_*``,
``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``), plus a few that do not matter here.
"""

from __future__ import annotations

import pytest

from asyncreduce.slurm import (
    MAX_HOSTS,
    SlurmTask,
    expand_hostlist,
    expand_tasks_per_node,
    from_environment,
)

# ----------------------------------------------------------------------------- host lists


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("login2", ["login2"]),
        ("a,b", ["a", "b"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("gpu[3]", ["gpu3"]),
        ("gpu[03,5]", ["gpu03", "gpu5"]),
        ("tux[1-3]-ib", ["tux1-ib", "tux2-ib", "tux3-ib"]),
        ("node[1-2].cluster", ["node1.cluster", "node2.cluster"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        (
            "gpu[01-04,07],login2,cpu[1-2]",
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login2", "cpu1", "cpu2"],
        ),
        ("node-1.cluster", ["node-1.cluster"]),
        ("node-1.cluster,node-2.cluster", ["node-1.cluster", "node-2.cluster"]),
        (" a , b[1-2] ,c", ["a", "b1", "b2", "c"]),
        ("a b\tc\nd", ["a", "b", "c", "d"]),  # SLURM's separators are ", \t\n"
        ("a,,b", ["a", "b"]),  # SLURM skips empty names between separators
        ("n[1-2],n[2],n1", ["n1", "n2", "n2", "n1"]),  # duplicates kept, order kept
        ("n[3-1000]", [f"n{i}" for i in range(3, 1001)]),
    ],
)
def test_hostlist_expands_like_scontrol(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


def test_three_brackets_follow_slurms_own_order() -> None:
    # hostlist.c's _push_range_list: the last bracket varies fastest; the earlier ones are
    # expanded from the one just before it (outermost) back to the first.
    assert expand_hostlist("a[1-2]b[3-4]c[5-6]") == [
        "a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "quoted", "reason"),
    [
        ("", "''", "names no host"),
        (" , ,", "' , ,'", "names no host"),
        ("gpu[01-04", "'gpu[01-04'", "'[' without a ']'"),
        ("gpu01-04]", "'gpu01-04]'", "']' without a '['"),
        ("a[1-2],b[3", "'a[1-2],b[3'", "'[' without a ']'"),
        ("a[1[2]]", "'a[1[2]]'", "'[' inside brackets"),
        ("n[]", "'n[]'", "is empty"),
        ("n[1,,3]", "'n[1,,3]'", "is empty"),
        ("n[1-]", "'1-'", "lacks a bound"),
        ("n[-3]", "'-3'", "lacks a bound"),
        ("n[5-3]", "'5-3'", "ends below its start"),
        ("n[a-c]", "'a-c'", "not a number"),
        ("n[1-2-3]", "'1-2-3'", "not a number"),
        ("n[01, 03]", "' 03'", "not a number"),
        ("n[+1]", "'+1'", "not a number"),
        ("n[\u0661]", "'\u0661'", "not a number"),  # an Arabic-Indic digit one: not ASCII
    ],
)
def test_malformed_hostlist_names_the_bad_text(text: str, quoted: str, reason: str) -> None:
    with pytest.raises(ValueError) as raised:
        expand_hostlist(text)
    assert quoted in str(raised.value)
    assert reason in str(raised.value)


def test_hostlist_of_exactly_the_cap_expands() -> None:
    hosts = expand_hostlist(f"n[1-{MAX_HOSTS}]")
    assert len(hosts) == MAX_HOSTS == 1_000_000
    assert (hosts[0], hosts[-1]) == ("n1", "n1000000")


@pytest.mark.parametrize(
    "text",
    [
        f"n[0-{MAX_HOSTS}]",  # one over, in one range
        "n[0-99999999999999999999999999]",  # far over
        "a[0-999]b[0-1000]",  # over only as a product
        "a[1-600000],b[1-400001]",  # over only in all
        "a[0-9]" * 7,
    ],
)
def test_hostlist_over_the_cap_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="more than 1000000 hosts"):
        expand_hostlist(text)  # counted before any name is built, so even 10**26 fails at once


def test_overlong_host_names_and_huge_input_are_refused_briefly() -> None:
    with pytest.raises(ValueError, match="exceed 255 chars"):
        expand_hostlist("x" * 250 + "[1-100000]")
    with pytest.raises(ValueError, match="too long"):
        expand_hostlist("n[" + "0" * 10_000 + "1]")
    with pytest.raises(ValueError) as raised:
        expand_hostlist("n" * 1_000_000 + "[")
    assert "1000001 characters" in str(raised.value)
    assert len(str(raised.value)) < 300


# ----------------------------------------------------------------------------- tasks per node


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("1,3(x2)", [1, 3, 3]),
        ("8(x1)", [8]),
        ("2(x2),1,3(x2)", [2, 2, 1, 3, 3]),
        (" 2(x2), 1 ", [2, 2, 1]),
    ],
)
def test_tasks_per_node_expands(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


MALFORMED_TASKS = ["", "x3", "2(x)", "2(3)", "2(x3", "2x3", "2(x0)", "2,,1", "-1", "2.5"]


@pytest.mark.parametrize("text", [*MALFORMED_TASKS, "1(x2000000)", "9" * 5000])
def test_malformed_tasks_per_node_names_the_text(text: str) -> None:
    with pytest.raises(ValueError) as raised:
        expand_tasks_per_node(text)
    assert repr(text[:80]) in str(raised.value)  # long values are cut to 80 characters


# ----------------------------------------------------------------------------- environments


def srun_env(
    rank: int, ntasks: int, nodes: str, tasks_per_node: str, node_id: int, local_id: int,
    job_id: str = "123456", job_nodes: str | None = None, job_tasks: str | None = None,
) -> dict[str, str]:  # fmt: skip
    """The variables srun sets for one task of a step (job-level ones default to the step's)."""
    job_nodes, job_tasks = job_nodes or nodes, job_tasks or tasks_per_node
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": job_nodes, "SLURM_NODELIST": job_nodes,
        "SLURM_TASKS_PER_NODE": job_tasks,
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_id), "SLURM_NODEID": str(node_id),
        "SLURM_CPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": "/home/u", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
    }  # fmt: skip


def one_node(rank: int) -> dict[str, str]:
    return srun_env(rank, 4, "gpu07", "4", node_id=0, local_id=rank)


def three_nodes(rank: int) -> dict[str, str]:
    return srun_env(rank, 6, "gpu[01-03]", "2(x3)", node_id=rank // 2, local_id=rank % 2)


def test_no_slurm_procid_means_not_srun() -> None:
    assert from_environment({}) is None
    no_procid = {k: v for k, v in one_node(0).items() if k != "SLURM_PROCID"}
    assert from_environment(no_procid) is None


@pytest.mark.parametrize("rank", range(4))
def test_one_node_with_four_tasks(rank: int) -> None:
    assert from_environment(one_node(rank)) == SlurmTask(
        rank=rank, world_size=4, local_rank=rank, local_world_size=4, node_rank=0,
        master_addr="gpu07", master_port=18456, job_id="123456",
    )  # fmt: skip


@pytest.mark.parametrize(("rank", "node", "local"), [(0, 0, 0), (3, 1, 1), (5, 2, 1)])
def test_three_nodes_two_tasks_each(rank: int, node: int, local: int) -> None:
    assert from_environment(three_nodes(rank)) == SlurmTask(
        rank=rank, world_size=6, local_rank=local, local_world_size=2, node_rank=node,
        master_addr="gpu01", master_port=18456, job_id="123456",
    )  # fmt: skip


def test_uneven_tasks_per_node_give_each_node_its_own_count() -> None:
    env = srun_env(4, 5, "cpu[1-3]", "2,1,2", node_id=2, local_id=1)
    task = from_environment(env)
    assert task is not None
    assert (task.node_rank, task.local_rank, task.local_world_size) == (2, 1, 2)


@pytest.mark.parametrize(
    ("job_id", "port"), [("123456", 18456), ("42", 15042), ("1234567", 19567), ("7", 15007)]
)
def test_master_port_from_the_job_ids_last_four_digits(job_id: str, port: int) -> None:
    task = from_environment({**one_node(0), "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id})
    assert task is not None
    assert (task.master_port, task.job_id) == (port, job_id)


def test_slurm_jobid_is_the_fallback_for_slurm_job_id() -> None:
    env = {k: v for k, v in one_node(0).items() if k != "SLURM_JOB_ID"} | {"SLURM_JOBID": "9876"}
    task = from_environment(env)
    assert task is not None
    assert (task.job_id, task.master_port) == ("9876", 24876)


def test_users_master_addr_and_port_win() -> None:
    task = from_environment({**three_nodes(3), "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert task is not None
    assert (task.master_addr, task.master_port) == ("10.1.2.3", 29500)
    assert (task.rank, task.node_rank) == (3, 1)


def test_empty_master_addr_and_port_count_as_unset() -> None:
    task = from_environment({**one_node(0), "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert task is not None
    assert (task.master_addr, task.master_port) == ("gpu07", 18456)


def test_step_node_list_wins_over_the_jobs() -> None:
    # a step of 2 tasks on the last 2 of the job's 4 nodes
    env = srun_env(1, 2, "gpu[03-04]", "1(x2)", node_id=1, local_id=0,
                   job_nodes="gpu[01-04]", job_tasks="1(x4)")  # fmt: skip
    task = from_environment(env)
    assert task is not None
    assert (task.master_addr, task.node_rank, task.world_size) == ("gpu03", 1, 2)
    assert task.local_world_size == 1


def test_node_list_falls_back_to_the_jobs_then_slurm_nodelist() -> None:
    env = {k: v for k, v in three_nodes(2).items() if k != "SLURM_STEP_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "big[7-9]"
    assert getattr(from_environment(env), "master_addr", None) == "big7"
    del env["SLURM_JOB_NODELIST"]
    assert getattr(from_environment(env), "master_addr", None) == "gpu01"


def test_tasks_per_node_falls_back_to_the_jobs_then_ntasks_per_node_then_one() -> None:
    env = {k: v for k, v in three_nodes(1).items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert getattr(from_environment(env), "local_world_size", None) == 2
    del env["SLURM_TASKS_PER_NODE"]
    env["SLURM_NTASKS_PER_NODE"] = "3"
    assert getattr(from_environment(env), "local_world_size", None) == 3
    del env["SLURM_NTASKS_PER_NODE"]
    env["SLURM_LOCALID"] = "0"
    assert getattr(from_environment(env), "local_world_size", None) == 1


def test_slurm_nprocs_is_the_fallback_for_slurm_ntasks() -> None:
    env = {k: v for k, v in three_nodes(5).items() if k != "SLURM_NTASKS"}
    assert getattr(from_environment(env), "world_size", None) == 6


def test_local_rank_beyond_the_default_of_one_task_per_node_is_refused() -> None:
    env = drop(three_nodes(1), "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    with pytest.raises(ValueError, match="SLURM_LOCALID=1 is outside 0..0"):
        from_environment(env)
    with pytest.raises(ValueError, match="SLURM_NTASKS_PER_NODE=1"):
        from_environment({**env, "SLURM_NTASKS_PER_NODE": "1"})


def test_node_id_defaults_to_zero() -> None:
    env = {k: v for k, v in one_node(1).items() if k != "SLURM_NODEID"}
    assert getattr(from_environment(env), "node_rank", None) == 0


def drop(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (drop(one_node(0), "SLURM_NTASKS", "SLURM_NPROCS"), ["SLURM_NTASKS", "srun"]),
        (drop(one_node(0), "SLURM_LOCALID"), ["SLURM_LOCALID"]),
        ({**one_node(0), "SLURM_PROCID": "zero"}, ["SLURM_PROCID='zero'", "not an integer"]),
        ({**one_node(0), "SLURM_NTASKS": "4 "}, ["SLURM_NTASKS='4 '", "not an integer"]),
        ({**one_node(0), "SLURM_LOCALID": "1.0"}, ["SLURM_LOCALID='1.0'", "not an integer"]),
        ({**one_node(0), "SLURM_NODEID": "a"}, ["SLURM_NODEID='a'", "not an integer"]),
        ({**one_node(0), "SLURM_NTASKS": "0"}, ["SLURM_NTASKS=0", "at least 1"]),
        ({**one_node(0), "SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "0..3", "SLURM_NTASKS=4"]),
        ({**one_node(0), "SLURM_PROCID": "-1"}, ["SLURM_PROCID=-1", "0..3"]),
        (drop({**one_node(0), "SLURM_PROCID": "4"}, "SLURM_NTASKS"), ["SLURM_NPROCS=4"]),
        ({**one_node(3), "SLURM_LOCALID": "4"},
         ["SLURM_LOCALID=4", "0..3", "SLURM_STEP_TASKS_PER_NODE='4' on node 0"]),
        ({**three_nodes(5), "SLURM_NODEID": "3"},
         ["SLURM_NODEID=3", "0..2", "SLURM_STEP_NODELIST='gpu[01-03]'"]),
        ({**three_nodes(5), "SLURM_JOB_ID": "abc"}, ["SLURM_JOB_ID='abc'", "MASTER_PORT"]),
        (drop(three_nodes(5), "SLURM_JOB_ID", "SLURM_JOBID"), ["no SLURM_JOB_ID", "MASTER_PORT"]),
        ({**one_node(0), "MASTER_PORT": "http"}, ["MASTER_PORT='http'", "not a port"]),
        ({**one_node(0), "MASTER_PORT": "70000"}, ["MASTER_PORT='70000'", "1..65535"]),
        ({**one_node(0), "MASTER_PORT": "0"}, ["MASTER_PORT='0'", "not a port"]),
        ({**one_node(0), "MASTER_PORT": "9" * 5000}, ["MASTER_PORT='999", "not a port"]),
        ({**one_node(0), "SLURM_PROCID": "9" * 5000}, ["SLURM_PROCID='999", "not an integer"]),
        ({**three_nodes(0), "SLURM_NTASKS": "5", "SLURM_PROCID": "0"},
         ["SLURM_STEP_TASKS_PER_NODE='2(x3)'", "sums to 6, not SLURM_NTASKS=5"]),
        ({**three_nodes(0), "SLURM_STEP_TASKS_PER_NODE": "3(x2)"},
         ["SLURM_STEP_TASKS_PER_NODE='3(x2)'", "SLURM_STEP_NODELIST='gpu[01-03]'", "nodes"]),
        ({**three_nodes(0), "SLURM_STEP_TASKS_PER_NODE": "2[x3]"},
         ["SLURM_STEP_TASKS_PER_NODE", "'2[x3]'"]),
        ({**three_nodes(0), "SLURM_STEP_NODELIST": "gpu[01-03"},
         ["SLURM_STEP_NODELIST", "'gpu[01-03'"]),
        (drop(three_nodes(0), "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
         ["SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST all unset", "MASTER_ADDR"]),
    ],
)  # fmt: skip
def test_inconsistent_environment_says_what_and_where(
    env: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as raised:
        from_environment(env)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_bad_job_id_is_fine_when_master_port_is_given() -> None:
    task = from_environment({**one_node(0), "SLURM_JOB_ID": "abc", "MASTER_PORT": "29400"})
    assert task is not None
    assert (task.master_port, task.job_id) == (29400, "abc")


def test_node_list_is_optional_when_master_addr_is_given() -> None:
    env = drop(one_node(2), "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    task = from_environment({**env, "MASTER_ADDR": "head"})
    assert task is not None
    assert (task.master_addr, task.rank, task.local_world_size) == ("head", 2, 4)


def test_slurm_task_is_frozen() -> None:
    task = from_environment(one_node(0))
    assert task is not None
    with pytest.raises(AttributeError):
        task.rank = 1  # type: ignore[misc]
