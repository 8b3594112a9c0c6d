"""The `arborlm` package has no import cycles, lazy (function-level) imports included.

The graph is built statically with `ast`, so the test needs no optional dependency and sees
imports that only run on some code paths. An edge A -> B means "running A's code can execute
module B's body": every `import` and `from ... import` statement at any depth of A (module
level, in functions, in `try`), except those under `if TYPE_CHECKING:` (they never run), and
`importlib.import_module` of a module named by a string constant in A (the lazy `__getattr__`
tables of package `__init__` files).

What an import statement requires:

- `import a.b.c` runs `a`, `a.b` and `a.b.c`; `from a.b import c` runs `a`, `a.b`, and `a.b.c`
  when `c` is a submodule. A package that encloses the importing module is already imported
  (or being imported) before the module's body runs, so those implicit parent edges are left
  out: otherwise every package `__init__` that imports its own submodules would close a cycle
  with each of them.
- Naming the enclosing package itself is an edge, though: `from arborlm.constrained import X`
  (X not a submodule) or `import arborlm` inside `arborlm.lang` reads that package's
  namespace, which may be only half-built. A package `__init__` that imports a submodule that
  does this is a real cycle, and is reported.
- `from pkg import sub`, where `sub` is a submodule, needs only `pkg.sub`.

A cycle is a strongly connected component of more than one module; the failure names one
concrete path around it, with the file and line of each import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "arborlm"

Graph = dict[str, dict[str, str]]  # importer -> {imported module: "file.py:line"}


def _module_names(package_dir: Path) -> tuple[dict[str, Path], set[str]]:
    """Every module of the package as {dotted name: file}, and the names that are packages."""
    modules: dict[str, Path] = {}
    packages: set[str] = set()
    root = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if not all((root.joinpath(*parts[:i]) / "__init__.py").exists()
                   for i in range(1, len(parts))):
            continue  # not importable as part of the package (a directory without __init__)
        if parts[-1] == "__init__":
            parts.pop()
            packages.add(".".join(parts))
        modules[".".join(parts)] = path
    return modules, packages


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_nodes(node: ast.AST, type_checking: bool = False) -> Iterator[ast.AST]:
    """Every node below `node`, skipping the bodies of `if TYPE_CHECKING:` unless asked."""
    for child in ast.iter_child_nodes(node):
        if (not type_checking and isinstance(child, ast.If)
                and _is_type_checking(child.test)):
            for stmt in child.orelse:
                yield stmt
                yield from _runtime_nodes(stmt)
            continue
        yield child
        yield from _runtime_nodes(child, type_checking)


def _ancestors_or_self(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def build_import_graph(package_dir: Path, type_checking: bool = False) -> Graph:
    """The import graph of the package in `package_dir` (see the module docstring).

    `type_checking=True` also counts imports under `if TYPE_CHECKING:`, to show the cycles of
    annotations alone (back-references between modules that never import each other at run time).
    """
    modules, packages = _module_names(package_dir)
    return {importer: _module_edges(importer, path, package_dir.parent, modules, packages,
                                    type_checking)
            for importer, path in modules.items()}


def _module_edges(importer: str, path: Path, root: Path, modules: dict[str, Path],
                  packages: set[str], type_checking: bool) -> dict[str, str]:
    """The modules whose bodies running `importer`'s code can execute, with where it imports."""
    enclosing = _ancestors_or_self(importer)
    own_package = importer if importer in packages else importer.rpartition(".")[0]
    where = path.relative_to(root)
    edges: dict[str, str] = {}

    def add(target: str, line: int, explicit: bool) -> None:
        if target not in modules or target == importer:
            return
        if not explicit and target in enclosing:
            return  # an enclosing package runs before this module: no edge
        edges.setdefault(target, f"{where}:{line}")

    def requires(target: str, line: int) -> None:
        for prefix in _prefixes(target):
            add(prefix, line, explicit=False)
        add(target, line, explicit=True)

    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = list(_runtime_nodes(tree, type_checking))
    calls_import_module = False
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                requires(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = own_package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for prefix in _prefixes(base):
                add(prefix, node.lineno, explicit=False)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if alias.name != "*" and submodule in modules:
                    add(submodule, node.lineno, explicit=True)
                else:  # a name defined in `base` itself
                    add(base, node.lineno, explicit=True)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            calls_import_module = calls_import_module or name == "import_module"
    if calls_import_module:  # lazy tables: {"name": "arborlm.x.y"} handed to import_module
        for node in nodes:
            if isinstance(node, ast.Constant) and node.value in modules:
                requires(node.value, node.lineno)
    return edges


def strongly_connected_components(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm, iteratively; each component sorted, components in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def import_cycles(graph: Graph) -> list[str]:
    """One line per cycle (component of 2+ modules): a path around it, each import located."""
    lines = []
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        start = component[0]
        # Breadth-first from `start` to the shortest path back to it inside the component.
        previous: dict[str, str] = {}
        frontier = [start]
        while start not in previous:
            next_frontier = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child in members and child not in previous:
                        previous[child] = node
                        next_frontier.append(child)
            frontier = next_frontier
        path = [start]
        while True:
            path.append(previous[path[-1]])
            if path[-1] == start:
                break
        path.reverse()
        steps = " -> ".join(
            f"{b} ({graph[a][b]})" for a, b in zip(path, path[1:], strict=False))
        lines.append(f"{len(component)} modules {{{', '.join(component)}}}: {start} -> {steps}")
    return lines


def test_arborlm_has_no_import_cycles() -> None:
    cycles = import_cycles(build_import_graph(PACKAGE_DIR))
    assert not cycles, "import cycles in arborlm:\n" + "\n".join(cycles)


def test_graph_sees_the_package() -> None:
    graph = build_import_graph(PACKAGE_DIR)
    assert "arborlm.constrained.base" in graph["arborlm.constrained"]
    assert "arborlm.runtime.engine" in graph["arborlm"]  # function-level, in __getattr__
    assert "arborlm.lang.tracer" in graph["arborlm.lang.program"]  # function-level


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_finds_a_lazy_relative_cycle(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from . import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "",
        "pkg/b.py": "import os\n\n\ndef g():\n    from .a import f\n",
    })
    cycles = import_cycles(build_import_graph(pkg))
    assert cycles == ["2 modules {pkg.a, pkg.b}: pkg.a -> pkg.b (pkg/a.py:2) -> "
                      "pkg.a (pkg/b.py:5)"]


def test_type_checking_imports_make_no_edge(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nimport typing\n"
                     "if TYPE_CHECKING:\n    from pkg.a import X\n"
                     "if typing.TYPE_CHECKING:\n    import pkg.a\nelse:\n    import pkg.c\n"),
        "pkg/c.py": "",
    })
    graph = build_import_graph(pkg)
    assert import_cycles(graph) == []
    assert set(graph["pkg.b"]) == {"pkg.c"}
    assert len(import_cycles(build_import_graph(pkg, type_checking=True))) == 1


