"""The test files in which a pytest run skipped something, from its JUnit XML report.

`.ci/run` runs the README's test command first without torch or vLLM, then installs both
and runs again only these files: the rest needs neither and has run already.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def skipped_files(report: str) -> list[str]:
    """Files (``tests/x/test_y.py``) of every skipped test or module in ``report``."""
    out: set[str] = set()
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is None:
            continue
        module = case.get("classname") or case.get("name", "")  # a module skipped whole
        parts = [p for p in module.split(".") if p]
        while parts and not parts[-1].startswith("test"):  # drop a class name
            parts.pop()
        if parts:
            out.add("/".join(parts) + ".py")
    return sorted(out)


if __name__ == "__main__":
    print("\n".join(skipped_files(sys.argv[1])))
