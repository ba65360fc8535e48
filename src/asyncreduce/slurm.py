"""SLURM: who this task is, from the variables that srun sets.

Theory of operation
-------------------
Pure functions of strings: nothing here reads ``os.environ``; the caller passes it in.

A host list such as ``gpu[01-04,07],login2,rack[1-2]-node[01-02]`` expands as
``scontrol show hostnames`` does (SchedMD's ``src/common/hostlist.c``): names split at commas
and blanks outside brackets; a bracket holds ``N`` and ``N-M`` parts, each number padded to the
width of its part's lower bound, with text before and after. Several brackets make a product in
SLURM's order: the last varies fastest; outside it the one before it is slowest, then back to the
first (for two brackets, the plain product). Duplicates stay. At most ``MAX_HOSTS`` names of at
most 255 characters come out, so a hostile value cannot exhaust memory.

``from_environment`` reads one srun task: rank, step size, rank and task count on its node, the
node's index, and rank 0's address: the first host of the step's node list, port ``15000 + the
job id's last four digits`` (PyTorch Lightning's rule); ``MASTER_ADDR``/``MASTER_PORT`` win.
Every inconsistency is a ``ValueError`` naming the variables, their values and what to fix.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MAX_HOSTS", "SlurmTask", "expand_hostlist", "expand_tasks_per_node", "from_environment"]

MAX_HOSTS = 1_000_000
_MAX_NAME = 255
_SEPARATORS = ", \t\n"
_NUMBER = re.compile(r"[0-9]+")
_INTEGER = re.compile(r"-?[0-9]{1,18}")  # longer is no rank, and int() refuses 4,301+
_TASKS_ITEM = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?")
_SRUN = "run the program under srun, which sets them, or set them consistently"
_NODES = "tasks per node and node list disagree on the number of nodes"
_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

_Bracket = list[tuple[int, int, int]]  # (lo, hi, width) of each part between one [ and its ]
_Nodes = tuple[str, list[str]]  # (variable, hosts) of the step's node list


def expand_hostlist(text: str) -> list[str]:
    """Every host of a SLURM host list, in ``scontrol show hostnames`` order."""
    hosts: list[str] = []
    for name in _names(text):
        hosts += _expand_name(name, MAX_HOSTS - len(hosts))
    if not hosts:
        raise ValueError(f"hostlist {_shown(text)} names no host")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: tasks on each node, as in ``SLURM_TASKS_PER_NODE``."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"tasks per node {_shown(text)}: {item!r} is not N or N(xR)")
        repeat = int(match[2] or 1)
        if repeat < 1 or len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"tasks per node {_shown(text)}: repeat must be 1..{MAX_HOSTS}")
        counts += [int(match[1])] * repeat
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """One srun task: its place in the step, and the rendezvous address of rank 0."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str


def from_environment(env: Mapping[str, str]) -> SlurmTask | None:
    """The task that ``env`` (srun's variables) describes; None when SLURM_PROCID is unset."""
    if "SLURM_PROCID" not in env:
        return None
    _, rank = _int_var(env, "SLURM_PROCID")
    size_var, world_size = _int_var(env, "SLURM_NTASKS", "SLURM_NPROCS")
    if world_size < 1:
        raise ValueError(f"{size_var}={world_size} must be at least 1; {_SRUN}")
    size = f"{size_var}={world_size}"
    _check_index("SLURM_PROCID", rank, size, world_size)
    _, local_rank = _int_var(env, "SLURM_LOCALID")
    _, node_rank = _int_var(env, "SLURM_NODEID", default=0)
    nodes = _node_list(env, node_rank)
    source, local_size = _local_world_size(env, node_rank, (size, world_size), nodes)
    _check_index("SLURM_LOCALID", local_rank, source, local_size)
    addr, job_id = _master_addr(env, nodes), _found(env, "SLURM_JOB_ID", "SLURM_JOBID")
    port, job = _master_port(env, job_id), job_id[1] if job_id else ""
    return SlurmTask(rank, world_size, local_rank, local_size, node_rank, addr, port, job)


def _names(text: str) -> list[str]:
    """The names of a host list, split at separators outside brackets; brackets checked."""
    names, start, inside = [], 0, False
    for at, char in enumerate(text):
        if char == "[" and inside or char == "]" and not inside:
            problem = "'[' inside brackets" if inside else "']' without a '[' before it"
            raise ValueError(f"hostlist {_shown(text)}: {problem} at offset {at}")
        if char in "[]":
            inside = char == "["
        elif char in _SEPARATORS and not inside:
            names.append(text[start:at])
            start = at + 1
    if inside:
        raise ValueError(f"hostlist {_shown(text)}: '[' without a ']' after it")
    return [name for name in [*names, text[start:]] if name]


def _expand_name(name: str, room: int) -> list[str]:
    """The hosts of one name such as ``rack[1-2]-node[01-02]``, at most ``room`` of them."""
    pieces = re.split(r"\[([^\]]*)\]", name)
    texts, brackets = pieces[0::2], [_bracket(name, inner) for inner in pieces[1::2]]
    _check_size(name, texts, brackets, room)
    numbers = [
        [f"{n:0{w}d}" for lo, hi, w in bracket for n in range(lo, hi + 1)] for bracket in brackets
    ]
    last = len(brackets) - 1
    order = [*range(last - 1, -1, -1), last] if brackets else []
    hosts = []
    for picked in itertools.product(*(numbers[b] for b in order)):
        number_of = dict(zip(order, picked, strict=True))
        hosts.append(texts[0] + "".join(number_of[b] + texts[b + 1] for b in range(last + 1)))
    return hosts


