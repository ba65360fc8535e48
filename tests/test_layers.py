"""The package's import graph has levels: no import runs up a level and there are no circles
(issue 36, item 5). Read from the source with ``ast``, every import counted, those under
TYPE_CHECKING and inside functions too: a lazy import is still a tie.

A level is a folder's children (its modules and sub-packages, each one "room"): the rooms of
every folder must import each other without a circle, and no module may import the
``__init__`` of a package it sits in (that is the level above it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "asyncreduce"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for __init__)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports."""
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(modules[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            # a name imported from a module is that module; a submodule is itself
            if target in modules and target != name:
                found.add(target)
                if isinstance(node, ast.ImportFrom):
                    break
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, modules) for name in modules}
    for name, targets in graph.items():  # `from .x import y` names y, not the package x
        for target in list(targets):
            named_inside = any(t.startswith(target + ".") for t in targets)
            if named_inside and _is_package(target, modules) \
                    and not _names_defined_in_init(name, target, modules):  # fmt: skip
                targets.discard(target)
    return graph


def _names_defined_in_init(name: str, package: str, modules: dict[str, Path]) -> bool:
    """Whether ``name`` takes from ``package``'s __init__ a name that is not a submodule."""
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(modules[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == package and any(f"{base}.{a.name}" not in modules for a in node.names):
                return True
    return False


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _rooms(graph: dict[str, set[str]], folder: str) -> dict[str, set[str]]:
    """The children of ``folder`` and which import which (through any module inside them)."""
    def room(module: str) -> str | None:
        if not module.startswith(folder + "."):
            return None
        return folder + "." + module[len(folder) + 1 :].split(".")[0]

    rooms: dict[str, set[str]] = {}
    for source, targets in graph.items():
        mine = room(source)
        if mine is None:
            continue
        rooms.setdefault(mine, set())
        for target in targets:
            theirs = room(target)
            if theirs is not None and theirs != mine:
                rooms[mine].add(theirs)
    return rooms


def test_the_reader_sees_imports_of_every_kind() -> None:
    """The graph holds what the tests below rely on: relative, lazy and TYPE_CHECKING imports."""
    graph = _graph()
    assert "asyncreduce.comm" in graph["asyncreduce.bootstrap.native"]  # `from ..comm import`
    assert "asyncreduce.bootstrap.ordered" in graph["asyncreduce.bootstrap"]  # lazy, in init()
    assert "asyncreduce.kernels.fold" in graph["asyncreduce.transport.tcp"]  # TYPE_CHECKING
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_that_imports_it_back() -> None:
    assert _circles(_graph()) == []


@pytest.mark.parametrize(
    "folder", sorted(n for n, p in _modules().items() if p.name == "__init__.py")
)
def test_the_rooms_of_each_folder_import_each_other_without_a_circle(folder: str) -> None:
    """A circle between two rooms of one folder is an import that runs back up a level."""
    assert _circles(_rooms(_graph(), folder)) == []


def test_no_module_imports_a_package_it_sits_in() -> None:
    modules = _modules()
    graph = _graph()
    upward = sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if _is_package(target, modules) and source.startswith(target + ".")
    )
    assert upward == []


def test_transport_knows_no_algorithm_and_the_protocol_no_engine() -> None:
    """The rules the layers were drawn by (README, How it works)."""
    graph = _graph()
    for source, targets in graph.items():
        if source.startswith("asyncreduce.transport"):
            assert not [t for t in targets if t.startswith("asyncreduce.algorithms")], source
        if source.startswith(("asyncreduce.kernels", "asyncreduce.algorithms")):
            assert not [t for t in targets if t.startswith("asyncreduce.transport")], source
