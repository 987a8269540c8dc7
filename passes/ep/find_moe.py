"""Mixture-of-experts layers found in the captured graph, rewritten into one ``moe_ffn`` node each.

A routed MoE feed-forward is, whatever code wrote it, ``y[t] = sum_j w[t, j] * FFN_{e[t, j]}(x[t])``
with ``e`` the top-k expert indices of token t and ``w`` their weights. Models write the dispatch
in many ways (models/moe_lm.py sorts the slots and runs grouped GEMMs; transformers 5 sorts and calls
its ``grouped_mm`` custom op, or gathers one weight per slot and runs ``bmm``); a planner cannot
shard such code op by op — expert parallelism moves tokens to the ranks that hold their experts,
a transformation of the whole region. So the region is found and replaced by one node whose
meaning is the formula above, which the planner shards as a unit (``mcompile.sharding.rules.moe``) and the
lowering implements per layout (local grouped GEMMs, or the all-to-all dispatch of
``mcompile.runtime.moe``).

Finding a region (per ``aten.topk`` whose indices feed 3-D parameters ``[E, a, b]`` with E the
routed dim's size; or per concatenation of slots each an argmax over the classes, a sampling router without
top-k such as Phi-MoE's sparsemixer, E then the experts' size):

* the expert parameters: 3-D placeholders with leading size E whose values meet the indices'
  descendants before the next routing top-k;
* the output ``y``: a node downstream of the indices and of every expert parameter with the tokens'
  shape; the region is what lies between (descendants of the indices or the parameters that ``y``
  depends on); its other inputs must be exactly the tokens ``x`` (T, d) and the weights (T, k);
* the expert function is not guessed from names: each candidate form (SwiGLU with separate or fused
  gate/up — gate first or up first — or a plain activation MLP; weights stored (E, out, in) or
  (E, in, out); SiLU, GELU, GELU-tanh or ReLU) is *evaluated* against the region on random tokens,
  routings and weights, forward and backward (the way passes/kv_cache.py recognises a causal mask);
  the first form that agrees within rounding replaces the region. A region no form matches is left
  as captured (it then runs replicated under tp and dp, and ``ep`` refuses the model, naming it).

The replacement keeps the captured graph's meaning: ``moe_ffn`` computes the same formula (slots
sorted by expert, one grouped GEMM per projection: :func:`moe_local`), so a plan without ``ep``
runs it as ordinary aten ops.
"""

from __future__ import annotations

import itertools
import math
import operator

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten
__all__ = ["find_moe_layers", "moe_layers_of"]

from mcompile.ir.moe import (  # noqa: E402,F401
    _ACT_OPS,
    _ACTS,
    ExpertForm,
    gated_only,
    moe_ffn,
    moe_layers_of,
    moe_reference,
)

# --------------------------------------------------------------------------- finding regions


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _reach(roots, allowed, down: bool = True, stop: set | None = None) -> set:
    """The nodes reached from ``roots`` (not included) through users (``down``) or inputs, staying in
    ``allowed`` (a set or a predicate); with ``stop``, returns at the first node of it reached."""
    ok = allowed if callable(allowed) else allowed.__contains__
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        for m in (n.users if down else n.all_input_nodes):
            if m not in seen and ok(m):
                seen.add(m)
                if stop is not None and m in stop:
                    return seen
                stack.append(m)
    return seen