def _bracket(name: str, inner: str) -> _Bracket:
    """``01-04,07`` -> ``[(1, 4, 2), (7, 7, 2)]``."""
    parts = []
    for part in inner.split(","):
        lo_text, dash, hi_text = part.partition("-")
        hi_text = hi_text if dash else lo_text
        bad = f"hostlist name {_shown(name)}: range part {_shown(part)}"
        if not lo_text or not hi_text:
            raise ValueError(f"{bad} is empty or lacks a bound (want N or N-M)")
        if not (_NUMBER.fullmatch(lo_text) and _NUMBER.fullmatch(hi_text)):
            raise ValueError(f"{bad} has a bound that is not a number")
        if len(part) > _MAX_NAME:
            raise ValueError(f"{bad} is too long")
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"{bad} ends below its start")
        parts.append((lo, hi, len(lo_text)))
    return parts


def _check_size(name: str, texts: list[str], brackets: list[_Bracket], room: int) -> None:
    """Refuse a name that expands to more than ``room`` hosts or to overlong host names."""
    longest = sum(map(len, texts)) + sum(
        max(max(w, len(str(hi))) for _, hi, w in bracket) for bracket in brackets
    )
    if longest > _MAX_NAME:
        raise ValueError(f"hostlist name {_shown(name)}: host names would exceed {_MAX_NAME} chars")
    count = 1
    for bracket in brackets:
        count *= sum(hi - lo + 1 for lo, hi, _ in bracket)
        if count > room:
            raise ValueError(f"hostlist name {_shown(name)}: more than {MAX_HOSTS} hosts in all")


def _shown(text: str) -> str:
    """``text`` quoted, cut to 80 characters so that a hostile value cannot flood a log."""
    return repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters)"


def _found(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` that ``env`` sets."""
    return next(((name, env[name]) for name in names if name in env), None)


def _int_var(env: Mapping[str, str], *names: str, default: int | None = None) -> tuple[str, int]:
    """(name, integer value) of the first of ``names`` set; ``default`` or an error if none."""
    found = _found(env, *names)
    if found is None and default is not None:
        return names[0], default
    if found is None:
        raise ValueError(f"SLURM_PROCID is set but not {' or '.join(names)}; {_SRUN}")
    if not _INTEGER.fullmatch(found[1]):
        raise ValueError(f"{found[0]}={_shown(found[1])} is not an integer; {_SRUN}")
    return found[0], int(found[1])


def _check_index(name: str, value: int, bound: str, size: int) -> None:
    """Refuse ``value`` of variable ``name`` unless in 0..size-1; ``bound`` says whence size."""
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is outside 0..{size - 1} (from {bound}); {_SRUN}")


def _node_list(env: Mapping[str, str], node_rank: int) -> _Nodes | None:
    """(variable, hosts) of the step's node list, checked to hold node ``node_rank``."""
    found = _found(env, *_NODE_LISTS)
    if found is None:
        return None
    try:
        hosts = expand_hostlist(found[1])
    except ValueError as error:
        raise ValueError(f"{found[0]}: {error}") from None
    _check_index("SLURM_NODEID", node_rank, f"{found[0]}={_shown(found[1])}", len(hosts))
    return found[0], hosts


def _local_world_size(
    env: Mapping[str, str], node_rank: int, size: tuple[str, int], nodes: _Nodes | None
) -> tuple[str, int]:
    """(where from, tasks on this node): the step's tasks per node, SLURM_NTASKS_PER_NODE, or 1."""
    found = _found(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is None:
        name, count = _int_var(env, "SLURM_NTASKS_PER_NODE", default=1)
        return (f"{name}={count}" if name in env else "no tasks per node set: 1"), count
    name, text = found
    try:
        counts = expand_tasks_per_node(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    if sum(counts) != size[1]:
        raise ValueError(f"{name}={_shown(text)} sums to {sum(counts)}, not {size[0]}: {_SRUN}")
    if nodes is not None and len(nodes[1]) != len(counts):
        raise ValueError(f"{name}={_shown(text)} but {nodes[0]}={_shown(env[nodes[0]])}: {_NODES}")
    _check_index("SLURM_NODEID", node_rank, f"{name}={_shown(text)}", len(counts))
    return f"{name}={_shown(text)} on node {node_rank}", counts[node_rank]


def _master_addr(env: Mapping[str, str], nodes: _Nodes | None) -> str:
    """MASTER_ADDR when set, else the first host of the step's node list."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if nodes is None:
        raise ValueError(f"{', '.join(_NODE_LISTS)} all unset: set MASTER_ADDR, or {_SRUN}")
    return nodes[1][0]


def _master_port(env: Mapping[str, str], job_id: tuple[str, str] | None) -> int:
    """MASTER_PORT when set, else 15000 + the last four digits of the job id (Lightning's)."""
    port = env.get("MASTER_PORT")
    if port:
        if not (_NUMBER.fullmatch(port) and len(port) <= 5 and 1 <= int(port) <= 65535):
            raise ValueError(f"MASTER_PORT={_shown(port)} is not a port number (1..65535); fix it")
        return int(port)
    digits = "".join(re.findall(r"[0-9]", job_id[1] if job_id else ""))
    if not digits:
        where = f"{job_id[0]}={_shown(job_id[1])} has no digits" if job_id else "no SLURM_JOB_ID"
        raise ValueError(f"{where} to derive the port from (15000 + last 4): set MASTER_PORT")
    return 15000 + int(digits[-4:])
