"""``asyncreduce bench NAME [options]``: run one of the repository's benchmark scripts.

Theory of operation
-------------------
Benchmarks are plain scripts in the checkout's ``benchmarks/`` folder (``parents[2]`` of this
file in a ``src/`` layout), not part of the installed package: they import optional libraries
(PyTorch, mpi4py, matplotlib) that the library itself never needs. ``main`` finds
``benchmarks/NAME.py``, loads it as a module and returns what its ``main(argv)`` returns, with
the rest of the command line passed on untouched (the benchmark owns its options, ``--help``
included). ``--list`` prints the benchmarks with the first line of each one's docstring, read
without importing them. A missing folder, an unknown name or a script without ``main`` is an
error on stderr and exit code 2, like a bad argument.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["BENCHMARKS_DIR", "available", "main"]

#: Where the benchmark scripts live: ``benchmarks/`` at the root of the repository checkout.
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

_SAY = "asyncreduce bench: "
_USAGE = "usage: asyncreduce bench NAME [options]   (asyncreduce bench --list; NAME --help)"


def available(directory: Path | None = None) -> dict[str, str]:
    """``{name: first line of its docstring}`` for every ``benchmarks/NAME.py``, sorted."""
    folder = BENCHMARKS_DIR if directory is None else directory
    found: dict[str, str] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue  # a helper module (allreduce_rank.py, ...), not a benchmark
        doc = ast.get_docstring(tree) or ""
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def main(argv: Sequence[str]) -> int:
    """Run ``asyncreduce bench`` with ``argv`` (what follows ``bench``); return the exit code."""
    args = list(argv)
    folder = BENCHMARKS_DIR
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stdout if args else sys.stderr)
        if args:
            print(_listing(folder))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if not folder.is_dir():
        print(
            f"{_SAY}no benchmarks folder at {folder}: the benchmarks live in the repository "
            "checkout (clone it and `pip install -e .`)",
            file=sys.stderr,
        )
        return 2
    if name == "--list":
        print(_listing(folder))
        return 0
    names = available(folder)
    if name not in names:
        known = ", ".join(names) or "none"
        print(f"{_SAY}unknown benchmark {name!r}; available: {known}", file=sys.stderr)
        return 2
    module = _load(name, folder / f"{name}.py")
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"{_SAY}{folder / (name + '.py')} has no main(argv) function", file=sys.stderr)
        return 2
    try:
        code = entry(rest)
    except SystemExit as exc:  # argparse inside the benchmark: 0 for --help, 2 for bad options
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
    except KeyboardInterrupt:
        print(f"{_SAY}interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else int(code)


def _listing(folder: Path) -> str:
    names = available(folder)
    if not names:
        return f"no benchmarks found in {folder}"
    width = max(len(n) for n in names)
    return "\n".join(f"  {n.ljust(width)}  {doc}".rstrip() for n, doc in names.items())


def _load(name: str, path: Path) -> ModuleType:
    module_name = f"asyncreduce_benchmarks.{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
