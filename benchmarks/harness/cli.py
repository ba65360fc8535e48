"""The command line every benchmark shares: its options, and the argparse types they use.

``base_parser`` adds what each benchmark of the worker-set protocol has (``--nprocs``,
``--libs``, ``--quick``, ``--json``, ``--plot``, ``--from-json``, ``--repeats``,
``--timeout``) plus the hidden options by which a parent starts its workers (``--worker``,
``--settings``, ``--parent-pid``, ``--deadline``); each benchmark adds its own. The types turn
text into checked values or an ``argparse.ArgumentTypeError`` that names what was wrong, so a
bad option fails at once with argparse's exit code 2 (``parse`` returns it instead of exiting).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_float, positive_int

__all__ = [
    "LIBS",
    "base_parser",
    "checked",
    "comma_list",
    "host_count",
    "lib_list",
    "nprocs_list",
    "parse",
]


LIBS = ("asyncreduce", "gloo", "mpi")


def nprocs_list(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``; every count at least 2."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or values[0] < 2:
        raise argparse.ArgumentTypeError(f"process counts must be at least 2, got {text!r}")
    return values


def lib_list(known: Sequence[str], kind: str = "libraries") -> Callable[[str], list[str]]:
    """A parser of ``"asyncreduce,gloo"``: names, each one of ``known``, in ``known``'s order."""

    def parse_names(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(unknown) or '(none)'}; choose from {','.join(known)}"
            )
        return [name for name in known if name in names]

    return parse_names


def checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text once ``parse`` accepts it (``cluster.parse_rate``)."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def comma_list(kind: str, parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: ``"a,b"`` -> ``[parse("a"), parse("b")]``, repeats dropped, in order.

    ``kind`` names one item in the messages (``"bad rate list ..."``, ``"no rate given"``)."""

    def convert(text: str) -> list[Any]:
        try:
            values = [parse(part.strip()) for part in text.split(",") if part.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"bad {kind} list {text!r}: {exc}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"no {kind} given")
        return list(dict.fromkeys(values))

    return convert


def host_count(text: str) -> int:
    """A number of emulated hosts, one rank each: at least 2 (for ``comma_list``)."""
    value = int(text)
    if value < 2:
        raise ValueError("at least 2 hosts")
    return value


def base_parser(
    name: str, description: str, libs: Sequence[str], repeats: int, quick: str,
    known: Sequence[str] = LIBS, libs_default: str | None = None,
) -> argparse.ArgumentParser:  # fmt: skip
    """The options every one of these benchmarks has; each adds its own.

    ``libs`` is the default selection, ``known`` what ``--libs`` (and ``--worker``) accepts.
    ``libs_default``, where given, is the default in words for a benchmark that picks it
    itself: ``--libs`` is then None unless given.
    """
    parser = argparse.ArgumentParser(
        prog=f"asyncreduce bench {name}",
        description=description,
        epilog=f"example: asyncreduce bench {name} --quick --json results/{name}.json",
    )
    parser.add_argument(
        "--nprocs", type=nprocs_list, default=[2, 4], help="process counts (default 2,4)"
    )
    parser.add_argument(
        "--libs",
        type=lib_list(known),
        default=None if libs_default else list(libs),
        help=f"libraries, of {','.join(known)} (default {libs_default or ','.join(libs)}); "
        "missing ones are skipped",
    )
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every result here")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="PNG (needs matplotlib)")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="run nothing: print the report of a saved --json run (and --plot it)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        metavar="R",
        help=f"timed repeats after a warm-up, the median is reported (default {repeats})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="hard limit per (library, N) worker set (default: scaled to the work)",
    )
    # the worker side: how the parent starts the ranks; not for people
    workers = list(dict.fromkeys([*LIBS, *known]))
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | int:
    """The parsed arguments, or argparse's exit code (0 for --help, 2 for bad arguments)."""
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
