"""The harness the benchmarks share: worker sets of ranks, their reports, and the output.

Theory of operation
-------------------
Each benchmark script is both the parent and its own worker, as ``allreduce.py`` is. The parent
never communicates: for every (library, N) it starts one fresh set of N ranks that runs every
variant of that benchmark (``workers``), then reads what rank 0 reports. The parent passes its
resolved settings to the workers as one JSON argument, so both sides read the same numbers; a
worker (``ranks``) joins the job as a ``Rank`` and reports as ``MARK``-prefixed JSON lines:
``ready``, then any number of ``start``, ``result`` and ``note``, then ``done``. The parent
waits for each line at most ``step_s`` seconds and for the whole set at most ``limit_s``; on a
timeout, a failed rank, an exception or Ctrl-C it kills every worker's process group and
records the failure. Workers exit by themselves when the parent disappears or their own
deadline passes.

``allreduce.py`` and ``links.py`` run their own protocol, but share the pieces: sizes and units
(``units``), the command-line checks (``cli``), the worker set (``SetSpec`` says how it
differs), the parent's loop over its reports (``drive_set``), the machine's description
(``machine``) and the output (``report``). ``scaling.py`` and ``overlap.py --hosts`` run sets
inside an emulated cluster, one rank per host (``cluster``). ``main`` is the ``main`` of a
benchmark on this protocol: parent or worker, then report, JSON and plot.

The benchmarks put their own folder on ``sys.path`` and ``import harness``; this module
re-exports what they use.
"""

from __future__ import annotations

from .cli import (
    LIBS,
    base_parser,
    checked,
    comma_list,
    host_count,
    lib_list,
    nprocs_list,
    parse,
)
from .cluster import (
    MPI_FORWARD,
    Hosts,
    cluster_env,
    cluster_mpirun,
    cluster_unavailable,
    load_module,
    run_cluster_set,
    run_set_in_cluster,
)
from .machine import (
    LoadWatch,
    cpu_model,
    library_state,
    load_words,
    machine_info,
    machine_line,
    package_root,
)
from .main import Benchmark, SetRunner, bench_main, finish, parent_main, replay, skip_unavailable
from .ranks import (
    MARK,
    AsyncReduceRank,
    GlooRank,
    MpiRank,
    Rank,
    Tell,
    connect,
    median,
    timed,
    watchdog,
    worker_main,
)
from .report import (
    fmt_ms,
    json_head,
    preamble,
    pyplot,
    render_table,
    report_per_n,
    save_figure,
    save_json,
    write_json,
)
from .units import DTYPE_BYTES, busbw_gbps, format_size, parse_size
from .workers import (
    STARTUP_S,
    Progress,
    Run,
    SetSpec,
    WorkerSetError,
    drive_set,
    failure_of,
    run_set,
    set_tag,
    unavailable,
    under_mpirun,
    worker_command,
)

__all__ = [
    "DTYPE_BYTES",
    "LIBS",
    "MARK",
    "MPI_FORWARD",
    "STARTUP_S",
    "AsyncReduceRank",
    "Benchmark",
    "GlooRank",
    "Hosts",
    "MpiRank",
    "Progress",
    "Rank",
    "Run",
    "SetRunner",
    "SetSpec",
    "Tell",
    "WorkerSetError",
    "base_parser",
    "bench_main",
    "busbw_gbps",
    "checked",
    "cluster_env",
    "cluster_mpirun",
    "cluster_unavailable",
    "comma_list",
    "connect",
    "cpu_model",
    "drive_set",
    "failure_of",
    "finish",
    "fmt_ms",
    "format_size",
    "host_count",
    "json_head",
    "lib_list",
    "library_state",
    "LoadWatch",
    "load_module",
    "load_words",
    "machine_info",
    "machine_line",
    "median",
    "nprocs_list",
    "package_root",
    "parent_main",
    "parse",
    "parse_size",
    "preamble",
    "pyplot",
    "render_table",
    "replay",
    "report_per_n",
    "run_cluster_set",
    "run_set",
    "run_set_in_cluster",
    "save_figure",
    "save_json",
    "set_tag",
    "skip_unavailable",
    "timed",
    "unavailable",
    "under_mpirun",
    "watchdog",
    "worker_command",
    "worker_main",
    "write_json",
]
