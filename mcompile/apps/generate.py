"""Text generation with a compiler-made KV cache, as parallel inference programs (issue 17).

``Generator(model, mesh)`` captures the model's logits forward (``model(ids)``; a Hugging Face
model's logits with ``use_cache=False``), adds a KV cache to the graph (passes/kv_cache.py: a
*prefill* and a *decode* graph), captures the decode graph again with torch.export (fresh shapes,
with a symbolic past length ``P``), plans both with the training planner and lowers them per rank:

- tp: Megatron's layout. Attention is head-parallel, so the cache is too: each rank holds its
  heads of every cache (``keep_cache_local`` removes the slice/gather the replicated-input rule of
  the planner would put around it). One decode step costs the training forward's collectives: 2
  all-reduces per layer, one for the vocab-parallel embedding and the logits' all-gather.
  The decode plan is pinned to the prefill plan's parameter placements (one set of local pieces).
- dp: the batch of prompts is split; each dp rank decodes (and caches) its own sequences; the new
  tokens are all-gathered every step, so every rank returns the whole batch.
- pp: each graph is cut into stages at transformer block boundaries (mcompile.passes.pp.stages at layer
  granularity, on the graph without its cache outputs: the prefill split balanced by the
  planner's cost proxy or pinned by ``Config.layers_per_stage``, the decode split pinned to the
  same layers), after the rank passes, by passes/pipeline_split.py. A stage program takes (the
  ids; the previous stage's boundary activation; its own caches) and returns (the activation for
  the next stage, or the logits on the last stage; its own caches): a cache never leaves the
  stage owning its layer (a decode stage that reads another stage's cache only for the past
  length reads one of its own instead). One microbatch, forward only, by this module's own small
  executor (the training pipeline, runtime/pipeline.py, is used only as the parameter store):
  stage s receives from s-1 (blocking), runs, sends to s+1 — messages flow one way, so no rank
  waits in a cycle under NCCL's rule that a send completes when its receive is posted — and the
  last stage's token (greedy or sampled: the same on its tp ranks) is broadcast over the pipeline
  group. Receive buffers are sized by running every stage on fake tensors once per batch / prompt
  shape. One decode step per stage: its layers' tp collectives, one message per stage boundary,
  one token broadcast. Sequences are not pipelined (one microbatch): a step takes the sum of the
  stages' times, so pp serves a model too large for one tp group, not throughput.

Sampling (greedy, temperature, nucleus/top-p after Holtzman et al. 2020) draws one uniform number
per sequence from one ``torch.Generator`` seeded with ``seed`` for the whole (global) batch, and
picks the token by inverse CDF over the filtered distribution: every rank computes the same token,
at any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile.ir.mesh import Mesh

__all__ = ["GenerateError", "GenerationPlan", "Generator", "compile_generation", "rank_program", "sample_next"]


class GenerateError(ValueError):
    """A generation request that cannot be served; the message says what to do."""


# -- the logits module and its limits -------------------------------------------------------------


def _logits_module(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module whose ``forward(ids)`` returns logits, the state-dict prefix it lives under):
    ``CausalLMLoss`` (mcompile.models.hf) -> its Hugging Face model under ``m.``; else the model."""
    from mcompile.models.hf import CausalLMLoss

    if isinstance(model, CausalLMLoss):
        return model.m, "m."
    return model, ""


def _model_max_len(lm: torch.nn.Module) -> int | None:
    cfg = getattr(lm, "config", None)
    for attr in ("max_seq_len", "block_size", "max_position_embeddings", "n_positions"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# -- capture: wrap a graph as a module and export it again ----------------------------------------


class _GraphAsModule(torch.nn.Module):
    """``forward(ids, *cache)`` runs ``gm`` with the logits module's own parameters and buffers
    (this module holds the same children, so state-dict keys and tied weights are the model's)."""

    def __init__(self, lm: torch.nn.Module, gm: fx.GraphModule, cap, ids_ph: str, cache_phs: list[str]):
        super().__init__()
        for name, child in lm.named_children():
            self.add_module(name, child)
        for name, p in lm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        non_persistent = getattr(lm, "_non_persistent_buffers_set", set())
        for name, b in lm.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in non_persistent)
        self.config = getattr(lm, "config", None)
        object.__setattr__(self, "_gm", gm)
        order = []
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            if n.name in cap.params:
                order.append(("state", cap.params[n.name]))
            elif n.name in cap.buffers:
                order.append(("state", cap.buffers[n.name]))
            elif n.name in cap.constants:
                attr = f"_const{len(order)}"
                setattr(self, attr, cap.ep.constants[cap.constants[n.name]])
                order.append(("const", attr))
            elif n.name == ids_ph:
                order.append(("ids", None))
            else:
                order.append(("cache", cache_phs.index(n.name)))
        self._order = order

    def _state(self, fqn: str) -> torch.Tensor:
        path, _, attr = fqn.rpartition(".")
        mod = self.get_submodule(path)
        return mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]

    def forward(self, ids, *cache):
        for c in cache[1:]:  # one past length for every cache (export then gives them one symbol)
            torch._check(c.shape[2] == cache[0].shape[2])
        vals = []
        for kind, key in self._order:
            vals.append(self._state(key) if kind == "state" else getattr(self, key) if kind == "const" else
                        ids if kind == "ids" else cache[key])
        out = self._gm(*vals)
        return tuple(out)


