"""The ``asyncreduce`` command line: ``run`` (the local launcher) and ``bench``.

Theory of operation
-------------------
``main`` parses with argparse and dispatches to one subcommand; it always *returns* the exit
code (argparse's own exits, 2 for bad arguments and 0 for ``--help``, are caught and returned)
so that the console script and ``python -m asyncreduce`` both end with ``SystemExit(main())``.

``asyncreduce run -n N [--master-addr A] [--master-port P] [--grace S] [--] prog args...``
hands everything from the program on to it untouched: options after the program name are the
program's, not ours, and a ``--`` before the program is optional. See ``asyncreduce.launch``.

``asyncreduce culprit DIR|FILE...`` reads flight-record dumps (see ``asyncreduce.flight``) of
the ranks of one job and prints what went wrong first; it exits 1 when it found something.

``asyncreduce bench args...`` imports ``asyncreduce.bench`` only when asked, so the launcher
never pays for (or breaks on) the benchmark's imports, and passes it the rest of the line
verbatim (``--help`` included: the benchmark owns its options).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from asyncreduce import launch
from asyncreduce.argtypes import integer, port, positive_int, seconds

__all__ = ["main"]

_RUN_EXAMPLE = "asyncreduce run -n 2 train.py --epochs 3"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark, options too
        return _bench(argv[1:])
    try:
        return _run(_parser().parse_args(argv))
    except SystemExit as exc:  # argparse: 2 for bad arguments, 0 for --help
        return exc.code if isinstance(exc.code, int) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncreduce", description="Asynchronous collective communication tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    culprit = commands.add_parser(
        "culprit",
        help="name what went wrong, from the ranks' flight records",
        description="Read the flight records that ranks dumped (ASYNCREDUCE_FLIGHT_DIR, or "
        "Communicator.dump_flight_record) and name operations that some ranks posted and "
        "others did not, ranks that disagree on an operation, and the first failure.",
    )
    culprit.add_argument("paths", nargs="+", help="flight-rank*.json files or their directory")
    # Listed for --help only: main() hands "bench ..." to asyncreduce.bench before parsing.
    commands.add_parser("bench", help="run the benchmarks (asyncreduce.bench)")
    return parser


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser(
        "run",
        help="start N ranks of a program on this machine",
        description="Start N ranks of a program on this machine, each told RANK, WORLD_SIZE, "
        "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Output lines are prefixed "
        "with [rank]. If one rank fails, the others are stopped (with --elastic, they go on).",
        epilog=f"example: {_RUN_EXAMPLE}",
    )
    run.add_argument("-n", "--nprocs", type=positive_int, required=True, help="number of ranks")
    run.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0")
    run.add_argument("--master-port", type=port, default=None, help="port (default: a free one)")
    run.add_argument(
        "--grace", type=seconds, default=3.0, help="seconds between SIGTERM and SIGKILL"
    )
    run.add_argument(
        "--elastic", action="store_true",
        help="a rank that fails does not stop the others: they go on without it "
        "(asyncreduce.shrink; docs/elastic.md)",
    )  # fmt: skip
    run.add_argument(
        "--max-restarts", type=integer, default=0, metavar="N",
        help="(with --elastic) start a failed rank again, up to N times in all; it rejoins "
        "the others at a step boundary (docs/elastic.md)",
    )  # fmt: skip
    run.add_argument(
        "--spare", action="store_true",
        help="(with --max-restarts) keep one process started ahead, waiting in ar.init(), to "
        "restart the next rank that fails: no wait for Python and the imports (the program "
        "must do nothing of its rank's before ar.init())",
    )  # fmt: skip
    run.add_argument(
        "--backend", choices=("native", "mpi", "torch"), default=None,
        help="what ar.init() runs on (ASYNCREDUCE_BACKEND): mpi starts the ranks with mpirun",
    )  # fmt: skip
    run.add_argument("program", nargs=argparse.REMAINDER, help="program (.py or command) and args")
    run.set_defaults(run_parser=run)


def _run(args: argparse.Namespace) -> int:
    if args.command == "culprit":
        return _culprit(args.paths)
    program: list[str] = list(args.program)
    if program[:1] == ["--"]:
        program = program[1:]
    if not program:
        args.run_parser.error(f"missing the program to run (e.g. {_RUN_EXAMPLE})")
    if args.spare and not args.max_restarts:
        args.run_parser.error("--spare needs --max-restarts N: a spare stands in for a restart")
    if args.max_restarts < 0 or args.max_restarts and not args.elastic:
        args.run_parser.error(
            "--max-restarts N needs --elastic and N >= 0: without --elastic a failed rank stops "
            "the others, so there is nobody to rejoin"
        )
    return launch.run(
        args.nprocs,
        program,
        master_addr=args.master_addr,
        master_port=args.master_port,
        grace=args.grace,
        backend=args.backend,
        elastic=args.elastic,
        max_restarts=args.max_restarts,
        spare=args.spare,
    )


def _culprit(paths: list[str]) -> int:
    from asyncreduce.flight import culprit, load_dumps

    try:
        dumps = load_dumps(paths)
    except (OSError, ValueError) as exc:
        print(f"asyncreduce culprit: {exc}", file=sys.stderr)
        return 2
    findings = culprit(dumps)
    for line in findings:
        print(line)
    clean = findings == ["every rank posted the same operations and none failed"]
    return 0 if clean else 1


def _bench(rest: Sequence[str]) -> int:
    try:
        bench = importlib.import_module("asyncreduce.bench")
    except ModuleNotFoundError as exc:
        if exc.name != "asyncreduce.bench":
            raise
        print(
            "asyncreduce bench: the benchmark module asyncreduce.bench is not available "
            "in this installation",
            file=sys.stderr,
        )
        return 2
    code = bench.main(list(rest))
    return 0 if code is None else int(code)
