"""The library's import graph has no cycle: module-level and function-level imports alike.

Every `import` / `from ... import` anywhere in a module of `eagle3_pipeline` (inside functions too)
is an arrow from that module to the library module it names: `from .a import f` names `a`;
`from . import x` and `from .a import x` name the submodule `x` where there is one, else the package.
Importing a submodule first runs its parent packages' `__init__`, but only its module-level code:
so the parents' module-level imports are arrows of the importer too, while what a package's
functions import (compat's `apply()` imports every fix) is an arrow only of modules that import the
package itself. A package the importer itself sits in has run its `__init__` before the importer's
body (Python imports parents first), so a sibling import inside a package (config.printing's
`from .schema import ...`) adds no arrows from that package's `__init__`; the sibling arrow itself
still counts. Parsed with ast: nothing is imported to build the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "eagle3-train" / "eagle3_pipeline"
PACKAGE = LIBRARY.name


def module_files() -> dict[str, Path]:
    """'eagle3_pipeline.compat.sample_check' -> its file ('eagle3_pipeline.compat' -> compat/__init__.py)."""
    modules = {}
    for path in LIBRARY.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(LIBRARY).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def is_package(module: str, files: dict[str, Path]) -> bool:
    return files[module].name == "__init__.py"


def _import_nodes(tree: ast.AST, module_level_only: bool):
    """The import statements of a module; with module_level_only, none inside a function body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            elif not (module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
                stack.append(child)


def _named(name: str, files: dict[str, Path]) -> str | None:
    """The library module an import names: the longest prefix that is a module (`a.b.f` -> `a.b`)."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name if name.startswith(PACKAGE) else None


def imports_of(module: str, files: dict[str, Path], module_level_only: bool = False) -> set[str]:
    """The library modules `module` names in its import statements (not their parent packages)."""
    tree = ast.parse(files[module].read_text(), filename=str(files[module]))
    package = module if is_package(module, files) else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree, module_level_only):
        if isinstance(node, ast.Import):
            found.update(filter(None, (_named(alias.name, files) for alias in node.names)))
            continue
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:  # `from pkg import submodule` names the submodule, else pkg
            target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
            if (named := _named(target, files)) is not None:
                found.add(named)
    return found


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    init_level = {m: imports_of(m, files, module_level_only=True) for m in files if is_package(m, files)}
    graph = {}
    for module in files:
        arrows = set()
        initialised = set(_parents(module))  # the importer's own packages: their __init__ ran before it
        for named in imports_of(module, files):
            arrows.add(named)
            for parent in _parents(named):  # running a parent's __init__ runs its module-level imports
                if parent not in initialised:
                    arrows |= init_level.get(parent, set())
        graph[module] = arrows - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, deterministic order)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_local_and_relative_imports():
    files = module_files()
    graph = import_graph()
    assert len(graph) > 20 and f"{PACKAGE}.compat.sample_check" in graph
    # `from ..hidden_states import hs_file` in a subpackage, at module level
    assert f"{PACKAGE}.hidden_states" in graph[f"{PACKAGE}.extract.common"]
    # `from . import (cpu_trainer, ...)` inside compat.apply(): the submodules, not just the package
    assert f"{PACKAGE}.compat.cpu_trainer" in graph[f"{PACKAGE}.compat"]
    assert is_package(f"{PACKAGE}.compat", files) and not is_package(f"{PACKAGE}.compat.cpu_trainer", files)
    # a function-level import counts; compat's __init__ imports nothing at module level, so importing one fix
    # is no arrow to the others
    assert f"{PACKAGE}.extract.vllm_backend" in graph[f"{PACKAGE}.preflight"]
    assert imports_of(f"{PACKAGE}.compat", files, module_level_only=True) == set()
    assert f"{PACKAGE}.compat.cpu_trainer" not in graph[f"{PACKAGE}.config"]
    # importing config.schema from outside runs config's __init__ (which imports config.resolution); from
    # inside config (printing imports schema) the __init__ has run already
    assert f"{PACKAGE}.config.resolution" in graph[f"{PACKAGE}.extract.run"]  # it names config.schema only
    assert f"{PACKAGE}.config.schema" in graph[f"{PACKAGE}.config.printing"]
    assert f"{PACKAGE}.config.resolution" not in graph[f"{PACKAGE}.config.printing"]


def test_find_cycle_finds_a_cycle_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_the_library_has_no_import_cycle_local_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(m.removeprefix(PACKAGE + ".") for m in cycle)
