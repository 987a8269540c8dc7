"""How long the test suite takes: per test and per file, from one pytest run.

    python bench/suite_time.py [--write | --out PATH] [--from-xml JUNIT.xml] [-- PYTEST ARGS...]
    python bench/suite_time.py --compare BEFORE.json AFTER.json     # per-file table, markdown


Runs ``python -m pytest -q -n 2 --dist loadgroup --junitxml=...`` (the README's CI tier, on two pytest-xdist
processes; pytest arguments after ``--`` replace ``-n 2 --dist loadgroup``, e.g. ``-- -m slow``), then reads the
JUnit XML pytest wrote: each test's time there is its setup + call + teardown, so a session fixture's cost lands
on the first test that uses it (a worker pool's start, a shared capture); under xdist the per-test times add up
to more than the wall time, and a test's node id loses the ``@group`` suffix xdist gives it. ``--from-xml``
reads an XML a previous run wrote instead of running anything (a CI log's). Writes
``bench/results/suite_time.json`` with ``--write``.

The figures are wall-clock seconds on whatever machine ran it: compare files within one run, and runs
only on the same machine, quiet (the record says how many cores and the load average at the start).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402


def parse(xml_path: Path) -> dict:
    """Per-test and per-file seconds and outcomes from a pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    tests, files = [], defaultdict(lambda: {"seconds": 0.0, "tests": 0})
    outcomes: dict[str, int] = defaultdict(int)
    for case in root.iter("testcase"):
        cls, name, seconds = case.get("classname", ""), case.get("name", ""), float(case.get("time", 0.0))
        # classname is the dotted module path (tests.test_x or tests.test_x.TestClass)
        parts = cls.split(".")
        module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        path = "/".join(parts[: module + 1]) + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if "xfail" in (child.get("type", "") + child.get("message", "")) else "skipped"
        outcomes[outcome] += 1
        if "@" in name and name.rfind("@") > name.rfind("]"):  # xdist's --dist loadgroup suffix: test@group
            name = name[:name.rfind("@")]
        node = path + "::" + ".".join(parts[module + 1:] + [name])
        tests.append({"test": node, "seconds": round(seconds, 3), "outcome": outcome})
        files[path]["seconds"] += seconds
        files[path]["tests"] += 1
    tests.sort(key=lambda t: -t["seconds"])
    per_file = sorted(({"file": f, "seconds": round(v["seconds"], 1), "tests": v["tests"]} for f, v in files.items()),
                      key=lambda f: -f["seconds"])
    return {"tests_total_seconds": round(sum(t["seconds"] for t in tests), 1), "outcomes": dict(outcomes),
            "per_file": per_file, "per_test": tests}


def compare(before: dict, after: dict) -> str:
    """A markdown table of seconds per file, before and after (files of either run; most time first)."""
    b = {f["file"]: f for f in before["per_file"]}
    a = {f["file"]: f for f in after["per_file"]}
    rows = ["| file | tests before | s before | tests after | s after |", "|---|---|---|---|---|"]
    def seconds(f):
        return max(b.get(f, {}).get("seconds", 0), a.get(f, {}).get("seconds", 0))

    for f in sorted(set(a) | set(b), key=lambda f: -seconds(f)):
        x, y = b.get(f, {}), a.get(f, {})
        rows.append(f"| {f} | {x.get('tests', 0)} | {x.get('seconds', 0):.1f} | {y.get('tests', 0)} "
                    f"| {y.get('seconds', 0):.1f} |")
    rows.append(f"| **sum of tests** | | {before['tests_total_seconds']:.1f} | | {after['tests_total_seconds']:.1f} |")
    rows.append(f"| **wall** | | {before.get('wall_seconds')} | | {after.get('wall_seconds')} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_arguments(ap, "suite_time")
    ap.add_argument("--from-xml", default=None, help="read this JUnit XML instead of running pytest")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="print the per-file table of two records and run nothing")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: the CI tier)")
    args = ap.parse_args()
    if args.compare:
        import json

        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(before, after))
        return 0
    load = os.getloadavg()[0]
    wall = None
    if args.from_xml:
        xml_path = Path(args.from_xml)
        rc = None
    else:
        xml_path = Path(tempfile.mkdtemp(prefix="mcompile-suite-")) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml_path}",
               *(args.pytest_args or ["-n", "2", "--dist", "loadgroup"])]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=_results.ROOT).returncode
        wall = round(time.perf_counter() - t0, 1)
    result = {"pytest_args": args.pytest_args, "wall_seconds": wall, "exit_code": rc, "load_average_at_start": load,
              **parse(xml_path)}
    print(f"wall {wall} s; per file (s):", file=sys.stderr)
    for f in result["per_file"][:25]:
        print(f"  {f['seconds']:8.1f}  {f['tests']:4d}  {f['file']}", file=sys.stderr)
    _results.save("suite_time", result, args.write, args.out)
    return 0 if rc in (None, 0) else rc


if __name__ == "__main__":
    raise SystemExit(main())
