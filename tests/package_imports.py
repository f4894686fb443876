"""The package's imports, read from its source without importing it (tests/test_layout.py
and tests/test_plugin_light.py): module-level and function-local alike, since a lazy import
is a dependency the moment its function runs."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "expertcache_cli"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every module under root."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (path, is_pkg)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (static, function-local included)."""
    mods = _modules(root)
    pkg = root.name
    graph: dict[str, set[str]] = {name: set() for name in mods}

    def known(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    for name, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == pkg]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == pkg:
                    module = node.module or ""
                else:
                    continue
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module
                           for a in node.names]
            for target in targets:
                target = known(target)
                if target != name:
                    graph[name].add(target)
    return graph


def closure(graph: dict[str, set[str]], start: list[str]) -> set[str]:
    """``start`` and every module of the package it imports, directly or not."""
    seen: set[str] = set()
    stack = list(start)
    while stack:
        module = stack.pop()
        if module not in seen:
            seen.add(module)
            stack.extend(graph[module])
    return seen


def third_party(module: str, root: Path = ROOT) -> set[str]:
    """Top-level names of what ``module`` imports from outside the package and stdlib."""
    path, _ = _modules(root)[module]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {"__future__", PACKAGE} - set(sys.stdlib_module_names)