def _recapture(lm, gm, cap, ids_ph, cache_phs, ids, cache, dtype, decode: bool, use_cache: bool = False,
               share=None):
    """torch.export of ``gm`` run as a module, on the meta device with parameters in ``dtype``:
    batch symbolic in every input; the sequence symbolic in ``ids`` (prefill) or the past length in
    the caches (decode: ids is [b, 1]). ``share(produce)``: ``produce`` (the serialised program) run
    on one rank, its result returned on every rank (as parallelize captures once)."""
    from torch.export import Dim

    from mcompile.capture.export import _from_exported, _record_aliases, from_packed, on_meta

    mod = _GraphAsModule(lm, gm, cap, ids_ph, cache_phs)
    # the past length as Dim.DYNAMIC: SDPA's meta kernel guards on its key's strides (min(8(P+1), 16(P+1)) ...),
    # true for every P but beyond what export's range check proves for a named Dim
    batch, seq, past = Dim("batch", min=1), Dim("seq", min=2), Dim.DYNAMIC
    first = {0: batch} if decode else {0: batch, 1: seq}
    shapes = (first, tuple({0: batch, 2: past} for _ in cache)) if cache else (first,)  # forward(ids, *cache)
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    args = (meta(ids), *(meta(c) for c in cache))
    key = None
    if share is not None:  # one rank exports (or reads the on-disk cache), every rank unpacks the same bytes
        def produce() -> bytes:
            from mcompile.capture import cache as capture_cache

            k = None
            if use_cache:
                code = hashlib.sha256(gm.code.encode()).hexdigest()
                k = capture_cache.key(mod, args, {}, dtype, extra=f"mcompile.apps.generate:{decode}:{code}")
                data = capture_cache.load(k)
                if data is not None:
                    return data
            with on_meta(mod, dtype):
                ep = torch.export.export(mod, args, dynamic_shapes=shapes, strict=False)
            data = capture_cache.pack(ep, "logits and the KV cache", False, _record_aliases(ep))
            if k is not None:
                capture_cache.store(k, data)
            return data

        return _symbols(from_packed(share(produce), mod), decode), mod
    if use_cache:  # the on-disk capture cache (mcompile.capture.cache), keyed by the graph's code too
        from mcompile.capture import cache as capture_cache

        code = hashlib.sha256(gm.code.encode()).hexdigest()
        key = capture_cache.key(mod, args, {}, dtype, extra=f"mcompile.apps.generate:{decode}:{code}")
        data = capture_cache.load(key)
        if data is not None:
            with contextlib.suppress(Exception):  # an unreadable entry is captured again
                return _symbols(from_packed(data, mod), decode), mod
    with on_meta(mod, dtype):
        ep = torch.export.export(mod, args, dynamic_shapes=shapes, strict=False)
    if key is not None:  # stored, and read back as a cached one would be (the same graph either way)
        data = capture_cache.pack(ep, "logits and the KV cache", False, _record_aliases(ep))
        capture_cache.store(key, data)
        return _symbols(from_packed(data, mod), decode), mod
    return _symbols(_from_exported(ep, mod, type(lm).__name__), decode), mod


def _symbols(new, decode: bool):
    new.output = "logits and the KV cache"
    if decode:
        pasts = {n.meta["val"].shape[2].node.expr for n in new.gm.graph.nodes
                 if n.op == "placeholder" and n.name in new.user_inputs[1:]}
        if len(pasts) != 1:
            raise AssertionError(f"the decode graph's caches have past lengths {pasts}; expected one symbol")
        new.symbols["past"] = pasts.pop()
    return new


def _plan(cap, mesh: Mesh, config, hints: dict, overrides: dict | None):
    """Plan one graph captured here as a :class:`mcompile.sharding.compiled.Compiled`: the model passes from
    ``canonicalize`` to ``assemble`` (mcompile.compiler.plan_model; no attention rewrite, no block repetition,
    no checks of a training plan; the stages are partitioned here, for both graphs alike)."""
    from mcompile.compiler import ModelState, PlanRequest, plan_model

    request = PlanRequest(overrides=overrides, vocab_pad_multiple=config.vocab_pad_multiple, attention=False,
                          repeat_blocks=False, checks=False, lower=False, stages=False)
    st = ModelState(None, mesh, None, None, request, cap=cap, hints=hints)
    return plan_model(st, start="canonicalize", upto="assemble").compiled


@dataclass
class _Program:
    gm: fx.GraphModule
    names: list[str]  # placeholder names, in call order
    key: dict[str, object]  # placeholder -> state key (fqn, or ("const", name))
    ids: str
    cache_in: list[str]
    cache_local: list[bool]  # per cache: each rank holds its heads only
    # pipeline parallelism: the stage program of ``stage``; it takes (state, user inputs, then the last
    # ``n_recv`` placeholders: the previous stage's activations) and returns (``n_send`` activations for
    # the next stage, or the logits on the last stage; then its own caches: global indices ``caches``)
    stage: int = 0
    n_recv: int = 0
    n_send: int = 0
    caches: list[int] | None = None


