"""The package's layout holds: every module imports, and no two modules need each other.

The graph is read with :mod:`ast` from the source. Module-level imports (including
``try``/``if`` blocks there, not ``if TYPE_CHECKING:`` blocks) run when a module is first
imported: a cycle of them makes the result depend on which module is imported first. The
layers and the cycles are also checked counting every import, inside functions and
``if TYPE_CHECKING:`` blocks too: deferring an import hides a dependency from the
interpreter, not from a reader. (The package's own ``__init__`` is the public facade: its
type-only block names the public classes for type checkers and runs nothing.)
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib

import pytest

import sandlock

PACKAGE = "sandlock"
ROOT = os.path.dirname(os.path.abspath(sandlock.__file__))
#: Modules that run something when imported: the payload is source text run inside the
#: sandbox (it reads its configuration from argv), ``__main__`` is the console script.
NOT_IMPORTED = {"sandlock.probe.payload", "sandlock.__main__"}
#: Lower layers first: a module may import, at module level, only from its own layer or
#: a lower one.
LAYERS = (("sandlock.errors", "sandlock.linux"), ("sandlock.policy",), ("sandlock.compile",),
          ("sandlock.exec", "sandlock.net", "sandlock.trace", "sandlock.undo"),
          ("sandlock.api", "sandlock.cli", "sandlock.probe", "sandlock.integrations"))


def modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _type_checking(node.test):
                out += _module_level(node.body)
            out += _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                out += _module_level(block)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            out += _module_level(node.body)
    return out


def _at_run_time(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run, inside functions too (not ``if TYPE_CHECKING:``)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.If) and _type_checking(node.test):
            out += _at_run_time(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        else:
            out += _at_run_time([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])
    return out


def _anywhere(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import, ``if TYPE_CHECKING:`` blocks and functions included."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        else:
            out += _anywhere([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])
    return out


def imports(name: str, path: str, known: set[str], *, lazy: bool = False,
            every: bool = False) -> set[str]:
    """The package's modules that ``name`` imports at module level (``lazy``: anywhere it
    can run; ``every``: anywhere, type-only imports too, except in the public facade)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    if every:
        reader = _at_run_time if name == PACKAGE else _anywhere
    else:
        reader = _at_run_time if lazy else _module_level
    for node in reader(tree.body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        for target in targets:
            while target and target not in known:  # ``import sandlock.x.y`` of a non-module name
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                out.add(target)
    return out


def graph(*, lazy: bool = False, every: bool = False) -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known, lazy=lazy, every=every)
            for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def layer(name: str) -> int:
    if name == PACKAGE:  # its public names are loaded on first use, from above
        return 0
    for rank, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    return len(LAYERS)


#: Adapters that import their framework (an optional extra) when imported themselves.
FRAMEWORKS = {"sandlock.integrations.langchain": "langchain_core",
              "sandlock.integrations.deepagents": "deepagents",
              "sandlock.integrations.openai_agents": "agents"}


@pytest.mark.parametrize("name", sorted(set(modules()) - NOT_IMPORTED))
def test_every_module_imports(name: str) -> None:
    framework = FRAMEWORKS.get(name)
    if framework is not None and importlib.util.find_spec(framework) is None:
        if os.environ.get("SANDLOCK_EXPECT_INTEGRATIONS") == "1":
            pytest.fail(f"{framework} is not installed, but SANDLOCK_EXPECT_INTEGRATIONS=1")
        pytest.skip(f"{framework} is not installed (an optional extra of {name})")
    importlib.import_module(name)


def test_the_graph_sees_imports() -> None:
    """The reader is not vacuous: known edges of every kind are found."""
    edges = graph()
    assert "sandlock.compile.abi" in edges["sandlock.compile.ruleset"]  # from . import abi
    assert "sandlock.linux.kernel" in edges["sandlock.compile.ruleset"]  # from ..linux import kernel
    assert "sandlock.errors" in edges["sandlock.compile.ruleset"]  # from ..errors import Name
    assert "sandlock.cli.run" in edges["sandlock.__main__"]
    assert "sandlock.cli.main" not in edges["sandlock.cli.run"]  # only inside main()
    assert "sandlock.cli.main" in graph(lazy=True)["sandlock.cli.run"]
    every = graph(every=True)
    assert "sandlock.compile.compiler" not in graph(lazy=True)["sandlock.exec.spec"]
    assert "sandlock.compile.compiler" in every["sandlock.exec.spec"]  # if TYPE_CHECKING:
    assert "sandlock.cli.main" in every["sandlock.cli.run"]
    assert "sandlock.api.sandbox" not in every[PACKAGE]  # the facade's type-only names


def test_the_graph_sees_hidden_upward_imports(tmp_path: pathlib.Path) -> None:
    """Positive control: an upward import in a function or a type-only block is found."""
    source = tmp_path / "mod.py"
    source.write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from ..policy import model\n"
                      "def f() -> None:\n    from ..api import sandbox\n")
    known = set(modules())
    found = imports("sandlock.exec.mod", str(source), known, every=True)
    assert found == {"sandlock.policy.model", "sandlock.api.sandbox"}
    assert not imports("sandlock.exec.mod", str(source), known)


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "module-level import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_cycle_through_imports_inside_functions() -> None:
    """Deferring an import into a function or a type-only block hides a cycle from the
    interpreter, not from a reader: two modules that call each other belong together or
    need a third below both."""
    found = cycles(graph(every=True))
    assert not found, "import cycles (counting imports inside functions and type-only " \
        "ones): " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_import_downwards() -> None:
    """errors/linux < policy < compile < exec/net/trace < api/cli/probe, at module level."""
    upward = sorted(f"{name} -> {target}" for name, targets in graph().items() for target in targets
                    if layer(target) > layer(name))
    assert not upward, "module-level imports of a higher layer: " + "; ".join(upward)


def test_layers_import_downwards_everywhere() -> None:
    """The same, counting imports inside functions and type-only ones: a lower layer never
    calls up, not even later (the plan carries what exec/ needs; the API calls down)."""
    upward = sorted(f"{name} -> {target}" for name, targets in graph(every=True).items()
                    for target in targets if layer(target) > layer(name))
    assert not upward, "imports of a higher layer: " + "; ".join(upward)


def test_exec_reads_no_policy() -> None:
    """Executors run a compiled plan (:class:`sandlock.compile.compiler.Compiled`), never the
    policy: every fact a run needs is in the plan, the same for the CLI, the API and the
    probe. No module of exec/ imports policy/, in any way."""
    found = sorted(f"{name} -> {target}" for name, targets in graph(every=True).items()
                   for target in targets if name.startswith("sandlock.exec.")
                   and target.startswith("sandlock.policy"))
    assert not found, "exec/ imports policy/: " + "; ".join(found)
