"""The import graph of mcompile (issue 39): which module imports which, every import counted (top-level and inside
functions), read with ``ast`` through the ``package-dir`` mapping of pyproject.toml (``mcompile.passes`` is
``passes/``, ``mcompile.runtime`` is ``runtime/``, ...).

1. **The runtime imports no compiler.** Nothing in ``runtime/`` imports a pass (``mcompile.passes.*``), the
   compiler, the planner (capture, rules, propagation, the planner, block repetition, pipeline partitioning, cp
   planning) or the cost model and search: it receives finished programs and, for the modules built per input
   signature, the compiler's ``build`` (``mcompile.compiler.build_joint``).
2. **No new import cycle.** The strongly connected components of the graph are at most the knot named in
   ``KNOWN``, no larger than listed; a new cycle, or the known one grown, fails. The target is none: the layer
   order below, each layer importing only the ones before it:

       IR (config, mesh, placements, plan, meta, ops)  <  capture  <  sharding (rules, propagation, planner) and
       lowering (passes/canonicalize, attention, lower)  <  cost (its Workload plans a captured model itself)
       <  the other passes  <  search  <  compiler  <  API  <  applications (cli, train, generate, ...)
       runtime: IR (and kernels) only

   What keeps the knot: capture, rules, propagation, the planner, MoE recognition and the quality check call into
   each other lazily. Untangling it empties ``KNOWN``; this test then holds the line.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"mcompile": "mcompile", "mcompile.passes": "passes", "mcompile.runtime": "runtime",
            "mcompile.kernels": "kernels", "mcompile.models": "models"}
# the cycles left to untangle (issue 39): their members; a component may shrink or vanish, never grow
KNOWN = [
    {"mcompile.autograd_fn", "mcompile.capture", "mcompile.capture_cache", "mcompile.grad_regions", "mcompile.loops",
     "mcompile.memory_model", "mcompile.mixer_hints", "mcompile.moe", "mcompile.passes.attention", "mcompile.plan",
     "mcompile.planner", "mcompile.propagate", "mcompile.quality", "mcompile.report", "mcompile.rules",
     "mcompile.rules.dtensor", "mcompile.rules.factory", "mcompile.rules.matmul", "mcompile.rules.pointwise",
     "mcompile.rules.reductions", "mcompile.rules.ssm", "mcompile.rules.views"},
    # the model passes joined the list: the cost model's Workload plans through them, and two passes price with
    # cost.py's formulas (cp attention, collective matmul); goes when the formulas move below the passes
    {"mcompile.compiler", "mcompile.cost", "mcompile.cp_plan", "mcompile.passes.collective_matmul"},
]
# what the runtime must not import (module 1 above): the compiler's side
COMPILER_SIDE = ("mcompile.passes", "mcompile.compiler", "mcompile.api", "mcompile.compiled", "mcompile.planner",
                 "mcompile.propagate", "mcompile.rules", "mcompile.capture", "mcompile.repeat", "mcompile.annotate",
                 "mcompile.stages", "mcompile.cp_plan", "mcompile.cp", "mcompile.cost", "mcompile.search",
                 "mcompile.quality", "mcompile.blocks")


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            if folder == "mcompile" and parts and parts[0] in ("passes", "runtime", "kernels", "models"):
                continue  # (no such folders under mcompile/: the mapping puts them at the top)
            out[".".join([pkg, *parts])] = f
    return out


@functools.cache
def import_graph() -> nx.DiGraph:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    g = nx.DiGraph()
    for m, f in mods.items():
        g.add_node(m)
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    base = ".".join(up[:len(up) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith("mcompile") else None
                if r is not None and r != m:
                    g.add_edge(m, r)
    return g


@pytest.mark.timeout(120)
def test_the_graph_is_read():
    """The reader sees the imports it must (a check of the checker): the package-dir mapping, relative and
    function-level imports."""
    g = import_graph()
    assert len(g) > 100
    assert g.has_edge("mcompile.runtime.module", "mcompile.runtime.leaves")  # top level, mapped folder
    assert g.has_edge("mcompile.api", "mcompile.compiler")  # inside a function
    assert g.has_edge("mcompile.compiler", "mcompile.passes.joint")


@pytest.mark.timeout(120)
def test_the_runtime_imports_no_compiler():
    g = import_graph()
    bad = sorted((m, t) for m, t in g.edges if m.startswith("mcompile.runtime")
                 and any(t == c or t.startswith(c + ".") for c in COMPILER_SIDE))
    assert not bad, f"runtime modules importing the compiler's side: {bad}"


@pytest.mark.timeout(120)
def test_no_new_import_cycle():
    g = import_graph()
    cycles = [c for c in nx.strongly_connected_components(g) if len(c) > 1]
    new = [sorted(c) for c in cycles if not any(c <= k for k in KNOWN)]
    assert not new, ("import cycles (every import counted, function-level too): "
                     + "; ".join(" <-> ".join(c) for c in new)
                     + ". Move what both sides need into the lower layer (the module docstring's order)")


def _meta_key_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """Line and text of every string constant used as a ``.meta`` key: ``x.meta["mc_..."]`` and
    ``x.meta.get / pop / setdefault("mc_...", ...)``."""
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "meta":
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr == "meta" and node.args:
            key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.lstrip("_").startswith("mc_"):
            out.append((node.lineno, key.value))
    return out


@pytest.mark.timeout(120)
def test_every_meta_key_of_mcompile_is_named_in_one_module():
    """mcompile's own ``node.meta`` / ``GraphModule.meta`` keys are constants of ``mcompile/meta.py`` (the channel
    between passes, documented there); nowhere else is one written as a string. The check of the check: a key
    written as a string is found."""
    assert _meta_key_literals(ast.parse('n.meta["mc_x"] = 1\nn.meta.get("_mc_y")\nn.meta["val"]')) == [
        (1, "mc_x"), (2, "_mc_y")]
    found = []
    for name, f in modules().items():
        if name != "mcompile.meta":
            keys = _meta_key_literals(ast.parse(f.read_text()))
            found += [f"{f.relative_to(ROOT)}:{line}: {key}" for line, key in keys]
    assert not found, "meta keys written as strings (name them in mcompile/meta.py): " + "; ".join(found)