def sample_next(logits: torch.Tensor, u: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """Next token per row of ``logits`` [b, V]: argmax at ``temperature == 0``; else from
    ``softmax(logits / temperature)`` restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020), picked by inverse CDF
    with the uniform numbers ``u`` [b] — so the same ``u`` gives the same token on every rank."""
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p, idx = probs.sort(-1, descending=True)
    csum = p.cumsum(-1)
    keep = (csum - p) < top_p  # a token is kept if the mass before it is short of top_p: the first always
    p = p * keep
    c = p.cumsum(-1)
    target = (u.double() * c[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(c, target, right=True).clamp(max=p.shape[-1] - 1)
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)  # never past the kept set (rounding)
    return idx.gather(-1, pick).squeeze(-1)



@dataclass
class GenerationPlan:
    """The two planned graphs of generation (no processes needed: a fake mesh plans too)."""

    prefill: object  # mcompile.api.Compiled: (params, ids[b, s]) -> (logits, k_0, v_0, ...)
    decode: object  # mcompile.api.Compiled: (params, ids[b, 1], cache...) -> (logits, k'_0, v'_0, ...)
    mesh: Mesh
    max_seq_len: int
    heads: tuple[int, ...]  # per attention: heads of its cache (all ranks together)
    head_dims: tuple[int, ...]
    dtypes: tuple = ()  # per attention: the dtype of its cache


def compile_generation(model: torch.nn.Module, mesh: Mesh | None = None, *, config=None,
                       max_seq_len: int | None = None, share=None) -> GenerationPlan:
    """Capture ``model``'s logits forward, add the KV cache (passes/kv_cache.py) and plan the prefill
    and decode graphs over ``mesh`` (None: one process). The decode plan takes the prefill plan's
    parameter placements, so one set of local pieces serves both. Under pp each graph is split
    into stages by layer (``GenerationPlan.prefill.partition``, ``.decode.partition``).
    ``share(produce)``: runs ``produce`` on one rank and returns its result on every rank (the
    :class:`Generator` on torch.distributed: rank 0 captures, every rank plans from its bytes)."""
    from mcompile.capture.export import BATCH, SEQ
    from mcompile.compiler import ModelState, PlanRequest, plan_model
    from mcompile.ir.config import Config
    from mcompile.ir.plan import PlanError
    from mcompile.passes.kv_cache import cache_names

    config = config or Config()
    lm, _ = _logits_module(model)
    limit = _model_max_len(lm)
    if max_seq_len is not None and limit is not None and max_seq_len > limit:
        raise GenerateError(f"max_seq_len={max_seq_len} exceeds the model's limit of {limit} positions "
                            f"({type(lm).__name__}.config); use max_seq_len <= {limit}")
    max_seq_len = max_seq_len or limit
    if max_seq_len is None:
        raise GenerateError(f"{type(lm).__name__} has no config giving its maximum sequence length: pass "
                            "max_seq_len= (prompt + new tokens)")
    if mesh is not None and mesh.size("pp") > 1:
        unsupported = [a for a in mesh.axis_names if a not in ("dp", "tp", "pp") and mesh.size(a) > 1]
        if unsupported:
            raise GenerateError(f"{mesh!r}: generation under pipeline parallelism supports dp, tp and pp axes; "
                                f"remove {unsupported} (e.g. fold it into dp)")
        if config.virtual_stages != 1:
            raise GenerateError(f"Config(virtual_stages={config.virtual_stages}): generation runs one stage per "
                                "pipeline rank; use virtual_stages=1")
    mesh = mesh or Mesh(dp=1)  # one process: no tp axis, no collectives
    if "dp" not in mesh.axis_names and "tp" not in mesh.axis_names:
        # pp alone: planned with a dp axis of 1 (the lowering places values along the planned axes, and the
        # planner plans none over pp); the same ranks and coordinates
        axes = {"dp": 1, **dict(mesh.axes)}
        mesh = Mesh.fake(**axes) if mesh.fake_mesh else Mesh(**axes)
    ids = torch.zeros(2, 4, dtype=torch.long, device="meta")
    # 1. the logits graph captured on meta in the compute dtype (as parallelize captures), canonical (no-op slices
    # dropped: the repeat_kv pattern is found through them), and 2. the KV cache's prefill and decode graphs made
    # from it: the model passes capture .. kv_cache (mcompile.compiler.plan_model)
    request = PlanRequest(meta_dtype=config.dtype, capture_cache=config.capture_cache, share=share,
                          repeat_blocks=False, attention=False, checks=False, kv_cache=True)
    st = plan_model(ModelState(lm, mesh, (ids,), None, request), upto="canonicalize")
    cap0 = st.cap
    if len(cap0.user_inputs) != 1:
        raise GenerateError(f"{type(lm).__name__}(ids) takes {len(cap0.user_inputs)} tensor inputs; generation "
                            "calls the model with the token ids alone")
    ids_ph = cap0.user_inputs[0]
    graphs = plan_model(st, start="kv_cache", upto="kv_cache").kv_graphs
    n_attn = len(graphs.heads)
    cache = [torch.zeros(2, graphs.heads[i // 2], 3, graphs.head_dims[i // 2], dtype=graphs.dtypes[i // 2],
                         device="meta") for i in range(2 * n_attn)]
    # 3. prefill changed no node (extra outputs only): the capture's metadata holds; decode's shapes
    # changed, so it is captured again; both planned like a training graph
    pre_cap = dataclasses.replace(cap0, gm=graphs.prefill, output="logits and the KV cache")
    dec_cap, _ = _recapture(lm, graphs.decode, cap0, ids_ph, cache_names(n_attn), ids[:, :1], cache, config.dtype,
                            decode=True, use_cache=config.capture_cache, share=share)
    hint = max(2, min(max_seq_len, 2048))
    pre = _plan(pre_cap, mesh, config, {pre_cap.symbols[BATCH]: 2, pre_cap.symbols[SEQ]: hint},
                config.overrides or None)
    # (a vocabulary-padded weight is left to the planner: pinned, it would lose its padding; it lands on the
    # same placement by its first use, checked below)
    pinned = {fqn: dict(zip(mesh.axis_names, p.placements)) for fqn, p in pre.plan.params.items()
              if p.padded_shape is None}
    dec_hints = {dec_cap.symbols[BATCH]: 2, dec_cap.symbols["past"]: hint}
    if mesh.size("tp") > 1:
        # the cache head-parallel: each cat(past, new) placed S(1) over tp. The planner never slices a static
        # dim of a replicated input (it would in training mean a wasted copy), so it would gather the new
        # row instead; pinned here, the lowering's slice of the cache input and gather of the cache output
        # are then removed per rank (passes/kv_cache.keep_cache_local)
        from mcompile.ir.placements import Shard

        cats = {f"node:{u.name}": {"tp": Shard(1)} for n in dec_cap.gm.graph.nodes
                if n.op == "placeholder" and n.name in dec_cap.user_inputs[1:] for u in n.users
                if u.target is torch.ops.aten.cat.default}
        try:
            dec = _plan(dec_cap, mesh, config, dec_hints, {**pinned, **cats})
        except PlanError:  # no head-parallel layout for this attention: the cache stays whole on every rank
            dec = _plan(dec_cap, mesh, config, dec_hints, pinned)
    else:
        dec = _plan(dec_cap, mesh, config, dec_hints, pinned)
    differ = [f for f, p in pre.plan.params.items() if dec.plan.params[f] != p]
    if differ:
        raise AssertionError(f"the decode plan places {differ[0]} otherwise than the prefill plan "
                             f"({dec.plan.params[differ[0]]} vs {pre.plan.params[differ[0]]})")
    if mesh.size("pp") > 1:
        _partition_stages(pre, dec, mesh.size("pp"), config, hint)
    return GenerationPlan(pre, dec, mesh, max_seq_len, graphs.heads, graphs.head_dims, graphs.dtypes)


def _partition_stages(pre, dec, pp: int, config, seq: int) -> None:
    """Stage partitions of the prefill and decode graphs (``Compiled.partition``), cut at transformer
    block boundaries (mcompile.passes.pp.stages, granularity ``"layer"``): the prefill graph's split,
    balanced by the planner's cost proxy or pinned by ``config.layers_per_stage``, and the decode
    graph pinned to the same layers per stage, so one stage holds the same parameters (and caches)
    in both."""
    from mcompile.passes.pp.stages import PartitionError, partition
    from mcompile.sharding.blocks import analyse

    def trunk(cap):
        # the graph's structure without its cache outputs: a layer's K and V are outputs, live to the end, so
        # no single activation would cross a layer boundary (no narrow point) in the graph as it is
        g = fx.Graph()
        out = g.graph_copy(cap.gm.graph, {})
        g.output(out[0])
        gm = fx.GraphModule(cap.gm, g)
        missing = [n.name for n in cap.gm.graph.nodes if n.op == "call_function" and n.name not in
                   {m.name for m in g.nodes}]
        if missing:
            raise AssertionError(f"copying {missing[0]} renamed it")
        return analyse(gm, cap.params)

    lps = list(config.layers_per_stage) if config.layers_per_stage else None
    try:
        pre.partition = partition(pre.captured, pp, 1, granularity="layer", seq=seq, layers_per_stage=lps,
                                  trunk=trunk(pre.captured))
        starts = pre.partition.trunk.layer_starts
        edges = [0, *(starts.index(c) for c in pre.partition.cuts), len(starts)]  # cuts are layer starts
        lps = [b - a for a, b in zip(edges[:-1], edges[1:])]
        # (the decode costs are in the past length: evaluated there, though the pinned split does not read them)
        symbols = {**dec.captured.symbols, "seq": dec.captured.symbols["past"]}
        dec_cap = dataclasses.replace(dec.captured, symbols=symbols)
        dec.partition = partition(dec_cap, pp, 1, granularity="layer", layers_per_stage=lps, seq=seq,
                                  trunk=trunk(dec.captured))
    except PartitionError as e:
        raise GenerateError(f"cannot split generation into pp={pp} stages by layer: {e}") from e


def rank_program(compiled, rank: int, config, device=None, decode: bool = False) -> _Program:
    """The program ``rank`` runs for prefill or decode: the rank passes of training
    (mcompile.compiler.rank_programs), then the cache kept head-sharded (``keep_cache_local``)."""
    gm, cache_in, outs = _rank_graph(compiled, rank, config, device, decode)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return _Program(gm, names, {}, compiled.captured.user_inputs[0], cache_in, outs)


def _rank_graph(compiled, rank: int, config, device, decode: bool):
    """(the rank's program, its cache inputs, the layouts of its cache outputs): the rank passes of
    training, the backward-only copies dropped, each cache kept on the rank (``keep_cache_local``)."""
    from mcompile.compiler import rank_programs
    from mcompile.passes.kv_cache import drop_backward_only, keep_cache_local

    cap = compiled.captured
    gm = rank_programs(compiled, rank, config, device).program
    drop_backward_only(gm)
    n_out = len(cap.gm.graph.output_node().args[0])
    cache_in = list(cap.user_inputs[1:]) if decode else []
    ins, outs = keep_cache_local(gm, cache_in, list(range(1, n_out)), "tp")
    if decode and ins != outs:
        raise AssertionError(f"cache inputs {ins} and outputs {outs} of the decode program differ in layout")
    return gm, cache_in, outs


class Generator:
    """Text generation for ``model`` over ``mesh`` with a KV cache made by the compiler.

    Call it on every rank, like :func:`mcompile.parallelize`, with the same model (its parameters may
    be on the meta device when ``weights`` is given: an mcompile checkpoint folder or a Hugging Face
    folder / ``.safetensors`` file, read piece by piece as ``parallelize(weights=)`` does). ``mesh``:
    ``None`` runs in this process alone (no collectives; the model needs values); a mesh of ``dp``
    and ``tp`` axes runs on torch.distributed (its size = the world size). ``max_seq_len``: the
    longest prompt + generation (default: the model config's limit). ``config``: a
    :class:`mcompile.Config` (``dtype``, ``vocab_pad_multiple``, ``fuse``, ``init_seed`` apply).

    A mesh with a ``pp`` axis (with ``dp`` and ``tp``, ``virtual_stages=1``) splits the model into
    stages by layer, each rank holding its stage's parameters and caches (module docstring);
    :meth:`prefill` / :meth:`decode` then return the logits on the last stage only (None on the
    others) and this stage's caches; :meth:`generate` and :meth:`logits` return the same on every
    rank. Not yet: padded prompts (attention masks); several microbatches in flight under pp."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh | None = None, *, weights=None,
                 max_seq_len: int | None = None, config=None):
        from mcompile.ir.config import Config

        config = config or Config()
        self.config = config
        lm, self._prefix = _logits_module(model)
        if mesh is not None and mesh.fake_mesh:
            raise GenerateError(f"{mesh!r} is for planning only: Generator runs; use compile_generation to plan")
        share = None
        if mesh is not None:  # one rank captures (torch.export is most of the start-up), every rank plans from it
            import datetime

            import torch.distributed as dist

            from mcompile.api import _from_rank0
            from mcompile.runtime.launch import init_distributed

            init_distributed(timeout=datetime.timedelta(seconds=config.collective_timeout_s))
            share = _from_rank0 if dist.get_world_size() > 1 else None
        plan = compile_generation(model, mesh, config=config, max_seq_len=max_seq_len, share=share)
        self.plan, self.mesh, self.max_seq_len = plan, plan.mesh, plan.max_seq_len
        self.attention_heads = plan.heads
        # this process's rank: programs and parameters
        if mesh is not None:
            self._setup_distributed(lm, weights)
        else:
            if weights is not None:
                raise GenerateError("weights= needs a mesh (e.g. Mesh(tp=1) under torchrun / spawn): the checkpoint "
                                    "is read by the parallel runtime; or load the weights into the model yourself")
            self._rank, self._device, self._comm = 0, torch.device("cpu"), None
            self._state = self._model_state(lm)
        self._pp = self.mesh.size("pp")
        if self._pp > 1:  # this rank's stage of each program (the others are kept for shape inference)
            self._stages = {"prefill": self._stage_programs(plan.prefill, False),
                            "decode": self._stage_programs(plan.decode, True)}
            self._stage = self.mesh.coords(self._rank)["pp"]
            self._specs: dict = {}  # (program, batch, seq) -> per stage: [(shape, dtype)] of what it sends
            self.prefill_program = self._stages["prefill"][self._stage]
            self.decode_program = self._stages["decode"][self._stage]
            if self.prefill_program.caches != self.decode_program.caches:
                raise AssertionError(f"stage {self._stage} makes caches {self.prefill_program.caches} in prefill but "
                                     f"updates {self.decode_program.caches} in decode")
        else:
            self.prefill_program = self._program(plan.prefill, False)
            self.decode_program = self._program(plan.decode, True)
        if self.mesh.size("tp") > 1 and self.prefill_program.cache_local != self.decode_program.cache_local:
            raise AssertionError(f"the prefill and decode programs disagree on which caches are head-sharded: "
                                 f"{self.prefill_program.cache_local} {self.decode_program.cache_local}")

    # -- set-up -----------------------------------------------------------------------------------------
    def _setup_distributed(self, lm, weights) -> None:
        import datetime

        import torch.distributed as dist

        from mcompile.runtime.launch import device_mesh, init_distributed, rank_device
        from mcompile.runtime.module import ParallelModule

        init_distributed(timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))
        world = dist.get_world_size()
        if self.mesh.size() != world:
            raise GenerateError(f"{self.mesh!r} has {self.mesh.size()} ranks but the world has {world} processes: make "
                                "the product of the mesh axes equal the number of processes")
        digest = hashlib.sha256((self.plan.prefill.plan.to_json() + self.plan.decode.plan.to_json())
                                .encode()).hexdigest()
        digests = [None] * world
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RuntimeError("ranks planned generation differently: build the same model with the same options on "
                               "every rank")
        device = rank_device()
        dmesh = device_mesh(device.type, self.mesh.shape, self.mesh.axis_names)
        # the parameter store: loading (weights=), meta-device initialisation and rank 0's broadcast as in training
        from mcompile.compiler import rank_programs

        programs = rank_programs(self.plan.prefill, dist.get_rank(), self.config, device)
        self._pm = ParallelModule(self.plan.prefill, dmesh, self.config, lm, weights=weights, programs=programs)
        self._rank, self._device, self._comm = dist.get_rank(), self._pm._device, self._pm._comm
        self._pm._leaves.refresh()
        cap = self.plan.prefill.captured
        if self.mesh.size("pp") > 1:  # the parameters of this rank's stage only (ParallelModule holds no others)
            compute = self._pm._leaves.compute
            local = {**self._pm._extra, **{ph: compute[f] for ph, f in cap.params.items() if f in compute}}
        else:
            local = self._pm._local_inputs()
        self._state = {}
        for ph, t in local.items():
            key = cap.params.get(ph) or cap.buffers.get(ph) or ("const", cap.constants.get(ph))
            self._state[key] = t

    def _model_state(self, lm) -> dict:
        """State keys -> the model's own tensors (mesh=None: one process holds everything)."""
        sd = dict(lm.state_dict(keep_vars=True))
        sd.update(dict(lm.named_buffers()))
        bad = [k for k, v in sd.items() if v.is_meta]
        if bad:
            raise GenerateError(f"the model is on the meta device ({bad[0]}, ...): give weights= and a mesh, or build "
                                "the model with values")
        params = {k for k, _ in lm.named_parameters(remove_duplicate=False)}
        return {k: v.detach().to(self.config.dtype) if k in params and v.is_floating_point() else v.detach()
                for k, v in sd.items()}  # parameters in the compute dtype, as captured; buffers as they are

    def _program(self, compiled, decode: bool) -> _Program:
        return self._keys(rank_program(compiled, self._rank, self.config, self._device, decode), compiled.captured)

    def _stage_programs(self, compiled, decode: bool) -> list[_Program]:
        """Every stage's program of this rank's pipeline (same tp coordinate): the rank program
        (:func:`rank_program`'s passes), its output cut to the logits, split by the stage partition
        (passes/pp/pipeline_split.py) and each stage given back the caches it makes as extra outputs —
        a cache never crosses a stage boundary. A decode stage reads another stage's cache only for
        its length (the position offset): read from one of its own caches instead."""
        from mcompile.ir import meta as M
        from mcompile.passes.pp.pipeline_split import split_stages

        aten = torch.ops.aten
        cap = compiled.captured
        gm, names, outs = _rank_graph(compiled, self._rank, self.config, self._device, decode)
        out = gm.graph.output_node()
        res = list(out.args[0])
        made = res[1:]  # each cache's node (no dead-code elimination below: it keeps its node and stage)
        out.args = ((res[0],),)
        stages = split_stages(gm, compiled.partition, cap.params, cap.user_inputs)
        where = [c.meta.get(M.STAGE) for c in made]
        if any(w is None for w in where):
            raise AssertionError(f"cache {where.index(None)} ({made[where.index(None)].name}) belongs to no stage")
        progs = []
        for st in stages:
            g = st.gm.graph
            owned = [i for i, w in enumerate(where) if w == st.index]
            if not owned:
                raise GenerateError(f"pipeline stage {st.index} holds no attention layer: use fewer stages")
            by_name = {n.name: n for n in g.nodes}
            o = g.output_node()
            sent = list(o.args[0]) if isinstance(o.args[0], tuple | list) else [o.args[0]]
            o.args = ((*sent, *(by_name[made[i].name] for i in owned)),)
            mine = [names[i] for i in owned] if decode else []
            if decode:
                phs = {n.name: n for n in g.nodes if n.op == "placeholder"}
                read = [c for c in names if c in phs and any(u.target is not aten.sym_size.int for u in phs[c].users)]
                if read != mine:
                    raise AssertionError(f"decode stage {st.index} reads caches {read} but makes {mine}")
                for c in names:
                    if c in phs and c not in mine:  # only its length (or batch) is read: take them from our own
                        for u in list(phs[c].users):
                            if u.args[1] not in (0, 2):
                                raise AssertionError(f"stage {st.index} reads dim {u.args[1]} of another stage's {c}")
                            u.replace_input_with(phs[c], phs[mine[0]])
                        g.erase_node(phs[c])
            g.lint()
            st.gm.recompile()
            prog = _Program(st.gm, [], {}, cap.user_inputs[0], mine, [outs[i] for i in owned], stage=st.index,
                            n_recv=len(st.received), n_send=0 if st.is_last else len(sent), caches=owned)
            progs.append(self._keys(prog, cap))
        return progs

    def _keys(self, prog: _Program, cap) -> _Program:
        gm = prog.gm
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        key = {}
        for n in names:
            if n in cap.params or n in cap.buffers:
                key[n] = cap.params.get(n) or cap.buffers.get(n)
            elif n in cap.constants:
                k = ("const", cap.constants[n])
                if k not in self._state:
                    t = cap.ep.constants[cap.constants[n]]
                    if t.is_meta and t.numel():
                        raise GenerateError(f"the model creates a tensor constant {cap.constants[n]} inside forward; "
                                            "capture on the meta device cannot see its values: make it a buffer")
                    self._state[k] = torch.empty(t.shape, dtype=t.dtype, device=self._device) if t.is_meta else \
                        t.to(self._device)
                key[n] = k
        prog.names, prog.key = names, key
        return prog

    @classmethod
    def from_module(cls, pm, model: torch.nn.Module, mesh: Mesh | None = None, **kwargs) -> Generator:
        """A generator with the current weights of a trained :class:`~mcompile.runtime.module.ParallelModule`
        ``pm`` of ``model`` (collective: call on every rank). ``mesh`` defaults to ``pm``'s with its ``pp``
        axis folded into ``dp`` (same world size). The weights pass through ``pm.full_state_dict()``:
        every rank holds the whole model on the host once, while loading."""
        if mesh is None:
            axes = dict(pm.mesh.axes)
            pp = axes.pop("pp", 1)
            if pp > 1:
                axes = {"dp": axes.pop("dp", 1) * pp, **axes}
            mesh = Mesh(**axes)
        kwargs.setdefault("config", None)
        sd = pm.full_state_dict()
        gen = cls(model, mesh, **kwargs)
        gen._pm.load_full_state_dict({k[len(gen._prefix):]: v for k, v in sd.items() if k.startswith(gen._prefix)})
        gen._pm._leaves.refresh()
        return gen

    # -- running ----------------------------------------------------------------------------------------
    def _call(self, prog: _Program, ids: torch.Tensor, cache: list) -> tuple:
        from mcompile.ir import ops

        user = {prog.ids: ids, **dict(zip(prog.cache_in, cache))}
        args = [self._state[prog.key[n]] if n in prog.key else user[n] for n in prog.names]
        with torch.no_grad():
            if self._comm is None:
                return prog.gm(*args)
            with ops.bind(self._comm):
                return prog.gm(*args)

    # -- pipeline parallelism: this rank's stage, one microbatch --------------------------------------------
    def _peer(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's pipeline (same dp and tp coordinates)."""
        return self.mesh.rank_of(**{**self.mesh.coords(self._rank), "pp": stage})

    def _boundary_specs(self, which: str, b: int, s: int, past: int) -> list[list[tuple]]:
        """Per stage, [(shape, dtype)] of what it sends (the last stage: its logits), for ``b`` local
        sequences of ``s`` new tokens after ``past`` cached ones: every stage of the pipeline run on
        fake tensors (no memory, no communication), as the receiver must post buffers of the right
        size. Cached per (program, b, s); decode's (one token) per b: a boundary activation does not
        depend on the past length (checked by the sender at every step)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from mcompile.ir import ops

        key = (which, b, s) if which == "prefill" else (which, b)
        if key in self._specs:
            return self._specs[key]
        tp = self.mesh.size("tp")
        plan = self.plan
        cap = (plan.prefill if which == "prefill" else plan.decode).captured
        out = []
        with FakeTensorMode(allow_non_fake_inputs=True), ops.bind(self._comm), torch.no_grad():
            carried: list = []
            for prog in self._stages[which]:
                user = {prog.ids: torch.zeros(b, s, dtype=torch.long, device=self._device)}
                for name, i, local in zip(prog.cache_in, prog.caches, prog.cache_local):
                    heads = plan.heads[i // 2] // tp if local else plan.heads[i // 2]
                    user[name] = torch.empty(b, heads, past, plan.head_dims[i // 2], dtype=plan.dtypes[i // 2],
                                             device=self._device)
                args = []
                for n in prog.names[:len(prog.names) - prog.n_recv]:
                    if n in user:
                        args.append(user[n])
                    elif prog.key[n] in self._state:
                        args.append(self._state[prog.key[n]])
                    else:  # another stage's parameter: its local shape
                        pp = self.plan.prefill.plan.params[cap.params[n]]
                        args.append(torch.empty(pp.local_shape, dtype=self.config.dtype, device=self._device))
                res = prog.gm(*args, *carried)
                sent = list(res[:prog.n_send]) if prog.n_send else [res[0]]
                out.append([(tuple(int(d) for d in t.shape), t.dtype) for t in sent])
                carried = [torch.empty(t.shape, dtype=t.dtype, device=self._device) for t in sent]
        self._specs[key] = out
        return out

    def _run_stage(self, which: str, ids: torch.Tensor, cache: list, past: int) -> tuple:
        """This rank's stage of ``which`` on one microbatch: receive the previous stage's activations
        (blocking), run, send ours to the next stage (its receive is already posted or comes next:
        messages only flow forward, so nothing waits in a cycle). Returns (the logits on the last
        stage, else None; this stage's caches)."""
        import torch.distributed as dist

        from mcompile.ir import ops

        prog = self._stages[which][self._stage]
        specs = self._boundary_specs(which, ids.shape[0], ids.shape[1], past)
        group = self._comm.groups["pp"]
        recv = []
        if prog.stage > 0:
            for shape, dtype in specs[prog.stage - 1]:
                t = torch.empty(shape, dtype=dtype, device=self._device)
                dist.recv(t, src=self._peer(prog.stage - 1), group=group)
                recv.append(t)
        user = {prog.ids: ids, **dict(zip(prog.cache_in, cache))}
        args = [self._state[prog.key[n]] if n in prog.key else user[n]
                for n in prog.names[:len(prog.names) - prog.n_recv]]
        with torch.no_grad(), ops.bind(self._comm):
            out = prog.gm(*args, *recv)
        if prog.n_send:
            for t, (shape, dtype) in zip(out[:prog.n_send], specs[prog.stage]):
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise AssertionError(f"stage {prog.stage} sends {list(t.shape)} {t.dtype} where shape inference "
                                         f"gave {list(shape)} {dtype}")
                dist.send(t.contiguous(), dst=self._peer(prog.stage + 1), group=group)
            return None, list(out[prog.n_send:])
        return out[0], list(out[1:])

    def _from_last_stage(self, t: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        """``t`` (made on the last stage) on every stage of this pipeline: one broadcast over pp."""
        import torch.distributed as dist

        if self._stage != self._pp - 1:
            t = torch.empty(shape, dtype=dtype, device=self._device)
        t = t.contiguous()
        dist.broadcast(t, src=self._peer(self._pp - 1), group=self._comm.groups["pp"])
        return t

    def _local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        dp = self.mesh.size("dp")
        if ids.shape[0] % dp:
            raise GenerateError(f"a batch of {ids.shape[0]} prompts does not divide by dp={dp}: use a multiple of "
                                f"{dp} prompts")
        coord = self.mesh.coords(self._rank).get("dp", 0)
        return ids.chunk(dp)[coord].to(self._device)

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("dp") == 1:
            return t
        return self._comm.all_gather(t.contiguous(), 0, "dp")

    def _check_ids(self, ids, what: str = "prompt_ids") -> None:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype not in (torch.long, torch.int32):
            raise GenerateError(f"{what} must be an integer tensor [batch, seq]; got "
                                f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
        if ids.shape[1] < 1 or ids.shape[0] < 1:
            raise GenerateError(f"{what} is empty ({list(ids.shape)}): give at least one token per prompt")

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full logits [b, s, V] of ``ids`` (the prefill program; gathered over tp and dp), every rank."""
        self._check_ids(ids, "ids")
        if ids.shape[1] > self.max_seq_len:
            raise GenerateError(f"{ids.shape[1]} tokens exceed max_seq_len={self.max_seq_len}")
        if self._pp > 1:
            local = self._local_rows(ids.long())
            logits, _ = self._run_stage("prefill", local, [], 0)
            shape, dtype = self._boundary_specs("prefill", *local.shape, 0)[-1][0]
            return self._gather_dp(self._from_last_stage(logits, shape, dtype))
        out = self._call(self.prefill_program, self._local_rows(ids.long()), [])
        return self._gather_dp(out[0])

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [b_local, s, V], this rank's cache) of this rank's rows (dp slice) of ``ids``.
        Under pp: the logits on the last stage (None on the others), the caches of this rank's stage."""
        if self._pp > 1:
            return self._run_stage("prefill", self._local_rows(ids.long()), [], 0)
        out = self._call(self.prefill_program, self._local_rows(ids.long()), [])
        return out[0], [c.contiguous() for c in out[1:]]

    def decode(self, next_ids: torch.Tensor, cache: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [b_local, 1, V], the cache one position longer) for this rank's ``next_ids`` [b_local, 1].
        Under pp: the logits on the last stage (None on the others); ``cache``: this rank's stage's."""
        if self._pp > 1:
            return self._run_stage("decode", next_ids.to(self._device), cache, int(cache[0].shape[2]))
        out = self._call(self.decode_program, next_ids, cache)
        return out[0], list(out[1:])

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos_id: int | None = None) -> torch.Tensor:
        """``prompt_ids`` [b, s] followed by ``max_new_tokens`` generated tokens: [b, s + n], the same on
        every rank. ``temperature`` 0: greedy; else sampled from softmax(logits / temperature) within
        the ``top_p`` nucleus, with one generator seeded by ``seed`` (default 0). ``eos_id``: a sequence
        that produced it is filled with it from then on (and decoding stops when all have)."""
        self._check_ids(prompt_ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise GenerateError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        if temperature < 0 or not 0.0 < top_p <= 1.0:
            raise GenerateError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
        b, s = prompt_ids.shape
        if s + max_new_tokens > self.max_seq_len:
            raise GenerateError(
                f"a prompt of {s} tokens + max_new_tokens={max_new_tokens} = {s + max_new_tokens} positions exceeds "
                f"max_seq_len={self.max_seq_len}: shorten the prompt or generate at most {self.max_seq_len - s} tokens")
        out = [prompt_ids.long().cpu()]
        if max_new_tokens == 0:
            return out[0]
        gen = torch.Generator().manual_seed(0 if seed is None else int(seed))
        dp, coord = self.mesh.size("dp"), self.mesh.coords(self._rank).get("dp", 0)
        logits, cache = self.prefill(prompt_ids)
        done = torch.zeros(b, dtype=torch.bool)
        for t in range(max_new_tokens):
            u = torch.rand(b, generator=gen, dtype=torch.float64)  # the whole batch's draws, on every rank
            mine = u.chunk(dp)[coord].to(self._device)
            if self._pp > 1:  # picked on the last stage (every tp rank of it alike), broadcast over the pipeline
                pick = None if logits is None else sample_next(logits[:, -1].float(), mine, temperature, top_p)
                pick = self._from_last_stage(pick, (b // dp,), torch.long)
            else:
                pick = sample_next(logits[:, -1].float(), mine, temperature, top_p)
            nxt = self._gather_dp(pick).cpu()
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out.append(nxt[:, None])
            if t == max_new_tokens - 1:
                break
            if eos_id is not None and bool(done.all()):
                out.append(torch.full((b, max_new_tokens - 1 - t), eos_id, dtype=torch.long))
                break
            logits, cache = self.decode(self._local_rows(nxt[:, None]), cache)
        return torch.cat(out, 1)

    def collectives(self, which: str = "decode") -> list[str]:
        """The collectives one call of this rank's ``"decode"`` or ``"prefill"`` program runs, in order
        (``"op/axis"``, e.g. ``"all_reduce/tp"``). Under pp, one step of this rank's stage: the
        activations received from the previous stage (``"recv/pp"``), the stage program's
        collectives, those sent to the next (``"send/pp"``), and the chosen token's
        ``"broadcast/pp"`` from the last stage (:meth:`generate` runs it after each program call)."""
        from mcompile.ir.ops import OPS

        prog = self.decode_program if which == "decode" else self.prefill_program
        ours = {v: k for k, v in OPS.items()}
        ops_ = [f"{ours[n.target]}/{next(a for a in n.args if isinstance(a, str))}"
                for n in prog.gm.graph.nodes if n.op == "call_function" and n.target in ours]
        if self._pp > 1:
            ops_ = ["recv/pp"] * prog.n_recv + ops_ + ["send/pp"] * prog.n_send + ["broadcast/pp"]
        return ops_
