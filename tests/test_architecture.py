"""The shape of the code, checked on its syntax trees: what imports what, and how big things grow.

- strategies/, benchmarks/ and notebooks/ use the public API only (no ``spmd._*`` module);
- the project's modules form no import cycle (lazy imports inside functions count; ``if TYPE_CHECKING:`` does not);
- the training step, the report and the cost model name no execution mode: they call the executor seam;
- no library function over 80 lines, no class over 250.
"""

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("spmd", "strategies")
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 250
# The modules of the execution modes: what only the seam (through a plan's execution spec) may reach.
MODES = {"spmd._pipeline", "spmd._shares", "spmd._subnet", "spmd._specs"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, module: str, modules: set[str]) -> set[str]:
    """The project modules ``module`` imports, anywhere but under ``if TYPE_CHECKING:``."""
    package = module if (ROOT / module.replace(".", "/") / "__init__.py").exists() else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from package import module` imports the module (its package is already being imported); any
            # other name comes from the module (or package) itself.
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules and m != module}


def _graph() -> dict[str, set[str]]:
    library = _library()
    modules = set(library)
    return {name: _imports(ast.parse(path.read_text()), name, modules) for name, path in library.items()}


def _private_imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        out += [n for n in names if n.startswith("spmd.") and any(p.startswith("_") for p in n.split(".")[1:])]
    return out


def _public_users() -> list[tuple[str, ast.AST]]:
    """The syntax trees of strategies/, benchmarks/ and every code cell of notebooks/."""
    trees = [
        (str(p.relative_to(ROOT)), ast.parse(p.read_text()))
        for d in ("strategies", "benchmarks")
        for p in (ROOT / d).rglob("*.py")
    ]
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        trees.append((str(p.relative_to(ROOT)), ast.parse(code)))
    return trees


def test_strategies_benchmarks_and_notebooks_use_only_the_public_api():
    offenders = {name: _private_imports(tree) for name, tree in _public_users()}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) >= 20  # every file was read: 10 strategy modules, 7 benchmarks, 5 notebooks


def test_the_checker_sees_a_private_import():
    assert _private_imports(ast.parse("from spmd._plan import Plan\nimport spmd.cli._x\nfrom spmd import rules")) == [
        "spmd._plan",
        "spmd._plan.Plan",
        "spmd.cli._x",
    ]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_modules_form_no_import_cycle():
    graph = _graph()
    assert len(graph) > 40 and "spmd._train" in graph and "spmd.cli.plan" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "module", ["spmd._train", "spmd._report", "spmd._report_tables", "spmd.costmodel", "spmd._checkpoint"]
)
def test_the_step_report_and_cost_model_reach_execution_modes_only_through_the_seam(module):
    graph = _graph()
    reached, todo = set(), [module]
    while todo:  # everything the module imports, directly or not, except what the plan's spec builds lazily
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    direct = graph[module]
    assert not direct & MODES, f"{module} imports {sorted(direct & MODES)}"
    if module == "spmd.costmodel":
        assert "spmd._train" not in reached and "spmd._executor" not in reached


def test_no_function_or_class_grows_too_big():
    big = []
    for name, path in _library().items():
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                big.append(f"{name}.{node.name}: {lines} lines")
            elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: {lines} lines")
    assert big == []
