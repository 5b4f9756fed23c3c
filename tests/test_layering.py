"""The house rules of docs/architecture.md, checked on the source: imports flow one way
(model <- formats <- {recorder, collect, analyze, synth} <- entry points) and no module
imports itself back through others. Every import counts, also one inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import frtools

PACKAGE = Path(frtools.__file__).resolve().parent

# room -> layer; a module may import its own room and rooms of a lower layer only.
ROOMS = {
    "frtools": 0,  # __version__
    "frtools.config": 0,
    "frtools.model": 0,
    "frtools.formats": 1,
    "frtools.recorder": 2,
    "frtools.collect": 2,
    "frtools.analyze": 2,
    "frtools.synth": 2,
    "frtools.commands": 3,
    "frtools.cli": 3,
    "frtools.__main__": 4,
    "frtools.pytest_plugin": 3,
    "frtools.recovery": 3,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """frtools modules ``path`` imports (``from a import b`` counts as ``a.b`` when ``a.b``
    is a module, else ``a``)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "frtools")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "frtools":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    return found


def _is_module(name: str) -> bool:
    """A Python module, a package, or a native extension (``_blackbox.cpython-311-….so``)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return (
        path.with_suffix(".py").exists()
        or (path / "__init__.py").exists()
        or any(path.parent.glob(f"{path.name}.*.so"))
        or (path.parent / "_native").is_dir()
        and any((path.parent / "_native").glob(f"{path.name.lstrip('_')}.cpp"))
    )


def _room(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in ROOMS:
            return prefix
    raise AssertionError(f"{module} is in no room: add it to ROOMS and docs/architecture.md")


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {m for m in _imports(path, module) if m != module}
    return graph


def test_every_import_flows_down_the_layers() -> None:
    wrong = []
    for module, targets in _graph().items():
        room = _room(module)
        for target in sorted(targets):
            other = _room(target)
            if other != room and ROOMS[other] >= ROOMS[room]:
                wrong.append(f"{module} -> {target}  ({room} may not import {other})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle_and_a_wrong_arrow() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _room("frtools.analyze.readers.loader") == "frtools.analyze"
    assert ROOMS[_room("frtools.formats.blackbox")] < ROOMS[_room("frtools.recorder.capture")]
