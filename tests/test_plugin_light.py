"""The plugin installs light: inside vLLM's processes it needs numpy, torch, vLLM and, for
the kernels, cuda-bindings, all of which vLLM's environment has, and none of the command
line's stack (typer, rich, pandas, numba, httpx, matplotlib). So ``pip install --no-deps``
into vLLM's environment is a whole install of the plugin (README, Install), and numba's
numpy pins never meet vLLM's.

Checked twice: from the source, every module the plugin can reach (function-local imports
included) imports nothing else; and at run time, the entry point vLLM loads (read from
pyproject.toml) imports with the command line's stack made unimportable.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from package_imports import PACKAGE, closure, import_graph, third_party

ROOT = Path(__file__).resolve().parent.parent
#: what the command line needs and the plugin must not
CLI_STACK = ("typer", "rich", "pandas", "numba", "httpx", "matplotlib")
#: what the plugin may import: vLLM's environment has each of them
PLUGIN_NEEDS = {"numpy", "torch", "vllm", "cuda"}


def _entry_point() -> str:
    """``module:attr`` of the vLLM plugin entry point, as pyproject.toml declares it."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^\[project\.entry-points\."vllm\.general_plugins"\]\s*\n'
                  r'expertcache\s*=\s*"([\w.]+:\w+)"', text, re.M)
    assert m, "pyproject.toml declares no vllm.general_plugins entry point named expertcache"
    return m.group(1)


def _plugin_modules() -> set[str]:
    graph = import_graph()
    plugin = [m for m in graph if m == f"{PACKAGE}.plugin" or m.startswith(f"{PACKAGE}.plugin.")]
    return closure(graph, plugin)


def test_everything_the_plugin_reaches_imports_only_what_vllm_has():
    reached = _plugin_modules()
    assert f"{PACKAGE}.device.slotcache" in reached  # the walk follows function-local imports
    extra = {m: sorted(third_party(m) - PLUGIN_NEEDS) for m in sorted(reached)}
    extra = {m: names for m, names in extra.items() if names}
    assert not extra, f"the plugin's import path needs more than vLLM's environment: {extra}"


def test_the_entry_point_loads_without_the_command_line_stack():
    module, attr = _entry_point().split(":")
    # with torch here, every plugin module is imported too (they need torch at the top)
    deep = sorted(_plugin_modules()) if importlib.util.find_spec("torch") else []
    code = "\n".join([
        "import importlib, sys",
        f"for name in {CLI_STACK!r}:",
        "    sys.modules[name] = None  # import name -> ImportError",
        f"register = getattr(importlib.import_module({module!r}), {attr!r})",
        "assert callable(register)",
        f"for name in {deep!r}:",
        "    importlib.import_module(name)",
        f"loaded = sorted(n for n in {CLI_STACK!r} if sys.modules.get(n) is not None)",
        "print('loaded', register.__module__, loaded)",
    ])
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"loaded {module} []", r.stdout
