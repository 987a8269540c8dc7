"""The import graph of mcompile (issue 39): which module imports which, every import counted (top-level and inside
functions), read with ``ast`` through the ``package-dir`` mapping of pyproject.toml (``mcompile.passes`` is
``passes/``, ``mcompile.runtime`` is ``runtime/``, ...).

1. **The runtime imports no compiler.** Nothing in ``runtime/`` imports a pass (``mcompile.passes.*``), the
   compiler, the planner (capture, rules, propagation, the planner, block repetition, pipeline partitioning, cp
   planning) or the cost model and search: it receives finished programs and, for the modules built per input
   signature, the compiler's ``build`` (``mcompile.compiler.build_joint``).
2. **No import cycle.** The graph has no strongly connected component of more than one module (``KNOWN``, the
   knots left to untangle, is empty: a component may never come back).
3. **Imports follow the layer order.** Each module has a layer (``LAYERS``); it imports only modules of its own
   layer or of the ones before it:

       IR (config, mesh, placements, plan, meta, ops; what reads them alone: annotate's FLOPs, memory_model's
       bytes, the bucket layout, the moe_ffn op, dropout masks, the timeline), kernels, the reference models
       <  runtime  <  capture  <  sharding (rules, propagation, planner, quality, block repetition, stages) and
       lowering (passes/canonicalize, attention, lower; compiled: a capture planned and lowered)
       <  cost (what is priced and the formulas: layouts, profiles' types, collective / pipeline / memory terms)
       <  the other passes (and cp planning; the two that price a choice use cost)  <  compiler (the pass list
       and its runners)  <  estimate (mcompile.cost.workload: a model profiled through the compiler's model passes,
       and estimate)  <  search  <  API  <  applications (cli, report, train, generate, ...)

   The runtime imports the IR (and kernels) alone, so what it runs (the moe_ffn op, the gradient buckets, dropout
   masks, the timeline) is IR; compiled sits with the planner (the compiler's model passes build it). An import
   against the order fails unless ``UPWARD`` lists it (with why), a list that may shrink, never grow.
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
# the cycles left to untangle (issue 39): their members; a component may shrink or vanish, never grow. None left
KNOWN: list[set[str]] = []
# the layer order (module docstring, 3.): each layer's modules, "x.*" for x and every module under it
LAYERS = [
    ("IR", ["mcompile",  # the package: its version; its names load on first use (importlib), it imports nothing
            "mcompile.ir.*", "mcompile.kernels.*", "mcompile.models.*"]),
    ("runtime", ["mcompile.runtime.*"]),
    ("capture", ["mcompile.capture.*"]),
    ("sharding and lowering", ["mcompile.sharding.*", "mcompile.passes", "mcompile.passes.attention",
                               "mcompile.passes.canonicalize", "mcompile.passes.lower", "mcompile.passes.lower_dropout",
                               "mcompile.passes.nodes", "mcompile.passes.loss", "mcompile.passes.tp",
                               "mcompile.passes.tp.heads", "mcompile.passes.tp.loops", "mcompile.passes.pp",
                               "mcompile.passes.pp.stages",
                               "mcompile.passes.ep", "mcompile.passes.ep.find_moe", "mcompile.passes.cp",
                               "mcompile.passes.cp.ops", "mcompile.passes.dp"]),
    ("cost", ["mcompile.cost", "mcompile.cost.model", "mcompile.cost.hardware"]),
    ("the other passes", ["mcompile.passes.codegen", "mcompile.passes.fuse", "mcompile.passes.fp8_linears",
                          "mcompile.passes.joint", "mcompile.passes.joint_blocks", "mcompile.passes.remat",
                          "mcompile.passes.recompute",
                          "mcompile.passes.kv_cache", "mcompile.passes.tp.collective_matmul",
                          "mcompile.passes.pp.pipeline_split", "mcompile.passes.cp.plan", "mcompile.passes.cp.reads",
                          "mcompile.passes.dp.fsdp",
                          "mcompile.passes.dp.overlap"]),
    ("compiler", ["mcompile.compiler"]),
    ("estimate", ["mcompile.cost.workload"]),
    ("search", ["mcompile.search"]),
    ("API", ["mcompile.api"]),
    ("applications", ["mcompile.apps.*"]),
]
# imports against the layer order, each with why it is there; the list may shrink, never grow
UPWARD: dict[tuple[str, str], str] = {}
# what the runtime must not import (module 1 above): the compiler's side
COMPILER_SIDE = ("mcompile.passes", "mcompile.compiler", "mcompile.api", "mcompile.sharding.compiled",
                 "mcompile.sharding.planner",
                 "mcompile.sharding.propagate", "mcompile.sharding.rules", "mcompile.capture.export",
                 "mcompile.sharding.repeat", "mcompile.ir.annotate",
                 "mcompile.passes.pp.stages", "mcompile.passes.cp.plan", "mcompile.passes.cp.ops",
                 "mcompile.cost.model", "mcompile.search",
                 "mcompile.sharding.quality", "mcompile.sharding.blocks")


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


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the entry naming ``module`` (itself, or ``x.*`` for the longest ``x`` above it)."""
    best = None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if name == module or name.endswith(".*") and (module == name[:-2] or module.startswith(name[:-1])):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return best[0] if best else None


@pytest.mark.timeout(120)
def test_every_module_has_a_layer():
    """A new module is placed in ``LAYERS`` (and the check of the check: modules land where they should)."""
    assert [LAYERS[layer_of(m)][0] for m in ("mcompile", "mcompile.sharding.rules.moe", "mcompile.passes.fuse",
                                             "mcompile.passes.lower", "mcompile.runtime.module",
                                             "mcompile.models.llama")] == [
        "IR", "sharding and lowering", "the other passes", "sharding and lowering", "runtime", "IR"]
    assert layer_of("mcompile.passes.new_pass") is None and layer_of("mcompile.irx") is None
    assert layer_of("mcompile.capturex.y") is None
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"modules without a layer (place them in LAYERS): {missing}"


@pytest.mark.timeout(120)
def test_imports_follow_the_layer_order():
    g = import_graph()
    up = sorted((m, t) for m, t in g.edges if layer_of(m) is not None and layer_of(t) is not None
                and layer_of(m) < layer_of(t) and (m, t) not in UPWARD)
    assert not up, ("imports against the layer order (module docstring): "
                    + "; ".join(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})" for m, t in up)
                    + ". Move what the lower module needs down to it, or pass it in")


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
    """mcompile's own ``node.meta`` / ``GraphModule.meta`` keys are constants of ``mcompile/ir/meta.py`` (the channel
    between passes, documented there); nowhere else is one written as a string. The check of the check: a key
    written as a string is found."""
    assert _meta_key_literals(ast.parse('n.meta["mc_x"] = 1\nn.meta.get("_mc_y")\nn.meta["val"]')) == [
        (1, "mc_x"), (2, "_mc_y")]
    found = []
    for name, f in modules().items():
        if name != "mcompile.ir.meta":
            keys = _meta_key_literals(ast.parse(f.read_text()))
            found += [f"{f.relative_to(ROOT)}:{line}: {key}" for line, key in keys]
    assert not found, "meta keys written as strings (name them in mcompile/ir/meta.py): " + "; ".join(found)
