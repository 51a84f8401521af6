"""No import circle inside the package: every `import` of a `trl_longrm` module (at module level or inside a function)
is an edge, and the graph has no cycle (a module importing its own parent package is not counted)."""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "trl_longrm"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name):  # the module a dotted name lies in (`trl_longrm.data.errors.X` -> `trl_longrm.data.errors`)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets.update(known(f"{base}.{alias.name}") for alias in node.names)
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    order, low, stack, found = {}, {}, [], []

    def visit(module):
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "trl_longrm.launch" in graph["trl_longrm.train"] and "trl_longrm.launch" in graph["trl_longrm.cli"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
