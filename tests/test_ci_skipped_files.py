"""`.ci/skipped_files.py`: the second CI pass reruns exactly the files the first one skipped in."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="tests.test_audit" time="0"><skipped message="no torch"/></testcase>
<testcase classname="tests.device.test_scale" name="test_a" time="0"><skipped/></testcase>
<testcase classname="tests.test_x.TestGroup" name="test_b" time="0"><skipped/></testcase>
<testcase classname="tests.test_ran" name="test_c" time="0"/>
<testcase classname="tests.bench.test_bench_wide_stage" name="test_d" time="0"><skipped/></testcase>
</testsuite></testsuites>"""


def test_the_files_with_a_skip_and_only_those(tmp_path):
    report = tmp_path / "first.xml"
    report.write_text(REPORT)
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "skipped_files.py"), str(report)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["tests/bench/test_bench_wide_stage.py", "tests/device/test_scale.py",
                   "tests/test_audit.py", "tests/test_x.py"]