def find_moe_layers(gm: fx.GraphModule) -> int:
    """Replace every recognised MoE region of ``gm`` by a ``moe_ffn`` node; returns how many."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    topks = [n for n in nodes if n.op == "call_function" and n.target is aten.topk.default]
    three_d = [n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].ndim == 3 and _static(n.meta["val"].shape)
               and n.meta["val"].dtype.is_floating_point]
    # per-expert biases [E, out]: 2-D parameters read by rows (``b[expert_ids]``), never by a contraction (a
    # router's [E, d] weight is a linear's)
    two_d = [n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
             and n.meta["val"].ndim == 2 and _static(n.meta["val"].shape) and n.meta["val"].dtype.is_floating_point
             and n.users and all(u.target is aten.index.Tensor and u.args[0] is n for u in n.users)]
    # routings: top-k's indices (and the number of classes it chose among), or the experts a sampling router chose
    # without top-k, concatenated per slot (Phi-MoE's sparsemixer: argmax of Gumbel-perturbed masked scores, twice)
    routes = []
    for t in topks:
        idx = next((u for u in t.users if u.target is operator.getitem and u.args[1] == 1), None)
        classes = t.args[0].meta["val"].shape[-1]
        if idx is not None and isinstance(classes, int):
            routes.append((idx, classes))
    for n in nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and n.target in (aten.cat.default, aten.concat.default) and \
                isinstance(v, torch.Tensor) and v.ndim == 2 and v.dtype == torch.int64 and \
                isinstance(v.shape[-1], int) and all(_argmax_slot(a) for a in n.all_input_nodes):
            below = _reach([n], lambda m: True)
            E = max((p.meta["val"].shape[0] for p in three_d if _reach([p], lambda m: True) & below), default=0)
            if E:
                routes.append((n, E))
    routes.sort(key=lambda r: pos[r[0]])
    if not routes or not three_d:
        return 0
    done = 0
    used: set = set()
    for i, (idx, classes) in enumerate(routes):
        if any(u.target is moe_ffn or any(v.target is moe_ffn for v in u.users)
               for u in idx.users):  # rewritten already
            continue
        end = pos[routes[i + 1][0]] if i + 1 < len(routes) else len(nodes)

        def before(n, end=end):
            return pos[n] < end

        window = {n for n in nodes[pos[idx] + 1:end]}
        d_idx = _reach([idx], window)
        # this layer's experts: weights of E experts whose values meet the indices' before the next routing
        # (a router may score more classes than there are experts: ZAYA's "skip" class; a slot routed to a
        # class >= E gets nothing from the experts, which the evaluation below checks)
        # (not a tensor the routing itself reads: an earlier block's 3-D parameters or buffers)
        upstream = _reach([idx], lambda n: True, down=False)
        params = [p for p in three_d if p not in used and p not in upstream and p.meta["val"].shape[0] <= classes
                  and _reach([p], before, stop=d_idx) & d_idx]
        E = max((p.meta["val"].shape[0] for p in params), default=0)
        params = [p for p in params if p.meta["val"].shape[0] == E]
        biases = [p for p in two_d if p not in used and p.meta["val"].shape[0] == E
                  and _reach([p], before, stop=d_idx) & d_idx]
        for chosen in _expert_sets(params, before, d_idx, pos):
            if len(biases) <= len(chosen) and _match(gm, idx, chosen + biases, window, before, d_idx, pos, classes):
                used.update(chosen + biases)
                done += 1
                break
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _expert_sets(params, before, d_idx, pos):
    """The sets of expert weights to try for one routing: all the candidates (at most 3: gate, up, down), then
    the first 3 and the first 2 in the order their values meet the indices' descendants. A later block's
    3-D tensors of the same leading size also meet them, downstream of this layer's output (MiniMax's
    lightning-attention decay buffers [heads, ., .] with heads == E): they meet them after this layer's
    experts do (the up projection reads the dispatched rows, then the down projection)."""
    if 1 < len(params) <= 3:
        yield params
    if len(params) > 2:
        def meet(p):
            return min((pos[n] for n in _reach([p], before) & d_idx), default=len(pos))

        ordered = sorted(params, key=meet)
        for m in (3, 2):
            if m < len(params):
                yield ordered[:m]


def _argmax_slot(n: fx.Node) -> bool:
    """``n`` is one routing slot's expert: the indices of a max / argmax over the classes, viewed as a column."""
    while n.target in (aten.unsqueeze.default, aten.view.default, aten.reshape.default):
        n = n.args[0]
    return n.target is aten.argmax.default or (n.target is operator.getitem and n.args[1] == 1
                                                and n.args[0].target is aten.max.dim)


# the region's output is among the first nodes (in graph order) that the indices and every expert weight reach;
# transformers' grouped-mm experts make a dozen per-slot [T * k, d] values before it (LongCat-Flash: 12)
_CANDIDATES = 32


