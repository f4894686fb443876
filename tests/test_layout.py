"""The package's sections import only downwards, and no import circle closes anywhere.

docs/layout.md names the sections and why each sits where it does. This test reads every
module's imports from its source (``ast``: module-level and function-local alike, since a
lazy import is still a dependency the moment its function runs) and fails on

- a module that belongs to no declared section (a new one must be placed, not left flat),
- an import from a lower section to a higher one (an arrow back up),
- a circle among modules (two modules that need each other cannot be understood, tested
  or moved one at a time).

Nothing is imported: the check runs without torch, vLLM or numba.
"""

from __future__ import annotations

import pytest
from package_imports import PACKAGE, import_graph

#: Sections, lowest first (docs/layout.md says why). A section may import its own modules
#: and any section below it, never one above; peers of one entry do not import each other.
#: ``""`` is the package's ``__init__``: its names load lazily, through strings.
LAYERS: list[tuple[str, ...]] = [
    ("", "errors"),
    ("files",),
    ("tables", "plotting"),
    ("rules",),
    ("device",),
    ("config",),
    ("vllm_facts",),
    ("sizing",),
    ("probe",),
    ("planning",),
    ("plugin",),
    ("baseline",),
    ("commands",),
    ("cli",),
    ("__main__",),
]
LEVEL = {section: i for i, names in enumerate(LAYERS) for section in names}


def section(module: str) -> str:
    """The section a module belongs to: the first name under the package ("" for its root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that leaves its section for one not below it, as ``a -> b`` lines."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            s, d = section(src), section(dst)
            if s == d or d == "errors":
                continue
            if LEVEL[d] >= LEVEL[s]:
                bad.append(f"{src} -> {dst} ({s!r} layer {LEVEL[s]} imports {d!r} layer "
                           f"{LEVEL[d]})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules (strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan, recursive: the package has well under 1000 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_in_a_declared_section():
    undeclared = sorted({section(m) for m in import_graph()} - set(LEVEL))
    assert not undeclared, (f"{undeclared}: place each in LAYERS here and in docs/layout.md")


def test_no_import_runs_back_up_a_layer():
    bad = upward_imports(import_graph())
    assert not bad, "imports back up a layer:\n" + "\n".join(bad)


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_top_level_and_function_local_imports():
    graph = import_graph()
    # module level: the CLI's commands import the trace files' module
    assert f"{PACKAGE}.rules.trace" in graph[f"{PACKAGE}.commands.replay"]
    # function-local only: `binding` compiles with `kernel_build` when it loads the kernels
    assert f"{PACKAGE}.device.kernel_build" in graph[f"{PACKAGE}.device.binding"]


@pytest.mark.parametrize("graph, want", [
    ({"p.rules.a": {"p.plugin.b"}, "p.plugin.b": set()}, "upward"),
    ({"p.rules.a": {"p.rules.b"}, "p.rules.b": {"p.rules.a"}}, "circle"),
])
def test_the_checks_catch_what_they_are_for(graph, want):
    if want == "upward":
        found = [line.split(" (")[0] for line in upward_imports(graph)]
        assert found == ["p.rules.a -> p.plugin.b"]
    else:
        assert circles(graph) == [["p.rules.a", "p.rules.b"]]
