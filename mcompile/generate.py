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
- pp: not supported yet (see :class:`Generator`).

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

from mcompile.mesh import Mesh

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


def _recapture(lm, gm, cap, ids_ph, cache_phs, ids, cache, dtype, decode: bool, use_cache: bool = False):
    """torch.export of ``gm`` run as a module, on the meta device with parameters in ``dtype``:
    batch symbolic in every input; the sequence symbolic in ``ids`` (prefill) or the past length in
    the caches (decode: ids is [b, 1])."""
    from torch.export import Dim

    from mcompile.capture import _from_exported, _record_aliases, from_packed, on_meta

    mod = _GraphAsModule(lm, gm, cap, ids_ph, cache_phs)
    # the past length as Dim.DYNAMIC: SDPA's meta kernel guards on its key's strides (min(8(P+1), 16(P+1)) ...),
    # true for every P but beyond what export's range check proves for a named Dim
    batch, seq, past = Dim("batch", min=1), Dim("seq", min=2), Dim.DYNAMIC
    first = {0: batch} if decode else {0: batch, 1: seq}
    shapes = (first, tuple({0: batch, 2: past} for _ in cache)) if cache else (first,)  # forward(ids, *cache)
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    args = (meta(ids), *(meta(c) for c in cache))
    key = None
    if use_cache:  # the on-disk capture cache (mcompile.capture_cache), keyed by the graph's code too
        from mcompile import capture_cache

        code = hashlib.sha256(gm.code.encode()).hexdigest()
        key = capture_cache.key(mod, args, {}, dtype, extra=f"mcompile.generate:{decode}:{code}")
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
    """Plan and package one graph as :class:`mcompile.api.Compiled` (compile_plan's steps, for a
    capture made here)."""
    from mcompile.annotate import annotate
    from mcompile.api import Compiled
    from mcompile.passes import canonicalize
    from mcompile.plan import PlanOptions, SPVariant
    from mcompile.planner import assemble_plan, plan_axes

    canon = canonicalize(cap.gm)
    annotation = annotate(cap.gm)
    axes = plan_axes(cap, mesh, False, overrides, hints)
    options = PlanOptions(sequence_parallel=False, sp_variant=SPVariant.SAVE_GATHERED,
                          vocab_pad_multiple=config.vocab_pad_multiple)
    plan = assemble_plan(cap, mesh, axes, options, overrides)
    return Compiled(cap, plan, mesh, axes, canon, annotation)


@dataclass
class _Program:
    gm: fx.GraphModule
    names: list[str]  # placeholder names, in call order
    key: dict[str, object]  # placeholder -> state key (fqn, or ("const", name))
    ids: str
    cache_in: list[str]
    cache_local: list[bool]  # per cache: each rank holds its heads only


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