def _match(gm, idx, params, window, before, d_idx, pos, classes: int) -> bool:
    """Find the region's output among the nodes every expert weight and the indices reach, cut the
    region, identify its form and replace it; False when no candidate works."""
    d_each = [_reach([p], before) for p in params]
    d_params = set().union(*d_each)
    candidates = sorted((c for c in set.intersection(*d_each) & d_idx if isinstance(c.meta.get("val"), torch.Tensor)
                         and c.meta["val"].ndim == 2 and c.meta["val"].dtype.is_floating_point), key=pos.__getitem__)
    k = idx.meta["val"].shape[-1]
    for y in candidates[:_CANDIDATES]:
        yv = y.meta["val"]
        anc = _reach([y], window | d_params | {idx}, down=False)
        base = {n for n in (anc | {y}) if n in d_idx or n in d_params}
        # the weights may be computed from the indices (DeepSeek-V3 gathers the chosen scores): then
        # they are a (T, k) float node inside, cut out with what only they need
        cuts = [None] + sorted((n for n in base if n not in d_params and n is not y and _is_weights(n, k)),
                               key=lambda n: -pos[n])
        tried = []
        # the weights cut with what only they need (as DeepSeek-V3's gathered scores), else keeping what the dispatch
        # needs too (the indices detached once, then gathered into weights and dispatched: LongCat-Flash's router)
        for shared in (False, True):
            found = _cut_region(base, cuts, y, yv, idx, params, k, shared)
            if found is None or found[0] in tried:
                continue
            region, x, w, others = found
            tried.append(region)
            # experts dispatched on indices derived from top-k's (every way from the indices to y passes one node:
            # tried first on the second cut), else on top-k's own, else on any derived
            form = None
            if shared:
                form, order, at, sub = _remapped(gm, region, y, x, idx, w, params, others, pos, exclusive=True)
            if form is None:
                form, order = _identify(gm, region, y, x, idx, w, params, others, classes)
                at, sub = idx, region
            if form is None:
                form, order, at, sub = _remapped(gm, region, y, x, idx, w, params, others, pos)
            if form is None:
                continue
            down_bias = params[order[-1]] if len(order) > form.n_weights else None
            # (derived indices were identified on [0, E): a value >= E at run time gets weight 0, as a class >= E)
            _replace(gm, sub, y, x, at, w, [params[j] for j in order[:form.n_weights]], form, down_bias, classes)
            return True
    return False


def _cut_region(base, cuts, y, yv, idx, params, k, shared: bool):
    """The first cut that leaves the region exactly two tensor inputs, the tokens and the weights: (region, x, w,
    the sizes it reads) or None. ``shared``: the cut keeps the nodes the weights share with what y needs."""
    for cut in cuts:
        if cut is None and shared:
            continue
        region = set(base)
        if cut is not None and shared:
            region = _reach([y], lambda n, cut=cut, base=base: n in base and n is not cut, down=False) | {y}
        elif cut is not None:
            region -= {cut} | _reach([cut], region, down=False)
        ext = _absorb(region, idx, params, yv, k)
        tensors = [a for a in ext.values() if isinstance(a.meta.get("val"), torch.Tensor)]
        xs = [a for a in tensors if _same_shape(a.meta["val"].shape, yv.shape)
              and a.meta["val"].dtype.is_floating_point]
        wts = [a for a in tensors if _is_weights(a, k) and a not in xs]
        if len(xs) == 1 and len(wts) == 1 and len(tensors) == 2:
            return region, xs[0], wts[0], [a for a in ext.values() if a not in (xs[0], wts[0])]
    return None


def _remapped(gm, region, y, x, idx, w, params, others, pos, exclusive: bool = False):
    """The experts dispatched on indices derived from the routing's rather than on its own: LongCat-Flash's
    zero experts (router classes >= E are identity experts: their slots get weight 0 and a dummy index in
    [0, E), the identity term added outside). The region is cut at the last integer (T, k) node the indices
    derive in it, identified on values in [0, E) (``exclusive``: only a node that every way from the indices to
    y passes); (form, order, that node, the region after it) or Nones."""
    shape = [str(s) for s in idx.meta["val"].shape]
    derived = sorted((n for n in region if n is not y and isinstance(n.meta.get("val"), torch.Tensor)
                      and not n.meta["val"].dtype.is_floating_point and n.meta["val"].dtype != torch.bool
                      and [str(s) for s in n.meta["val"].shape] == shape), key=lambda n: -pos[n])
    E = int(params[0].meta["val"].shape[0])
    for j in derived[:4]:
        sub = _reach([y], lambda n, j=j: n in region and n is not j, down=False) | {y}
        ins = {a for n in sub for a in n.all_input_nodes if a not in sub and a not in params}
        if not ins <= {x, w, j, *others}:
            continue
        if exclusive and any(idx in n.all_input_nodes for n in sub):
            continue
        form, order = _identify(gm, sub, y, x, j, w, params, [a for a in others if a in ins], E)
        if form is not None:
            return form, order, j, sub
    return None, None, None, region


