"""Rules borrowed from DTensor: for an aten op with no hand-written rule, ask torch's own sharding
propagator (``DTensor._op_dispatcher.sharding_propagator``) what the op can do on one mesh axis.

torch 2.13 keeps three registries there; the bridge reads two of them at run time:

- ``op_single_dim_strategy_funcs`` (most ops): ``func(op, args_meta, kwargs_meta)`` lists the valid
  placements of ONE mesh dim, ``[out_1, .., out_k, in_1, .., in_m]`` each, where
  ``_ShardingPlaceholder(d)`` means "sharded along tensor dim d". That is exactly one axis of ours;
  no mesh is involved.
- ``op_strategy_funcs`` (older rules): ``func(OpSchema)`` over ``OpStrategy`` inputs that carry a
  ``DeviceMesh``. The bridge builds a 1-D mesh of size n with ``_init_backend=False`` (no process
  group is created or looked up — DTensor's decomposition path builds its fake mesh the same way)
  and offers each tensor input every candidate placement (R, S(d), P(sum) for floats).
- ``op_to_rules`` (``convolution`` and its backward, in the pre-strategy ``OutputSharding`` form):
  not bridged.

Translation into :class:`Strategy`: ``Shard(d)`` and ``Replicate()`` as they are; ``Partial(sum)``
and ``Partial(max)`` as they are (the lowering reduces ``Partial(avg)`` too, on tp, but only the hand-written
mean rule is trusted to give it over equal shards: none of the bridged ops is checked for it); a strategy naming
``_StridedShard``, another Partial, or ``None`` (a masked-off output) is dropped, and so is one that
shards a static dim the axis does not divide (DTensor allows uneven shards; our lowering does not).
Symbolic sizes (batch, sequence) are replaced by large distinct multiples of n before asking torch,
since its strategy functions read plain ints.

An op is bridged only when running it on local pieces with its arguments unchanged is what the
strategy means, so these are refused (:func:`refusal` says which and why):

- ops that mutate (in-place and ``out=`` variants: a captured program is functional);
- ops drawing random numbers (each rank would draw its own);
- ops returning a list of tensors or non-tensors; ops outside the ``aten`` namespace (``prims``);
- ops whose size arguments DTensor rewrites for local pieces (``op_to_shape_and_stride_idx``,
  ``op_to_scalar_shape_adjuster``, squeeze variants): they need a localizer, i.e. a hand-written rule;
- :data:`DENIED`: ops whose DTensor strategies failed our property tests against single-device
  execution (tests/test_rules_dtensor.py), each with the failure.

Hand-written rules (the other modules of this package) always take priority: ``get_rule`` consults
the bridge only for an op none of them registers.
"""

from __future__ import annotations

import functools

import sympy
import torch
import torch.fx as fx

from mcompile.ir.placements import Partial, Replicate, Shard
from mcompile.sharding.rules.base import OpInfo, Strategy, TensorMeta

__all__ = ["DENIED", "bridge_rule", "bridged_ops", "dtensor_ops", "refusal"]

aten = torch.ops.aten
R = Replicate()
_PARTIALS = ("sum", "max")  # the Partial kinds taken from DTensor (module docstring: avg is not)
# Sizes stand-ins for symbols: n * 2520 (divisible by 1..10) times a distinct prime each.
_PRIMES = (11, 13, 17, 19, 23, 29, 31, 37)

