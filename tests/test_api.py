"""The curated public API (`expertcache_cli.__all__`, docs/api.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import expertcache_cli as ec

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves_to_what_its_module_defines():
    import importlib

    for name in ec.__all__:
        if name == "__version__":
            continue
        module = importlib.import_module(f"expertcache_cli.{ec._EXPORTS[name]}")
        assert getattr(ec, name) is getattr(module, ec._ALIASES.get(name, name)), name


def _imported(statement: str) -> str:
    code = (f"import sys; {statement}; print(sorted(m for m in ('torch', 'numpy', 'pandas', "
            "'numba', 'vllm') if m in sys.modules))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_the_package_imports_nothing_heavy():
    """The package alone loads no library; the plugin (imported by every vLLM process when
    it registers) loads numpy, which vLLM has already, and nothing else."""
    assert _imported("import expertcache_cli") == "[]"
    assert _imported("import expertcache_cli.plugin") == "['numpy']"


def test_the_api_page_names_every_public_name_and_its_example_runs():
    page = (ROOT / "docs" / "api.md").read_text()
    for name in ec.__all__:
        if name != "__version__":
            assert f"`{name}" in page, name
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    example = example.replace("traces/", str(ROOT / "traces") + "/")
    subprocess.run([sys.executable, "-c", example], check=True, capture_output=True,
                   text=True, cwd=ROOT)
