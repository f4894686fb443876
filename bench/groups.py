"""The bench runners' record of the server process groups they start (BENCH ONLY), in
``$EXPERTCACHE_SERVER_GROUPS`` (expertcache_cli/baseline/groups.py says what a record holds).

    python bench/groups.py record PGID --owner PID -- ARGV...   # a group a shell started
    python bench/groups.py forget PGID                          # it was stopped
    python bench/groups.py end                                  # what killed runs left

``end`` ends only recorded groups whose owner is gone (bench/_device_vllm.sh runs it at
setup); a vLLM its user started, whatever its command line, is never touched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertcache_cli.baseline import groups  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the group PGID as started by --owner")
    r.add_argument("pgid", type=int)
    r.add_argument("--owner", type=int, required=True)
    r.add_argument("argv", nargs=argparse.REMAINDER)
    f = sub.add_parser("forget", help="drop the record of PGID")
    f.add_argument("pgid", type=int)
    e = sub.add_parser("end", help="end the recorded groups whose owner is gone")
    e.add_argument("--grace", type=float, default=10.0, help="seconds between TERM and KILL")
    a = ap.parse_args(argv)
    directory = groups.record_dir()
    if directory is None:
        print(f"groups: {groups.ENV} is not set", file=sys.stderr)
        return 2
    if a.cmd == "record":
        words = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
        if groups.record(directory, a.pgid, words, owner=a.owner) is None:
            print(f"groups: process {a.pgid} or {a.owner} is gone; nothing recorded",
                  file=sys.stderr)
            return 1
    elif a.cmd == "forget":
        groups.forget(directory, a.pgid)
    else:
        for line in groups.end_orphans(directory, a.grace):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
