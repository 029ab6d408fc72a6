"""The placement modules import each other at module level only, without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import conduit.placement

PACKAGE = Path(conduit.placement.__file__).parent


def _placement_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, function-level) imports of other ``conduit.placement`` modules."""
    tree = ast.parse(path.read_text())
    top = {n for n in tree.body if isinstance(n, ast.ImportFrom)}
    module_level, nested = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "conduit.placement."):
            (module_level if node in top else nested).add(node.module.rsplit(".", 1)[1])
    return module_level, nested


def test_placement_imports_form_no_cycle() -> None:
    graph = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        module_level, nested = _placement_imports(path)
        assert not nested, f"{path.stem} imports {sorted(nested)} inside a function"
        graph[path.stem] = module_level
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, " -> ".join((*stack, name))
        if name not in done:
            for dep in graph[name]:
                visit(dep, (*stack, name))
            done.add(name)

    for name in graph:
        visit(name, ())