def test_package_init_importing_its_submodules_is_no_cycle(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import thing\n",
        "pkg/sub/__init__.py": "from pkg.sub.impl import thing\nfrom . import helper\n",
        "pkg/sub/impl.py": "import pkg.sub.helper\nfrom pkg.sub import helper as h\n",
        "pkg/sub/helper.py": "from pkg import other\n",
        "pkg/other.py": "",
    })
    graph = build_import_graph(pkg)
    assert import_cycles(graph) == []
    assert set(graph["pkg.sub.impl"]) == {"pkg.sub.helper"}


def test_submodule_reading_its_package_namespace_is_a_cycle(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.base import Base, REGISTRY\n",
        "pkg/base.py": "REGISTRY = {}\nclass Base:\n    pass\n",
        "pkg/impl.py": "from pkg import Base\n",
        "pkg/registry.py": "",
    })
    assert import_cycles(build_import_graph(pkg)) == []
    (pkg / "base.py").write_text("def load():\n    from pkg.impl import Impl\n")
    assert import_cycles(build_import_graph(pkg)) == [
        "3 modules {pkg, pkg.base, pkg.impl}: pkg -> pkg.base (pkg/__init__.py:1) -> "
        "pkg.impl (pkg/base.py:2) -> pkg (pkg/impl.py:1)"]


def test_import_of_another_package_runs_its_init(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x/__init__.py": "from pkg.x.core import run\n",
        "pkg/x/core.py": "def run():\n    import pkg.y.util\n",
        "pkg/y/__init__.py": "def lazy(name):\n    import importlib\n"
                             "    return importlib.import_module(_LAZY[name])\n"
                             "_LAZY = {'z': 'pkg.y.z'}\n",
        "pkg/y/util.py": "",
        "pkg/y/z.py": "from pkg.x import run\n",
    })
    graph = build_import_graph(pkg)
    assert set(graph["pkg.x.core"]) == {"pkg.y", "pkg.y.util"}
    cycles = import_cycles(graph)
    assert len(cycles) == 1
    assert cycles[0].startswith("4 modules {pkg.x, pkg.x.core, pkg.y, pkg.y.z}")


@pytest.mark.parametrize("source",
                         ["import pkg\n", "from pkg import VALUE\n", "from . import VALUE\n"])
def test_naming_the_enclosing_package_is_an_edge(tmp_path: Path, source: str) -> None:
    pkg = _write(tmp_path, {"pkg/__init__.py": "VALUE = 1\n", "pkg/mod.py": source})
    assert set(build_import_graph(pkg)["pkg.mod"]) == {"pkg"}