def _is_weights(n, k) -> bool:
    v = n.meta.get("val")
    # (T, k), or (batch, seq, k) from a router that keeps the batch dims (ZAYA's)
    return isinstance(v, torch.Tensor) and v.ndim >= 2 and v.dtype.is_floating_point and str(v.shape[-1]) == str(k)


def _same_shape(a, b) -> bool:
    """Shapes equal as far as known without a guard: a size counted from the routing (JetMoe's ``u0`` tokens
    routed, data-dependent) is never compared by value (a GuardOnDataDependentSymNode)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


_LIKE = {aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default,
         aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default}
_CARRY = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten._to_copy.default, aten.to.dtype,
          aten.to.dtype_layout, aten.clone.default, aten.contiguous.default, aten.repeat_interleave.self_int,
          aten.alias.default, aten.detach.default}


def _absorb(region: set, idx, params, yv, k) -> dict:
    """Grow ``region`` over the factories it reads (zeros, arange, zeros_like) and over the views
    and casts of its two data inputs; returns the remaining external inputs by name."""
    def is_tensor(a):
        return isinstance(a.meta.get("val"), torch.Tensor)

    def data_shape(a):
        v = a.meta["val"]
        return (v.ndim == 2 and _same_shape(v.shape, yv.shape)) or (v.ndim >= 2 and str(v.shape[-1]) == str(k))

    while True:
        ext = {}
        for n in region:
            for a in n.all_input_nodes:
                if a not in region and a is not idx and a not in params:
                    ext[a.name] = a
        grow = []
        for a in ext.values():
            if not is_tensor(a) or a.op != "call_function":
                continue
            # (a getitem of top-k's (values, indices) reads tensors too: the routing weights straight from top-k
            # are an input of the region, not a factory of it)
            tensor_ins = [b for b in a.all_input_nodes if is_tensor(b) or isinstance(b.meta.get("val"), tuple | list)]
            if not tensor_ins or a.target in _LIKE or (a.target in _CARRY and len(tensor_ins) == 1
                                                       and not data_shape(a)):
                grow.append(a)
        if not grow:
            return ext
        region.update(grow)


def _sym_env(nodes) -> dict:
    """Concrete values for the graph's size symbols: distinct small numbers (2, 3, ...)."""
    syms = set()
    for n in nodes:
        v = n.meta.get("val")
        vals = v.shape if isinstance(v, torch.Tensor) else [v]
        for s in vals:
            if isinstance(s, torch.SymInt | torch.SymFloat):
                syms |= s.node.expr.free_symbols
    return {s: 2 + i for i, s in enumerate(sorted(syms, key=str))}


def _concrete(shape, env):
    return [int(sympy.sympify(s.node.expr).subs(env)) if isinstance(s, torch.SymInt) else int(s) for s in shape]


def _histc(x, bins=100, min=0, max=0):  # noqa: A002 - aten's names
    return torch.histc(x.float(), bins, min, max).to(x.dtype if x.is_floating_point() else torch.float32)


def _region_fn(gm, region, y, inputs, others, dtypes: dict | None = None):
    """The region as a callable of (x, idx, w, *params, *sizes); ``dtypes`` maps the dtype arguments of
    its ops (a probe in float64 of a bf16 capture)."""
    dtypes = dtypes or {}

    def arg(a):  # a capture on the meta device (parallelize) names it in factories: evaluate on the CPU
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return dtypes.get(a, a) if isinstance(a, torch.dtype) else a

    g = fx.Graph()
    env = {}
    for a in list(inputs) + list(others):
        env[a] = g.placeholder(a.name)
    for n in gm.graph.nodes:
        if n in region:
            c = env[n] = g.node_copy(n, lambda a: env[a])
            c.args = fx.node.map_aggregate(c.args, arg)
            c.kwargs = fx.node.map_aggregate(c.kwargs, arg)
            if n.target is aten.histc.default:  # traced on meta/CUDA for ints, which the CPU kernel refuses
                c.target = _histc
    g.output(env[y])
    return fx.GraphModule(torch.nn.Module(), g)