# str(op) -> why its DTensor strategies are not used (found by tests/test_rules_dtensor.py's sweep).
DENIED: dict[str, str] = {
    'aten.__lshift__.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.__lshift__.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.__rshift__.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.__rshift__.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.__xor__.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.__xor__.Tensor': 'no OpInfo sample reaches it: untested',
    'aten._batch_norm_with_update_functional.default': 'no OpInfo sample reaches it: untested',
    'aten._conj.default': 'no OpInfo sample reaches it: untested',
    'aten._fft_c2c.default': 'no OpInfo sample reaches it: untested',
    'aten._fft_c2r.default': 'no OpInfo sample reaches it: untested',
    'aten._fft_r2c.default': 'no OpInfo sample reaches it: untested',
    'aten._fused_rms_norm.default': 'no OpInfo sample reaches it: untested',
    'aten._fused_rms_norm_backward.default': 'no OpInfo sample reaches it: untested',
    'aten._grouped_mm.default': 'no OpInfo sample reaches it: untested',
    'aten._linalg_det.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten._linalg_eigh.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten._linalg_slogdet.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten._linalg_solve_ex.default':
        'wrong against single-device execution: dtensor_partial[R,P(sum) -> P(sum),R,R,R]',
    'aten._linalg_svd.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten._native_batch_norm_legit.no_stats': 'no OpInfo sample reaches it: untested',
    'aten._native_batch_norm_legit_functional.default': 'no OpInfo sample reaches it: untested',
    'aten._native_batch_norm_legit_no_training.default': 'no OpInfo sample reaches it: untested',
    'aten._scaled_dot_product_flash_attention_backward.default': 'no OpInfo sample reaches it: untested',
    'aten._scaled_mm.default': 'no OpInfo sample reaches it: untested',
    'aten._upsample_bicubic2d_aa.default': 'no OpInfo sample reaches it: untested',
    'aten._upsample_lanczos2d_aa.default': 'no OpInfo sample reaches it: untested',
    'aten._upsample_nearest_exact2d.default': 'no OpInfo sample reaches it: untested',
    'aten._upsample_nearest_exact3d.default': 'no OpInfo sample reaches it: untested',
    'aten.adaptive_max_pool1d.default': 'no OpInfo sample reaches it: untested',
    'aten.all.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.all.dim': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.any.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.any.dim': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.any.dims': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.argmin.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.bitwise_and.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_and.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_left_shift.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_left_shift.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_left_shift.Tensor_Scalar': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_or.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_or.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_right_shift.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_right_shift.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_right_shift.Tensor_Scalar': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_xor.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_xor.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bitwise_xor.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.bucketize.Tensor':
        'wrong against single-device execution: dtensor_shard_partial[Replicate(),Shard(dim=0) -> Partial(sum)]',
    'aten.cholesky.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.cholesky_inverse.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.clamp_max.default': 'no OpInfo sample reaches it: untested',
    'aten.clip.Tensor': 'no OpInfo sample reaches it: untested',
    'aten.clip.default': 'no OpInfo sample reaches it: untested',
    'aten.copysign.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.diag.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.diag_embed.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.diagonal.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.diagonal_copy.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.diagonal_scatter.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.div.Scalar_mode': 'no OpInfo sample reaches it: untested',
    'aten.float_power.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.float_power.Tensor_Scalar': 'no OpInfo sample reaches it: untested',
    'aten.fmod.Scalar': 'no OpInfo sample reaches it: untested',
    'aten.gcd.default': 'no OpInfo sample reaches it: untested',
    'aten.geqrf.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.histc.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.lcm.default': 'no OpInfo sample reaches it: untested',
    'aten.linalg__powsum.default': 'no OpInfo sample reaches it: untested',
    'aten.linalg_cholesky_ex.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.linalg_cross.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.linalg_eig.default': 'no OpInfo sample reaches it: untested',
    'aten.linalg_ldl_solve.default':
        'wrong against single-device execution: dtensor_shard[Shard(dim=0),Shard(dim=0),Shard(dim=0) -> Shard(dim=0)]',
    'aten.linalg_lu_factor_ex.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.linalg_qr.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.logsumexp.default': 'wrong: keepdim ignored (S(2) -> S(1) for keepdim=True; tests/test_rules_dtensor.py)',
    'aten.max_pool1d_with_indices.default': 'no OpInfo sample reaches it: untested',
    'aten.median.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.median.dim': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.min.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.nanmedian.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.prod.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.remainder.Scalar_Tensor': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_t.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_t.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_u.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_u.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_v.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_v.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_w.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_chebyshev_polynomial_w.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_hermite_polynomial_h.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_hermite_polynomial_h.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_hermite_polynomial_he.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_hermite_polynomial_he.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_laguerre_polynomial_l.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_laguerre_polynomial_l.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_legendre_polynomial_p.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_legendre_polynomial_p.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_t.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_t.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_u.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_u.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_v.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_v.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_w.n_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_shifted_chebyshev_polynomial_w.x_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_xlog1py.other_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_xlog1py.self_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_zeta.other_scalar': 'no OpInfo sample reaches it: untested',
    'aten.special_zeta.self_scalar': 'no OpInfo sample reaches it: untested',
    'aten.threshold.default': 'wrong against single-device execution: dtensor_partial[Partial(max) -> Partial(max)]',
    'aten.triangular_solve.default': 'no OpInfo sample fits a sharded strategy: untested',
    'aten.upsample_nearest3d.default': 'no OpInfo sample reaches it: untested',
    'aten.view.dtype': 'no OpInfo sample reaches it: untested',
    'aten.view_as_complex.default': 'no OpInfo sample reaches it: untested',
    'aten.view_as_real.default': 'no OpInfo sample reaches it: untested',
    'aten.xlogy.Scalar_Other': 'no OpInfo sample reaches it: untested',
    'aten.xlogy.Scalar_Self': 'no OpInfo sample reaches it: untested',
}


