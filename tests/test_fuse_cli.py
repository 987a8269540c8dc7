"""`mcompile show --fuse`: the per-rank program after the fusion pass, fused calls marked, one summary line."""

from __future__ import annotations

import ast
import re

import pytest

from mcompile.apps.cli import main
from mcompile.apps.report import fused_summary


def _show(capsys, *args):
    assert main(["show", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("model,summary", [
    # 2 layers: the first norm reads the embedding, the other 4 a residual sum; q and k rotated per layer
    ("llama3-tiny", {"rms_norm": 1, "add_rms_norm": 4, "swiglu": 2, "rope": 4}),
    ("gpt2-tiny", {"layer_norm": 5}),
])
def test_show_fuse_marks_every_fused_call_and_sums_them_up(capsys, model, summary):
    out = _show(capsys, model, "--mesh", "tp=2", "--sp", "--fuse")
    ast.parse(out)  # still Python: the marks and the summary are comments
    expected = "# fused: " + ", ".join(f"{op} x{n}" for op, n in summary.items())
    assert out.rstrip().splitlines()[-1] == expected
    marked = re.findall(r"torch\.ops\.mcompile\.(\w+)\.default\(.*  # fused: (\w+)$", out, re.MULTILINE)
    assert all(op == mark for op, mark in marked), marked
    assert {op: sum(1 for _, m in marked if m == op) for op in summary} == summary
    # every fused op call is marked, and nothing else is
    calls = re.findall(r"= torch\.ops\.mcompile\.(rms_norm|add_rms_norm|swiglu|rope|layer_norm)\.default", out)
    assert len(calls) == len(marked) == sum(summary.values())


def test_show_without_fuse_prints_the_unfused_program(capsys):
    out = _show(capsys, "llama3-tiny", "--mesh", "tp=2")
    assert "fused" not in out and "torch.ops.mcompile.rms_norm" not in out
    assert "torch.ops.aten.rsqrt.default" in out


def test_fused_summary_lists_only_what_was_found():
    assert fused_summary({"rms_norm": 5, "rope": 0, "swiglu": 2}) == "fused: rms_norm x5, swiglu x2"
    assert fused_summary({"rms_norm": 0}) == "fused: nothing"
