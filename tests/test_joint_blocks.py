"""Joint graphs of repeated layers traced once per distinct layer (passes/joint_blocks.py, issue 40).

The proof is equality with the whole trace: node for node, in the same order, the same targets, the same literal
arguments (dropout keys included), the same inputs and the same carried meta (layer, origin, program node), so
every pass after the trace (partition, recompute by layer, ZeRO-3's prefetch, bucket launches, show) sees one and
the same graph; and the number of traces: one per distinct layer plus the outer program, whatever the depth.
Single process, fake tensors: each case costs a plan and two traces.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import build

pytestmark = pytest.mark.timeout(300)


def _program_and_args(model, inputs, mesh: str, config_kw: dict, plan_kw: dict, stage: int | None = None):
    """Rank 0's program (or its pipeline stage ``stage``, which must receive nothing) after the rank passes of
    ``Config(**config_kw)``, and fake inputs for one microbatch, as the runtime builds them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcompile.api import compile_plan
    from mcompile.compiler import _example_args, rank_programs
    from mcompile.ir.config import Config
    from mcompile.ir.mesh import Mesh

    config = Config(**config_kw)
    c = compile_plan(model, Mesh.parse(mesh), inputs, for_runtime=True, **plan_kw)
    rp = rank_programs(c, 0, config, torch.device("cpu"))
    if stage is None:
        program = rp.program
        names = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    else:
        st = rp.stages[stage]
        assert not st.received
        program, names = st.gm, st.inputs
    zero3 = {ph for ph in names if c.captured.params.get(ph) in rp.zero3}
    args = _example_args(c, 0, names, inputs, config.microbatches, FakeTensorMode(allow_non_fake_inputs=True), zero3)
    return program, args


def _structure(gm) -> list:
    """Each node: op, target, arguments with nodes by position, and our carried meta; the graph's order."""
    import torch.fx as fx

    from mcompile.ir import meta as M

    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for n in gm.graph.nodes:
        custom = n.meta.get("custom", {})
        out.append((n.op, str(n.target) if n.op != "placeholder" else n.name,
                    repr(fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", pos[a]))),
                    custom.get(M.LAYER), custom.get(M.ORIGIN), custom.get(M.PROGRAM_NODE)))
    return out


def _compare(program, args, monkeypatch) -> tuple[int, int]:
    """The composed joint graph equals the whole trace (asserted); returns (make_fx calls composed, layers)."""
    from mcompile.passes import joint as J
    from mcompile.passes import joint_blocks as B

    monkeypatch.setattr(J, "_TRACED", type(J._TRACED)())
    whole = J._trace(copy.deepcopy(program), list(args))
    calls = []
    real = J.make_fx
    monkeypatch.setattr(J, "make_fx", lambda *a, **k: calls.append(1) or real(*a, **k))
    composed = J.trace_joint(copy.deepcopy(program), list(args))
    assert (composed.num_outputs, composed.diff_outputs, composed.grad_primals, composed.primal_names,
            composed.tangent_names) == (whole.num_outputs, whole.diff_outputs, whole.grad_primals,
                                        whole.primal_names, whole.tangent_names)
    a, b = _structure(whole.gm), _structure(composed.gm)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"node {i}: whole trace {x}, composed {y}"
    assert not any("joint_block" in str(n.target) for n in composed.gm.graph.nodes)
    return len(calls), len(B.layer_runs(program))


@pytest.mark.parametrize("case", ["llama4-tp2-sp", "bert-dropout-tp2", "llama4-zero3-dp2", "llama4-pp2-stage0",
                                  "llama4-fp8"])
def test_the_composed_joint_graph_is_the_whole_trace(case, monkeypatch):
    """Four alike layers: two make_fx calls (one layer, the outer program) give the whole trace's graph: under
    SP (gathers and reduce-scatters inside each layer), with dropout (each layer's nodes keep their own keys:
    a composition that left the traced layer's keys fails here), ZeRO-3 (parameter gathers inside the layers),
    a pipeline stage, FP8 (amax histories: module constants read inside the layers, advanced in place)."""
    plan_kw, config_kw, stage = {}, {}, None
    if case.startswith("bert"):
        from bert_cases import build_hf_dropout

        model, inputs = build_hf_dropout()
        mesh = "tp=2"
    else:
        model, inputs = build("llama3-tiny-deep")
        mesh = {"llama4-tp2-sp": "tp=2", "llama4-zero3-dp2": "dp=2,tp=2", "llama4-pp2-stage0": "pp=2",
                "llama4-fp8": "tp=2"}[case]
        if case == "llama4-tp2-sp":
            plan_kw["sequence_parallel"] = True
        if case == "llama4-zero3-dp2":
            config_kw["zero"] = 3
        if case == "llama4-pp2-stage0":
            config_kw["microbatches"], stage = 2, 0
        if case == "llama4-fp8":
            config_kw["fp8"] = "delayed"
    program, args = _program_and_args(model, inputs, mesh, config_kw, plan_kw, stage)
    if case == "llama4-fp8":
        assert any(n.op == "get_attr" for n in program.graph.nodes)
    if case.startswith("bert"):
        assert sum(n.target is torch.ops.mcompile.dropout.default for n in program.graph.nodes) > 4
    traces, runs = _compare(program, args, monkeypatch)
    assert runs == (2 if stage is not None else 4)
    assert traces == 2


class _Alternating(torch.nn.Module):
    """Six layers of two kinds (ReLU and GELU MLPs, alternating) between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(_Layer(torch.relu if i % 2 == 0 else torch.nn.functional.gelu)
                                          for i in range(6))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class _Layer(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act, self.up, self.down = act, torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, h):
        return h + self.down(self.act(self.up(h)))


def test_two_kinds_of_layer_trace_twice_and_a_single_layer_whole(monkeypatch):
    """Alternating layer kinds: one trace per kind plus the outer program; a program with one layer of a kind
    only is traced whole (nothing to repeat)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 8))
    program, args = _program_and_args(_Alternating(), (tokens, tokens), "tp=2", {}, {})
    traces, runs = _compare(program, args, monkeypatch)
    assert runs == 6 and traces == 3

    from mcompile.passes import joint_blocks as B

    single = copy.deepcopy(program)
    for n in single.graph.nodes:  # one layer number for all: no layer repeats
        if n.meta.get("mc_layer") is not None:
            n.meta["mc_layer"] = 0
    assert B.compose(single, list(args), None) is None