def _propagator():
    from torch.distributed.tensor._api import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def dtensor_ops() -> set:
    """Every aten op DTensor has a sharding strategy or rule for."""
    sp = _propagator()
    return set(sp.op_single_dim_strategy_funcs) | set(sp.op_strategy_funcs) | set(sp.op_to_rules)


def refusal(op) -> str | None:
    """Why the bridge does not offer ``op`` (None: it does)."""
    sp = _propagator()
    if str(op) in DENIED:
        return f"denied: {DENIED[str(op)]}"
    if op not in sp.op_single_dim_strategy_funcs and op not in sp.op_strategy_funcs:
        return "no DTensor strategy" if op not in sp.op_to_rules else "an OutputSharding rule (not bridged)"
    if op.namespace != "aten":
        return f"a {op.namespace} op: captured programs hold aten ops only"
    schema = op._schema
    if schema.is_mutable:
        return "mutates an argument (in-place or out=)"
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "random: each rank would draw its own numbers"
    if not schema.returns or any(str(r.type) not in ("Tensor", "Tensor?") for r in schema.returns):
        return "returns a list of tensors or a non-tensor"
    if op in sp.op_to_shape_and_stride_idx or op in _size_adjusted(sp):
        return "size arguments need rewriting for local pieces (a localizer: write a rule)"
    return None


def _size_adjusted(sp) -> set:
    """Ops whose size or dim arguments DTensor rewrites for the local pieces (``op_to_scalar_shape_adjuster``:
    group_norm's N, C, HxW; ``squeeze_op_to_dims_variant``: squeeze's dims). Older torch (2.11) has neither
    table: the same ops are named here, so the bridge offers the same set on every torch pyproject claims."""
    named = {aten.native_group_norm.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims}
    return (named | set(getattr(sp, "op_to_scalar_shape_adjuster", {}))
            | set(getattr(sp, "squeeze_op_to_dims_variant", {})))


def bridged_ops() -> set:
    """The DTensor ops the bridge offers strategies for (hand-written rules may still override)."""
    return {op for op in dtensor_ops() if refusal(op) is None}