def _identify(gm, region, y, x, idx, w, params, others, classes: int):
    env = _sym_env([x, idx, w, *others])
    T, d = _concrete(x.meta["val"].shape, env)
    k = int(idx.meta["val"].shape[-1])
    routed = (_concrete(idx.meta["val"].shape, env), _concrete(w.meta["val"].shape, env))  # (T, k) or (b, s, k)
    E = int(params[0].meta["val"].shape[0])
    dtype = x.meta["val"].dtype
    sizes = [int(sympy.sympify(a.meta["val"].node.expr).subs(env)) if isinstance(a.meta.get("val"), torch.SymInt)
             else float(sympy.sympify(a.meta["val"].node.expr).subs(env)) for a in others]
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(p.meta["val"].shape[1:]) for p in params]  # the matrices' (2 dims), then the biases' (1)
    # evaluated in float64 first (the forms then differ by far more than rounding, at any width), the
    # capture's dtype arguments mapped; then in the capture's dtype, for a region that needs it
    # (torch._grouped_mm takes no float64: float32 next)
    tries = [(dt, {dtype: dt}) for dt in (torch.float64, torch.float32) if dtype.is_floating_point and dt != dtype]
    tries.append((dtype, {}))
    fns = {}
    for probe in _probe_shapes(shapes, d, E):
        for dt, dtypes in tries:
            fn = fns.setdefault(dt, _region_fn(gm, region, y, [x, idx, w, *params], others, dtypes))
            form, perm = _identify_at(fn, gen.get_state(), T, d, k, classes, dt, idx, w, params, probe, sizes, region,
                                      dtypes, routed)
            if form is not None and _shapes_fit(form, [shapes[j] for j in perm[:form.n_matrices]], d):
                return form, perm
    return None, None


# the experts' parameters a probe at the real widths may hold (fp32 elements): beyond, only the narrow probe runs
_FULL_PROBE_ELEMENTS = 1 << 26
_PROBE_WIDTH = 8


