"""bench/suite_time.py reads the JUnit XML of the README's xdist run: node ids without xdist's ``@group``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _suite_time(monkeypatch):
    monkeypatch.setattr(sys, "path", sys.path[:])  # the script puts bench/ first, which shadows packages: undone
    spec = importlib.util.spec_from_file_location("suite_time_bench", ROOT / "bench" / "suite_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_xdist_group_suffixes_are_not_part_of_a_test_id(tmp_path, monkeypatch):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_x[p@q]@processes" time="2.5"/>'
        '<testcase classname="tests.test_a" name="test_y@tests/test_a.py" time="1.0"/>'
        '<testcase classname="tests.test_b" name="test_z[a@b]" time="0.5"><failure message="m"/></testcase>'
        '</testsuite></testsuites>')
    rec = _suite_time(monkeypatch).parse(xml)
    assert [t["test"] for t in rec["per_test"]] == ["tests/test_a.py::test_x[p@q]", "tests/test_a.py::test_y",
                                                    "tests/test_b.py::test_z[a@b]"]
    assert rec["per_file"] == [{"file": "tests/test_a.py", "seconds": 3.5, "tests": 2},
                               {"file": "tests/test_b.py", "seconds": 0.5, "tests": 1}]
    assert rec["outcomes"] == {"passed": 2, "failed": 1}