@functools.cache
def bridge_rule(op):
    """A rule function for ``op`` from DTensor's strategies, or None when the op is refused."""
    if refusal(op) is not None:
        return None
    sp = _propagator()
    single = sp.op_single_dim_strategy_funcs.get(op)

    def rule(info: OpInfo) -> list[Strategy]:
        try:
            raw = _single_dim(op, single, info) if single is not None else _op_strategy(op, sp, info)
        except Exception as e:  # noqa: BLE001 - a strategy function that cannot handle these args
            info.notes.append(f"DTensor's strategy for {op} failed: {type(e).__name__}: {e}")
            raw = []
        out = _translate(raw, info)
        rep = Strategy(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs), name="replicate")
        if rep not in out:
            out.append(rep)
        # keep the current placements first when some strategy takes them as they are
        out.sort(key=lambda s: (tuple(s.inputs) != tuple(info.current), s.name == "replicate"))
        return out

    rule.__name__ = f"dtensor_{op}"
    rule.__doc__ = f"DTensor's sharding strategies for {op} (mcompile.sharding.rules.dtensor)."
    return rule


# ---------------------------------------------------------------------------------------------
# asking torch
# ---------------------------------------------------------------------------------------------


def _concrete(info: OpInfo):
    """Symbol -> int stand-in, shared by every shape of this op."""
    syms = set()
    for t in [*info.inputs, *info.outputs]:
        for s in t.shape:
            if isinstance(s, sympy.Expr):
                syms |= s.free_symbols
    base = 2520 * info.n
    return {s: base * _PRIMES[i % len(_PRIMES)] * (1 + i // len(_PRIMES)) for i, s in
            enumerate(sorted(syms, key=str))}


def _int(x, subs) -> int:
    if isinstance(x, torch.SymInt):
        from mcompile.sharding.rules.base import to_expr

        x = to_expr(x)
    if isinstance(x, sympy.Expr):
        return int(x.subs(subs))
    return int(x)


def _dt_meta(t: TensorMeta, subs):
    from torch.distributed.tensor._dtensor_spec import TensorMeta as DTMeta

    shape = [_int(s, subs) for s in t.shape]
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return DTMeta(shape=torch.Size(shape), stride=tuple(reversed(stride)), dtype=t.dtype)


def _is_tensor_arg(a) -> bool:
    if isinstance(a, torch.Tensor):
        return True
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _map_args(info: OpInfo, fn_tensor, subs):
    """args / kwargs with each tensor (in tensor_input_nodes order) replaced by ``fn_tensor(i, meta)``
    and each symbolic size by its stand-in."""
    counter = iter(range(len(info.inputs)))

    def visit(a):
        if _is_tensor_arg(a):
            i = next(counter)
            return fn_tensor(i, info.inputs[i])
        if isinstance(a, fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.SymInt | sympy.Expr):
            return _int(a, subs)
        if isinstance(a, list):
            return [visit(x) for x in a]
        if isinstance(a, tuple):
            return tuple(visit(x) for x in a)
        return a

    args = tuple(visit(a) for a in info.args)
    kwargs = {k: visit(v) for k, v in info.kwargs.items()}
    return args, kwargs


def _single_dim(op, strategy_info, info: OpInfo) -> list[tuple[tuple, tuple]]:
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    subs = _concrete(info)
    args, kwargs = _map_args(info, lambda i, m: _dt_meta(m, subs), subs)
    k = len(info.outputs)
    out = []
    for row in strategy_info.func(op, args, kwargs):
        row = [Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in row]
        if len(row) != k + len(info.inputs):
            continue
        out.append((tuple(row[k:]), tuple(row[:k])))
    return out


@functools.cache
def _mesh(n: int):
    """A 1-D mesh of n ranks that owns no process group (the strategy functions read only its size)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)


def _op_strategy(op, sp, info: OpInfo) -> list[tuple[tuple, tuple]]:
    """Many strategy functions follow the placement of one input (its first candidate), so the
    function is asked once per seed: every input offered all its candidates, then every input held
    at one placement p (all at p where it applies, else R; the first at p, the others R)."""
    subs = _concrete(info)
    cands = []
    for m in info.inputs:
        c = [R] + [Shard(d) for d in range(m.ndim)]
        if m.dtype.is_floating_point:
            c.append(Partial())
        cands.append(c)
    seeds = [None]
    for p in {p for c in cands for p in c}:
        seeds.append(tuple(p if p in c else R for c in cands))
        if len(cands) > 1 and p in cands[0]:
            seeds.append((p,) + (R,) * (len(cands) - 1))
    out: list = []
    for seed in seeds:
        try:
            found = _ask_op_strategy(op, sp, info, subs, cands, seed)
        except Exception:  # noqa: BLE001 - a function that refuses this seed (Partial inputs, say)
            continue
        out += [s for s in found if s not in out]
    return out


def _ask_op_strategy(op, sp, info: OpInfo, subs, cands, seed) -> list[tuple[tuple, tuple]]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    mesh = _mesh(info.n)

    def strategy(i, m: TensorMeta):
        meta = _dt_meta(m, subs)
        ps = cands[i] if seed is None else [seed[i]]
        return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tensor_meta=meta)) for p in ps])

    args, kwargs = _map_args(info, strategy, subs)
    # lists of tensors (stack and the like) are TupleStrategy inputs
    args = tuple(TupleStrategy(tuple(a)) if isinstance(a, list | tuple) and a
                 and all(isinstance(x, OpStrategy) for x in a) else a for a in args)
    result = sp.op_strategy_funcs[op](OpSchema(op, args, kwargs, schema_info=sp.op_to_schema_info.get(op)))
    if not isinstance(result, OpStrategy):
        return []
    out = []
    for spec in result.strategies:
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        if len(outs) == 1 and len(info.outputs) > 1:  # one spec stands for every output
            outs = outs * len(info.outputs)
        if any(o is None for o in outs):
            continue
        ins = spec.input_specs if spec.input_specs is not None else (spec.output_spec,) * len(info.inputs)
        if len(ins) != len(info.inputs) or len(outs) != len(info.outputs):
            continue
        out.append((tuple(s.placements[0] for s in ins), tuple(s.placements[0] for s in outs)))
    return out


# ---------------------------------------------------------------------------------------------
# translating
# ---------------------------------------------------------------------------------------------


def _ours(p):
    """Our placement for DTensor's, or None when we do not use it."""
    if type(p) is Shard or isinstance(p, Replicate):
        return p
    if type(p) is Partial and p.reduce_op in _PARTIALS:
        return p
    return None  # _StridedShard, Partial(avg / min / ...) and subclasses (_NormPartial), None


def _fits(p, t: TensorMeta, n: int) -> bool:
    if isinstance(p, Shard):
        if not -t.ndim <= p.dim < t.ndim or t.ndim == 0:
            return False
        size = t.shape[p.dim % t.ndim]
        return not isinstance(size, int) or (size > 1 and size % n == 0)
    if isinstance(p, Partial):
        return t.dtype != torch.bool
    return True


def _translate(raw, info: OpInfo) -> list[Strategy]:
    out: list[Strategy] = []
    for ins, outs in raw:
        ins, outs = tuple(map(_ours, ins)), tuple(map(_ours, outs))
        if any(p is None for p in ins + outs):
            continue
        ins = tuple(Shard(p.dim % t.ndim) if isinstance(p, Shard) else p for p, t in zip(ins, info.inputs))
        outs = tuple(Shard(p.dim % t.ndim) if isinstance(p, Shard) else p for p, t in zip(outs, info.outputs))
        if not all(_fits(p, t, info.n) for p, t in zip(ins, info.inputs)):
            continue
        if not all(_fits(p, t, info.n) for p, t in zip(outs, info.outputs)):
            continue
        if all(isinstance(p, Replicate) for p in ins) and any(isinstance(p, Shard) for p in outs):
            continue  # whole inputs, split outputs: only a factory with local sizes could do that
        sharded = any(isinstance(p, Shard) for p in ins + outs)
        partial = any(isinstance(p, Partial) for p in ins + outs)
        name = "dtensor" + ("_shard" if sharded else "") + ("_partial" if partial else "")
        s = Strategy(ins, outs, name=name if sharded or partial else "replicate")
        if s not in out:
            out.append(s)
    return out