def _probe_shapes(shapes, d: int, E: int):
    """The expert weights' shapes (without E) to evaluate the region at. First narrowed: every width
    other than the model width d scaled to a hidden width of 8 (a gate/up projection fused as 2f
    becomes 16; 8 elements: 16 bytes in bf16, torch._grouped_mm's stride alignment), so identifying
    Mixtral-8x7B's or DeepSeek-V3's experts costs megabytes, not tens of GB (the form does not depend
    on the widths). Then, if that found nothing (a region that names its widths as constants) and the
    real weights are small enough, the real shapes."""
    hidden = [v for s in shapes for v in s if v != d]
    f = min((v for s in shapes if len(s) == 2 for v in s if v != d), default=0)
    if f > _PROBE_WIDTH and all(v % f == 0 for v in hidden):
        yield [tuple(v if v == d else v // f * _PROBE_WIDTH for v in s) for s in shapes]
    if sum(math.prod(s) for s in shapes) * E <= _FULL_PROBE_ELEMENTS:
        yield shapes


def _identify_at(fn, state, T, d, k, classes, dtype, idx, w, params, shapes, sizes, region, dtypes, routed):
    """_identify on weights of the given shapes (E experts each) in ``dtype`` (``dtypes``: the float
    dtypes mapped to it), routed over ``classes`` >= E classes (the oracle gives a class >= E nothing)."""
    E = int(params[0].meta["val"].shape[0])
    gen = torch.Generator()
    gen.set_state(state)

    def cast(t, like):
        return t.to(dtypes.get(like, like))

    xv = cast(torch.randn(T, d, generator=gen, dtype=torch.float32), dtype)
    iv = torch.rand(T, classes, generator=gen).argsort(1)[:, :k].to(idx.meta["val"].dtype)
    iv[0] = iv[1]  # two tokens with the same experts
    wv = cast(torch.rand(T, k, generator=gen, dtype=torch.float32), w.meta["val"].dtype).reshape(routed[1])
    iv_region = iv.reshape(routed[0])
    # weights scaled by 1/sqrt(fan-in): every value stays O(1) at any width
    pv = [cast(torch.randn(E, *s, generator=gen) * (0.5 / min(s) ** 0.5 + 0.5 / max(s) ** 0.5), p.meta["val"].dtype)
          for p, s in zip(params, shapes)]
    leaves = [t.requires_grad_(True) for t in (xv, wv, *pv)]
    try:
        out = fn(leaves[0], iv_region, leaves[1], *leaves[2:], *sizes)
    except Exception:  # noqa: BLE001 - a region that does not run alone is not ours to replace
        return None, None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, d):
        return None, None
    gy = torch.randn(out.shape, generator=gen).to(out.dtype)
    try:
        g_ref = torch.autograd.grad(out, leaves, gy, allow_unused=True)
    except RuntimeError:
        return None, None
    # the region and the oracle sum the same products in other orders (sorted slots, grouped GEMMs,
    # index_add vs a loop): agreement to rounding of the dtype, far below what another form changes
    tol = 1e-4 if dtype == torch.float32 else (1e-9 if dtype == torch.float64 else 3e-2)
    acts = [_ACT_OPS[n.target] for n in region if n.op == "call_function" and n.target in _ACT_OPS]
    if any(n.target is aten.gelu.default and (n.kwargs.get("approximate") == "tanh" or
                                              (len(n.args) > 1 and n.args[1] == "tanh")) for n in region):
        acts = ["gelu_tanh"] + acts
    acts = list(dict.fromkeys(_oai_acts(region) + _softcap_acts(region) + acts + list(_ACTS)))
    n_mat = sum(len(s) == 2 for s in shapes)
    n_bias = len(shapes) - n_mat
    kinds = ["sep"] if n_mat == 3 else ["fused_gu", "fused_ug", "fused_il", "plain"]
    for kind, transposed, act, perm in itertools.product(kinds, (False, True), acts, _orders(n_mat, n_bias)):
        mats = perm[:n_mat]
        form = ExpertForm(act, kind, transposed, bias=n_bias > 0 and perm[n_mat] is not None)
        if kind not in ("sep",) and not kind.startswith("fused") and gated_only(act):
            continue  # a clamped or soft-capped SwiGLU needs a gate
        if not _shapes_fit(form, [shapes[j] for j in mats], d):
            continue
        # the biases: one per input projection (form.bias), then the down projection's (or none)
        in_b = [j for j in perm[n_mat:n_mat + n_mat - 1] if j is not None]
        down = perm[-1] if n_bias and len(perm) == 2 * n_mat else None
        if len(in_b) not in (0, n_mat - 1) or not _biases_fit(form, [shapes[j] for j in mats],
                                                               [shapes[j] for j in in_b], None if down is None
                                                               else shapes[down]):
            continue
        if len(in_b) + (down is not None) != n_bias:
            continue
        ws = [leaves[2 + j] for j in list(mats) + in_b]
        try:
            ref = moe_reference(leaves[0], iv, leaves[1].reshape(T, k), ws, form,
                                down_bias=None if down is None else leaves[2 + down])
        except RuntimeError:
            continue
        if not torch.allclose(ref.float(), out.float(), rtol=tol, atol=tol * max(1.0, out.abs().max().item())):
            continue
        g_can = torch.autograd.grad(ref, leaves, gy, allow_unused=True)
        if all(_close(a, b, tol) for a, b in zip(g_ref, g_can)):
            return form, list(mats) + in_b + ([] if down is None else [down])
    return None, None


def _orders(n_mat: int, n_bias: int):
    """The roles the expert tensors may take: the matrices in each order, then (with biases) a bias index or
    None per projection (input projections first, the down projection last)."""
    for mats in itertools.permutations(range(n_mat)):
        if not n_bias:
            yield mats
            continue
        slots = [None] + list(range(n_mat, n_mat + n_bias))
        for bs in itertools.product(slots, repeat=n_mat):
            used = [b for b in bs if b is not None]
            if len(used) == n_bias and len(set(used)) == n_bias:
                yield mats + bs


def _biases_fit(form: ExpertForm, mat_shapes, in_shapes, down_shape) -> bool:
    outs = [s[1] if form.transposed else s[0] for s in mat_shapes]  # each projection's output features
    return all(b == (o,) for b, o in zip(in_shapes, outs)) and (down_shape is None or down_shape == (outs[-1],))


def _oai_acts(region) -> list[str]:
    """gpt-oss's clamped SwiGLU, its constants read from the region: the upper clamp of the gate (LIMIT) and
    the scale inside the sigmoid (ALPHA). Evaluated like every candidate, so a wrong reading matches nothing."""
    limits = {float(n.args[2]) for n in region if n.target is aten.clamp.default and len(n.args) > 2
              and isinstance(n.args[2], int | float)}
    alphas = {float(n.args[1]) for n in region if n.target is aten.mul.Tensor and isinstance(n.args[1], float)
              and any(u.target is aten.sigmoid.default for u in n.users)}
    return [f"oai:{a!r}:{lim!r}" for a in sorted(alphas) for lim in sorted(limits)]


def _softcap_acts(region) -> list[str]:
    """Soft-capped SwiGLUs (``softcap:G:U``, mcompile.ir.moe), the caps read from the region: the divisors of the
    values its ``tanh`` reads, each pair (gate's, up's) tried. Evaluated like every candidate."""
    caps = sorted({float(n.args[1]) for n in region if n.target is aten.div.Tensor and len(n.args) > 1
                   and isinstance(n.args[1], int | float) and n.args[1] != 0
                   and any(u.target is aten.tanh.default for u in n.users)})
    return [f"softcap:{g!r}:{u!r}" for g in caps for u in caps]


def _close(a, b, tol) -> bool:
    if a is None or b is None:
        other = b if a is None else a
        return other is None or bool((other == 0).all())
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, a.abs().max().item()))