def test_fake_forward_runs_each_kind_of_layer_once():
    """The pipeline probe's message shapes (passes/joint_blocks.py ``fake_forward``): the program's outputs, of
    the metadata a full fake run gives, from the outer program and one run per layer kind (6 layers of two kinds:
    2 run, the ops of 4 never dispatched)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mcompile.passes.joint_blocks import fake_forward

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 8))
    program, args = _program_and_args(_Alternating(), (tokens, tokens), "tp=1", {}, {})
    mode = next(a.fake_mode for a in args if hasattr(a, "fake_mode"))
    counts, outs = [], []
    for run in (lambda: program(*args), lambda: fake_forward(program, list(args))):
        Count.n = 0
        with mode, torch.no_grad(), Count():
            out = run()
        counts.append(Count.n)
        outs.append([(tuple(o.shape), o.dtype) for o in (out if isinstance(out, tuple | list) else (out,))])
    assert outs[0] == outs[1]
    layer_ops = (counts[0] - counts[1]) / 4  # four layers not run: each a linear, an activation, a linear, an add
    assert layer_ops >= 8, counts


def test_no_signature_pass_rewrites_the_joint_graph(monkeypatch):
    """passes/joint.py keeps the first caller's joint graph as its memo, uncopied: that holds only while no pass
    after the trace rewrites the joint graph itself (they build modules of their own). Every signature pass on
    (SP collective matmul, selective recompute, gradients accumulated into buffers) leaves it as traced."""
    from mcompile.compiler import build_joint
    from mcompile.ir.config import Config
    from mcompile.passes import joint as J

    model, inputs = build("llama3-tiny-deep")
    program, args = _program_and_args(model, inputs, "tp=2", {}, {"sequence_parallel": True})
    monkeypatch.setattr(J, "_TRACED", type(J._TRACED)())
    jp = build_joint(copy.deepcopy(program), list(args), Config(tp_overlap=2, recompute="selective"),
                     accumulate=True)
    assert jp.tp_overlap and any(d.chunks > 1 for d in jp.tp_overlap)  # the collective matmul rewrite ran
    monkeypatch.setattr(J, "_TRACED", type(J._TRACED)())
    fresh = J.trace_joint(copy.deepcopy(program), list(args))
    assert _structure(jp.joint.gm) == _structure(fresh.gm)