def compile_generation(model: torch.nn.Module, mesh: Mesh | None = None, *, config=None,
                       max_seq_len: int | None = None) -> GenerationPlan:
    """Capture ``model``'s logits forward, add the KV cache (passes/kv_cache.py) and plan the prefill
    and decode graphs over ``mesh`` (None: one process). The decode plan takes the prefill plan's
    parameter placements, so one set of local pieces serves both."""
    from mcompile.capture import BATCH, SEQ, capture
    from mcompile.config import Config
    from mcompile.passes import canonicalize
    from mcompile.passes.kv_cache import add_kv_cache, cache_names
    from mcompile.propagate import PlanError

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
        raise GenerateError(
            f"{mesh!r}: generation under pipeline parallelism is not supported yet (the runtime's pipeline "
            "has no forward-only path that keeps a per-stage KV cache between calls); use a mesh of dp and tp "
            "with the same number of ranks, e.g. Mesh(dp=..., tp=...)")
    mesh = mesh or Mesh(dp=1)  # one process: no tp axis, no collectives
    ids = torch.zeros(2, 4, dtype=torch.long, device="meta")
    # 1. the logits graph, captured on meta in the compute dtype (as parallelize captures)
    cap0 = capture(lm, (ids,), meta_dtype=config.dtype, cache=config.capture_cache)
    if len(cap0.user_inputs) != 1:
        raise GenerateError(f"{type(lm).__name__}(ids) takes {len(cap0.user_inputs)} tensor inputs; generation "
                            "calls the model with the token ids alone")
    ids_ph = cap0.user_inputs[0]
    # 2. the KV cache: prefill and decode graphs, from the canonical form (no-op slices dropped: the
    # repeat_kv pattern is found through them)
    canonicalize(cap0.gm)
    graphs = add_kv_cache(cap0.gm, ids_ph, set(cap0.user_inputs))
    n_attn = len(graphs.heads)
    cache = [torch.zeros(2, graphs.heads[i // 2], 3, graphs.head_dims[i // 2], dtype=graphs.dtypes[i // 2],
                         device="meta") for i in range(2 * n_attn)]
    # 3. prefill changed no node (extra outputs only): the capture's metadata holds; decode's shapes
    # changed, so it is captured again; both planned like a training graph
    pre_cap = dataclasses.replace(cap0, gm=graphs.prefill, output="logits and the KV cache")
    dec_cap, _ = _recapture(lm, graphs.decode, cap0, ids_ph, cache_names(n_attn), ids[:, :1], cache, config.dtype,
                            decode=True, use_cache=config.capture_cache)
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
        from mcompile.placements import Shard

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
    return GenerationPlan(pre, dec, mesh, max_seq_len, graphs.heads, graphs.head_dims)


def rank_program(compiled, rank: int, config, device=None, decode: bool = False) -> _Program:
    """The program ``rank`` runs for prefill or decode: the rank passes of training
    (mcompile.compiler.rank_programs), then the cache kept head-sharded (``keep_cache_local``)."""
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
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return _Program(gm, names, {}, cap.user_inputs[0], cache_in, outs)


class Generator:
    """Text generation for ``model`` over ``mesh`` with a KV cache made by the compiler.

    Call it on every rank, like :func:`mcompile.parallelize`, with the same model (its parameters may
    be on the meta device when ``weights`` is given: an mcompile checkpoint folder or a Hugging Face
    folder / ``.safetensors`` file, read piece by piece as ``parallelize(weights=)`` does). ``mesh``:
    ``None`` runs in this process alone (no collectives; the model needs values); a mesh of ``dp``
    and ``tp`` axes runs on torch.distributed (its size = the world size). ``max_seq_len``: the
    longest prompt + generation (default: the model config's limit). ``config``: a
    :class:`mcompile.Config` (``dtype``, ``vocab_pad_multiple``, ``fuse``, ``init_seed`` apply).

    Not yet: pipeline parallelism (a ``pp`` axis) — the decode program would run stage to stage
    with one microbatch, but the runtime's pipeline (runtime/pipeline.py) schedules training
    microbatches through joint forward/backward programs and has no forward-only path that carries
    extra per-stage state (each stage's cache) between calls; padded prompts (attention masks)."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh | None = None, *, weights=None,
                 max_seq_len: int | None = None, config=None):
        from mcompile.config import Config

        config = config or Config()
        self.config = config
        lm, self._prefix = _logits_module(model)
        if mesh is not None and mesh.fake_mesh:
            raise GenerateError(f"{mesh!r} is for planning only: Generator runs; use compile_generation to plan")
        plan = compile_generation(model, mesh, config=config, max_seq_len=max_seq_len)
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
        self.prefill_program = self._program(plan.prefill, False)
        self.decode_program = self._program(plan.decode, True)
        if self.mesh.size("tp") > 1 and self.prefill_program.cache_local != self.decode_program.cache_local:
            raise AssertionError(f"the prefill and decode programs disagree on which caches are head-sharded: "
                                 f"{self.prefill_program.cache_local} {self.decode_program.cache_local}")

    # -- set-up -----------------------------------------------------------------------------------------
    def _setup_distributed(self, lm, weights) -> None:
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from mcompile.runtime.launch import init_distributed, rank_device
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
        dmesh = init_device_mesh(rank_device().type, self.mesh.shape, mesh_dim_names=self.mesh.axis_names)
        # the parameter store: loading (weights=), meta-device initialisation and rank 0's broadcast as in training
        self._pm = ParallelModule(self.plan.prefill, dmesh, self.config, lm, weights=weights)
        self._rank, self._device, self._comm = dist.get_rank(), self._pm._device, self._pm._comm
        self._pm._leaves.refresh()
        local = self._pm._local_inputs()
        cap = self.plan.prefill.captured
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
        prog = rank_program(compiled, self._rank, self.config, self._device, decode)
        gm = prog.gm
        cap = compiled.captured
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
        from mcompile import ops

        user = {prog.ids: ids, **dict(zip(prog.cache_in, cache))}
        args = [self._state[prog.key[n]] if n in prog.key else user[n] for n in prog.names]
        with torch.no_grad():
            if self._comm is None:
                return prog.gm(*args)
            with ops.bind(self._comm):
                return prog.gm(*args)

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
        out = self._call(self.prefill_program, self._local_rows(ids.long()), [])
        return self._gather_dp(out[0])

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [b_local, s, V], this rank's cache) of this rank's rows (dp slice) of ``ids``."""
        out = self._call(self.prefill_program, self._local_rows(ids.long()), [])
        return out[0], [c.contiguous() for c in out[1:]]

    def decode(self, next_ids: torch.Tensor, cache: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [b_local, 1, V], the cache one position longer) for this rank's ``next_ids`` [b_local, 1]."""
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
            mine = u.chunk(dp)[coord].to(logits.device)
            nxt = self._gather_dp(sample_next(logits[:, -1].float(), mine, temperature, top_p)).cpu()
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
        (``"op/axis"``, e.g. ``"all_reduce/tp"``)."""
        from mcompile.ops import OPS

        prog = self.decode_program if which == "decode" else self.prefill_program
        ours = {v: k for k, v in OPS.items()}
        return [f"{ours[n.target]}/{next(a for a in n.args if isinstance(a, str))}"
                for n in prog.gm.graph.nodes if n.op == "call_function" and n.target in ours]