def _shapes_fit(form: ExpertForm, shapes, d: int) -> bool:
    shapes = shapes[:form.n_matrices]
    io = (lambda s: (s[0], s[1])) if form.transposed else (lambda s: (s[1], s[0]))  # (in, out)
    ins_outs = [io(s) for s in shapes]
    if form.kind == "sep":
        (gi, go), (ui, uo), (di, do) = ins_outs
        return gi == ui == d and go == uo == di and do == d
    (ai, ao), (di, do) = ins_outs
    if form.kind == "plain":
        return ai == d and ao == di and do == d
    return ai == d and ao % 2 == 0 and ao // 2 == di and do == d


def _replace(gm, region, y, x, idx, w, params, form: ExpertForm, down_bias=None, classes: int = 0) -> None:
    from mcompile.passes.nodes import _fake_call

    g = gm.graph

    def call(target, args, kwargs=None):
        n = g.call_function(target, args, kwargs or {})
        n.meta["val"] = _fake_call(target, args, kwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in y.meta:
                n.meta[key] = y.meta[key]
        return n

    with g.inserting_before(y):
        E, k = int(params[0].meta["val"].shape[0]), idx.meta["val"].shape[-1]
        if idx.meta["val"].ndim > 2:  # (batch, seq, k) routing: the tokens' rows, as x flattens them
            idx, w = call(aten.reshape.default, (idx, [-1, k])), call(aten.reshape.default, (w, [-1, k]))
        if classes > E:  # a slot of a class >= E: weight 0 on (any) expert E - 1, which moe_ffn's dispatch can run
            keep = call(aten.lt.Scalar, (idx, E))
            w = call(aten.mul.Tensor, (w, call(aten._to_copy.default, (keep,), {"dtype": w.meta["val"].dtype})))
            idx = call(aten.clamp.default, (idx, 0, E - 1))
        new = call(moe_ffn, (x, idx, w, *params), {"form": form.text()})
        if down_bias is not None:  # + sum_j w[t, j] * b[idx[t, j]]: a gather of [E, d] rows, outside the node
            rows = call(aten.index.Tensor, (down_bias, [idx]))
            scaled = call(aten.mul.Tensor, (rows, call(aten.unsqueeze.default, (w, -1))))
            total = call(aten.sum.dim_IntList, (scaled, [1]))
            if total.meta["val"].dtype != new.meta["val"].dtype:
                total = call(aten._to_copy.default, (total,), {"dtype": new.meta["val"].dtype})
            new = call(aten.add.Tensor, (new, total))
    y.replace_all_uses_with(new)
    region = set(region)
    for n in g.nodes:  # checks of a region value (_assert_tensor_metadata) go with it
        if n.op == "call_function" and not n.users and n.all_input_nodes and set(n.all_input_nodes) <= region:
            region.add(n)
    order = [n for n in g.nodes if n in region]
    for n in reversed(order):
        if not n.users:
            g.erase_node(n)
