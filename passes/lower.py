"""Lowering: the planned global graph -> the program of one rank, with explicit collectives.

For every node, in order:
1. fetch each tensor input in the placement the chosen strategy needs, axis by axis, inserting a
   collective (:mod:`mcompile.ir.ops`) where the current placement differs — reused when the same value
   is needed in the same placement again (one all-gather feeds q, k and v);
2. on an axis where the loss is replicated (tp), a replicated input that requires grad and feeds
   an op with a non-replicated output gets Megatron's *f* (copy forward, all-reduce backward): its
   gradient there is Partial. When the replicated value is itself an all-gather, the all-gather's
   backward becomes a reduce-scatter instead (Korthikanti et al. 2022, sequence parallelism);
3. emit the op on local pieces, with its size arguments recomputed from local shapes (the rule's
   localizer) and symbolic sizes rebuilt from the program's own input sizes; or emit the strategy's
   special lowering (vocab-parallel embedding / cross-entropy).

Symbols: the captured batch and sequence symbols are the sizes of the program's user inputs. On
axes whose inputs arrive split (dp) a symbolic dim is already local; on the others (tp) a sharded
symbolic dim is divided by the axis size.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import SimpleNamespace

import sympy
import torch
import torch.fx as fx

from mcompile.capture.export import Captured
from mcompile.ir import meta as M
from mcompile.ir.annotate import layer_index
from mcompile.ir.ops import OPS
from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard
from mcompile.ir.plan import CollectiveKind, CollectiveSpec
from mcompile.passes.lower_dropout import is_random, is_training_dropout, lower_dropout, lower_random
from mcompile.passes.nodes import lazy_module
from mcompile.sharding.planner import vocab_local_size
from mcompile.sharding.propagate import AxisResult, requires_grad_nodes, writes_first_arg
from mcompile.sharding.rules import get_localizer, tensor_input_nodes, to_expr
from mcompile.sharding.rules.matmul import embedding_args

aten = torch.ops.aten
R = Replicate()
_DROP = {aten._assert_tensor_metadata.default}
# ops whose size arguments are values (scalars in arithmetic), not shapes
_VALUE_OPS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar,
              aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.true_divide.Tensor}
_SIMPLIFIED: dict = {}  # a collective's byte count (sympy, in batch/seq) -> its simplified text


def _own_size(sym, s, name: str):
    """A size of node ``name``'s own output for its localizer: ``None`` where it is a data-dependent size that
    ``name`` itself makes (Blt's ``ids[:, :n.item()]``: its length exists only once the node runs, and a localizer
    moves bounds of split dims, which such a dim is not); anything else as :class:`_Sym` gives it."""
    try:
        return sym(s)
    except _Unmade as e:
        if name in e.makers:
            return None
        raise


@dataclass
class AxisInfo:
    name: str
    size: int
    rank: int
    result: AxisResult
    inputs_presharded: bool  # dp: the program's inputs are already this rank's slice
    loss_replicated: bool  # grads of replicated values are exact (tp), not partial (dp)
    vocab_pad_multiple: int = 1  # a Shard dim that does not divide: padded to size * this (PlanOptions)
    moe: tuple = ("alltoall", 0.0)  # MoE layers over this axis (ep): dispatcher, capacity factor (PlanOptions)
    context_parallel: bool = False  # cp: the tokens split (mcompile.passes.cp.ops), the loss the ranks' sum
    cp_attention: str = "ring"  # cp: the attention variant (PlanOptions)

    def local_size(self, size: int, p) -> int:
        """This rank's share of a static dim of ``size`` placed ``p`` (Shard or BlockShard) on this
        axis: the plan's padded local size (:func:`mcompile.sharding.planner.vocab_local_size`)."""
        return vocab_local_size(size, self.size, self.vocab_pad_multiple if isinstance(p, Shard) else 1)


class _Unmade(NotImplementedError):
    """A data-dependent size read before any node that makes it is lowered; ``makers`` names those nodes."""

    def __init__(self, msg: str, makers: tuple):
        super().__init__(msg)
        self.makers = makers


class _Sym:
    """Turns sympy sizes into fx nodes computed from the program's input sizes."""

    def __init__(self, graph: fx.Graph, sources: dict, made: dict | None = None, env: dict | None = None,
                 place: dict | None = None):
        self.graph, self.sources, self.cache = graph, sources, {}
        # a data-dependent size (an unbacked symbol: JetMoe's count of tokens routed to an expert) is read from
        # the captured node that makes it (name, dim; dim None: the node is the size), once it is lowered
        self.made, self.env, self.place = made or {}, env, place

    def _made(self, e):
        lowered = [m for m in self.made[e] if m[0] in self.env]  # the first of its makers already in the program
        if not lowered:
            raise _Unmade(f"the data-dependent size {e} is read before any node that makes it "
                          f"({', '.join(m[0] for m in self.made[e][:3])}) is in the per-rank program",
                          tuple(m[0] for m in self.made[e]))
        name, dim, ndim = lowered[0]
        node = self.env[name]
        if dim is None:
            return node
        for p in self.place.get(name, ()):
            if isinstance(p, Shard | BlockShard) and p.dim % ndim == dim:
                raise NotImplementedError(f"the data-dependent size {e} is dim {dim} of {name}, which is split "
                                          "over ranks: its local size is not the single-device one")
        return self.graph.call_function(aten.sym_size.int, (node, dim))

    def __call__(self, e):
        if isinstance(e, int):
            return e
        e = sympy.sympify(e)
        if e.is_Integer:
            return int(e)
        if e in self.cache:
            return self.cache[e]
        if e.is_Symbol and e not in self.sources and e in self.made:
            out = self._made(e)
        elif e.is_Symbol:
            node, dim, k = self.sources[e]
            out = self.graph.call_function(aten.sym_size.int, (node, dim))
            if k != 1:
                out = self.graph.call_function(operator.floordiv, (out, k))
        elif e.is_Mul:
            coeff, rest = e.as_coeff_Mul()
            p, q = sympy.fraction(coeff)
            if coeff == 1:
                factors = [self(f) for f in e.args]
                out = factors[0]
                for f in factors[1:]:
                    out = self.graph.call_function(operator.mul, (out, f))
            else:
                out = self(rest)
            if coeff != 1 and p != 1:
                out = self.graph.call_function(operator.mul, (out, int(p)))
            if coeff != 1 and q != 1:
                out = self.graph.call_function(operator.floordiv, (out, int(q)))
        elif e.is_Add:
            terms = [self(t) for t in e.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.graph.call_function(operator.add, (out, t))
        elif isinstance(e, sympy.floor) and e.args[0].is_Mul:
            out = self(e.args[0])
        elif e.is_Pow and e.exp.is_Integer and e.exp > 0:
            base = self(e.base)
            out = base
            for _ in range(int(e.exp) - 1):
                out = self.graph.call_function(operator.mul, (out, base))
        elif type(e).__name__ in ("Min", "Max"):  # torch.utils._sympy's (a slice clamped to the sequence length)
            fold = torch.sym_min if type(e).__name__ == "Min" else torch.sym_max
            args = [self(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = self.graph.call_function(fold, (out, a))
        elif type(e).__name__ == "FloorDiv":
            out = self.graph.call_function(operator.floordiv, (self(e.args[0]), self(e.args[1])))
        else:
            raise NotImplementedError(f"cannot rebuild the size {e} in a per-rank program")
        self.cache[e] = out
        return out


def lower(cap: Captured, axes: list[AxisInfo], device: torch.device | str | None = None) -> tuple[fx.GraphModule, list]:
    """Build the per-rank program. Returns (GraphModule, collective specs in program order).

    ``device``: where the program runs; device literals of the captured graph (``arange(device=)``,
    casts) are rewritten to it (captured on the meta device, run on cpu or cuda). Each captured node is
    lowered in order by :meth:`_Lowering.lower_node` (the module docstring's steps 1-3)."""
    low = _Lowering(cap, axes, device)
    for node in cap.gm.graph.nodes:
        low.lower_node(node)
    return low.finish()


def _local_shape(meta_val, placements, axes: list[AxisInfo]) -> list:
    """This rank's shape (sympy sizes) of a value placed ``placements`` (per axis): a static split dim is the axis's
    padded local size; a symbolic one is divided by the axis size, except on axes whose inputs arrive split (dp),
    where it is already local."""
    shape = [to_expr(s) for s in meta_val.shape]
    for a, p in zip(axes, placements):
        if isinstance(p, Shard | BlockShard):
            d = p.dim % len(shape)
            if isinstance(shape[d], int):
                shape[d] = a.local_size(shape[d], p)
            elif not a.inputs_presharded:
                shape[d] = shape[d] / a.size
    return shape


def _made_sizes(src: fx.GraphModule) -> dict:
    """Each data-dependent size (an unbacked symbol) -> the captured nodes that make it, as (name, dim, ndim); dim
    None where the node is the size itself. :class:`_Sym` reads such a size from the first of them lowered."""
    made = {}
    for node in src.graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            made.setdefault(v.node.expr, []).append((node.name, None, 0))
        for d, size in enumerate(v.shape if isinstance(v, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                made.setdefault(size.node.expr, []).append((node.name, d, v.ndim))
    return made


class _Collectives:
    """Emits the program's collectives and keeps their specs, in program order (the plan's). Called as
    ``emit(op_name, args, origin, axis_i, fwd, bwd, dim, purpose, meta_val, pl)``: a special lowering
    (:data:`LOWERINGS`) gets it as ``emit``, and :meth:`record` the specs of collectives that run inside one
    emitted node."""

    def __init__(self, g: fx.Graph, axes: list[AxisInfo], symbols: dict):
        self.g, self.axes = g, axes
        self.specs: list[CollectiveSpec] = []
        self.named = {s: sympy.Symbol(k, positive=True, integer=True) for k, s in symbols.items()}

    def nbytes_expr(self, meta_val, placements, axis_idx) -> str:
        """The bytes of the tensor over the whole axis ``axis_idx`` (its placement there taken as Replicate), in the
        capture's named batch/seq symbols, simplified."""
        ps = list(placements)
        ps[axis_idx] = R  # bytes of the tensor over the whole axis
        n = sympy.Integer(meta_val.dtype.itemsize)
        for s in _local_shape(meta_val, ps, self.axes):
            n = n * s
        n = sympy.sympify(n).subs(self.named)
        if n not in _SIMPLIFIED:  # sympy.simplify is the lowering's hot spot; every layer asks the same
            _SIMPLIFIED[n] = str(sympy.simplify(n))
        return _SIMPLIFIED[n]

    def __call__(self, op_name, args, origin: fx.Node, axis_i: int, fwd, bwd, dim, purpose, meta_val, pl):
        """Append the collective ``op_name`` on ``args`` to the program, tagged with its spec (for ``origin``)."""
        if op_name not in OPS:  # the context-parallel ones (mcompile.passes.cp.ops registers them)
            import mcompile.passes.cp.ops  # noqa: F401
        node = self.g.call_function(OPS[op_name] if op_name in OPS else getattr(torch.ops.mcompile, op_name).default,
                                    args)
        spec = CollectiveSpec(
            op=op_name, forward=str(fwd), backward=str(bwd), axis=self.axes[axis_i].name, dim=dim,
            bytes=self.nbytes_expr(meta_val, pl, axis_i), node=node.name, origin=origin.name,
            layer=layer_index(origin), purpose=purpose,
        )
        node.meta[M.COLLECTIVE] = spec
        node.meta[M.ORIGIN] = origin.name
        node.meta[M.LAYER] = spec.layer
        self.specs.append(spec)
        return node

    def record(self, node: fx.Node, origin: fx.Node, axis_i: int, parts: list) -> None:
        """Specs of the collectives one emitted node runs inside (an MoE dispatch): ``parts`` are
        (forward kind, backward kind, meta of the moved tensor, placements, purpose)."""
        mine = node.meta.setdefault(M.COLLECTIVES, [])
        for fwd, bwd, meta_val, pl, purpose in parts:
            mine.append(CollectiveSpec(
                op=node.target.__name__, forward=str(fwd), backward=str(bwd), axis=self.axes[axis_i].name, dim=0,
                bytes=self.nbytes_expr(meta_val, pl, axis_i), node=node.name, origin=origin.name,
                layer=layer_index(origin), purpose=purpose))
        self.specs.extend(mine[-len(parts):] if parts else [])


class _Lowering:
    """What :func:`lower` threads through one per-rank program: the program being built (``g``), each captured
    node's value in it (``env``) and that value's placements per axis (``place``), the redistributions already
    emitted (``cache``: one all-gather feeds q, k and v), the rebuilder of symbolic sizes (``sym``), the
    collectives (``emit``) and which captured node each program node was emitted for (``emitted``)."""

    def __init__(self, cap: Captured, axes: list[AxisInfo], device):
        self.cap, self.axes = cap, axes
        self.device = torch.device(device) if device is not None else None
        self.src = src = cap.gm
        self.g = g = fx.Graph()
        self.env: dict[str, object] = {}
        self.place: dict[str, tuple] = {}  # orig node name -> per-axis placement of env value
        self.cache: dict[tuple, fx.Node] = {}
        self.rg = requires_grad_nodes(src, set(cap.params))
        sources = self._placeholders()
        # training-mode dropout draws its masks from (seed, step, batch offset): one small input of the program,
        # the same tensor for every dropout (passes/lower_dropout.py, mcompile/ir/dropout.py)
        self.rng = _rng_input(g, src) if any(is_training_dropout(n) or is_random(n) for n in src.graph.nodes) else None
        self.sym = _Sym(g, sources, _made_sizes(src), self.env, self.place)
        self.bsym = cap.symbols.get("batch")
        self.seq_sym = cap.symbols.get("seq")
        self.batch_global = self._batch_global()
        self.emit = _Collectives(g, axes, cap.symbols)
        self.emitted: dict[str, str] = {}  # program node -> the captured node whose lowering emitted it
        self.count = len(g.nodes)

    def _placeholders(self) -> dict:
        """The program's inputs, one per captured placeholder in its placements; returns the sources of the
        symbolic sizes (symbol -> (input, dim, k)): the user inputs' dynamic dims."""
        sources = {}
        for node in self.src.graph.nodes:
            if node.op != "placeholder":
                continue
            new = self.g.placeholder(node.name)
            new.meta.update({k: v for k, v in node.meta.items() if k in ("val", M.PARAM_FQN)})
            self.env[node.name] = new
            self.place[node.name] = tuple(a.result.placements.get(node.name, R) for a in self.axes)
            if node.name in self.cap.user_inputs and isinstance(node.meta.get("val"), torch.Tensor):
                for d, s in enumerate(node.meta["val"].shape):
                    if not isinstance(s, torch.SymInt):
                        continue
                    # a dim export refined to k*s (the model reshapes it into blocks of k: DeepSeek-V4's compressor
                    # windows) gives s as that dim // k
                    k, s = s.node.expr.as_coeff_Mul()
                    if s.is_Symbol and k.is_Integer and k > 0 and s not in sources:
                        sources[s] = (new, d, int(k))
        return sources

    def _batch_global(self) -> dict | None:
        """The batch symbol -> the whole batch, where the inputs arrive split (dp, ep); else None.

        A symbolic size used as a value, not a shape (a mean written as sum / numel, the tokens-per-expert
        fraction of a load-balancing loss), is the single-device model's: over the batch of every rank
        the inputs were split over (dp, ep), where the program's batch symbol is this rank's share."""
        split = 1
        for ax in self.axes:
            split *= ax.size if ax.inputs_presharded else 1
        return {self.bsym: self.bsym * split} if split > 1 and self.bsym is not None else None

    def finish(self) -> tuple[fx.GraphModule, list]:
        """The program as a GraphModule (dead code dropped), and the collective specs in program order."""
        self.g.eliminate_dead_code()
        gm = lazy_module(torch.nn.Module(), self.g)  # repeated and copied before any call: code made then
        gm.meta[M.EMITTED_FOR] = self.emitted  # for mcompile.sharding.repeat: which captured node each node implements
        gm.meta[M.VALUE_OF] = {k: v.name for k, v in self.env.items() if isinstance(v, fx.Node)}
        return gm, self.emit.specs

    # ---- fetching values in the placements a strategy needs (step 1) ----------------------------------------
    def fetch(self, a: fx.Node, want: tuple, partial_grad: tuple) -> fx.Node:
        """The local value of ``a`` in placements ``want`` (per axis); ``partial_grad``: per axis, whether it
        enters a region where its gradient is Partial (Megatron's *f*, step 2)."""
        cur = list(self.place[a.name])
        val = self.env[a.name]
        meta_val = a.meta["val"]
        for i, ax in enumerate(self.axes):
            if ax.inputs_presharded:
                c, w = cur[i], want[i]
                if isinstance(c, Partial) and isinstance(w, Replicate) and c.reduce_op in ("sum", "avg") \
                        and ax.size > 1:
                    val = self._batch_statistic(a, val, cur, i, w, meta_val)
                    cur[i] = w
                continue
            w = want[i]
            if ax.context_parallel:
                if cur[i] != w:
                    val = self._fetch_cp(a, val, tuple(cur), i, w, meta_val)
                    cur[i] = w
                continue
            need_f = partial_grad[i]
            if cur[i] == w and not need_f:
                continue
            key = (a.name, tuple(cur), i, w, need_f)
            if key not in self.cache:
                self.cache[key] = self._redistribute(a, val, cur, i, w, need_f, meta_val)
            val = self.cache[key]
            cur[i] = w
        return val

    def _batch_statistic(self, a: fx.Node, val, cur: list, i: int, w, meta_val):
        """A Partial statistic over the batch, reduced along an axis whose inputs arrive split (once per value).

        dp, ep: the program runs on this rank's own batch as if it were the whole batch; sizes built from the
        batch symbol are already local, so activations do not move along this axis inside the program (the
        runtime reduces the loss and the gradients over it). A statistic over the batch that the model reads
        again (an MoE layer's load-balancing loss: tokens per expert, mean router probability) is reduced here:
        Partial -> Replicate is an all-reduce. The step's loss is the sum of the ranks' (the runtime adds them),
        so its adjoint is an all-reduce too (copy_ar_bwd)."""
        ax, c = self.axes[i], cur[i]
        key = (a.name, tuple(cur), i, w, False)
        if key not in self.cache:
            v = val
            if a.name in self.rg:
                v = self.emit("copy_ar_bwd", (v, ax.name, ax.size), a, i, CollectiveKind.NONE,
                              CollectiveKind.ALL_REDUCE, None, "batch statistic: adjoint", meta_val, cur)
            v = self.emit("all_reduce", (v, ax.name, ax.size), a, i, CollectiveKind.ALL_REDUCE,
                          CollectiveKind.NONE, None, "batch statistic", meta_val, cur)
            if c.reduce_op == "avg":
                v = self.g.call_function(aten.div.Tensor, (v, ax.size))
            self.cache[key] = v
        return self.cache[key]

    def _redistribute(self, a: fx.Node, val, cur: list, i: int, w, need_f: bool, meta_val):
        """``a``'s local ``val`` moved from ``cur[i]`` to ``w`` along axis ``i`` (tp), with Megatron's *f* where
        ``need_f``: an all-reduce of a Partial, a reduce-scatter, an all-gather (whose backward is a
        reduce-scatter under *f*: sequence parallelism) or a slice."""
        g, ax, cache, emit = self.g, self.axes[i], self.cache, self.emit
        c, n = cur[i], ax.size
        grad = a.name in self.rg
        if c == w and need_f:
            val = emit("copy_ar_bwd", (val, ax.name, n), a, i, CollectiveKind.NONE,
                       CollectiveKind.ALL_REDUCE, None, "enter tp region", meta_val, cur)
        elif isinstance(c, Partial) and isinstance(w, Replicate):
            op = "all_reduce_max" if c.reduce_op == "max" else "all_reduce"
            if c.reduce_op not in ("sum", "max", "avg"):
                raise NotImplementedError(f"reducing Partial({c.reduce_op}) of {a.name} on {ax.name}")
            # one reduction serves every reader: one entering the tp region (f, below) and one that
            # is not (a post-norm layer's residual reads the embedding its q/k/v projections read)
            plain = (a.name, tuple(cur), i, w, False)
            if plain in cache:
                val = cache[plain]
            else:
                val = emit(op, (val, ax.name, n), a, i,
                           CollectiveKind.ALL_REDUCE_MAX if op == "all_reduce_max" else
                           CollectiveKind.ALL_REDUCE, CollectiveKind.NONE, None, "reduce partial",
                           meta_val, cur)
                if c.reduce_op == "avg":
                    # each rank holds the mean of its shard, equal ones (the reduction rule offers no
                    # Partial(avg) over a dim the axis does not divide): the mean is their sum / n. The
                    # all-reduce's backward is the identity (the replicated gradient is exact on every
                    # rank), so each rank's partial mean gets grad / n here, as d(mean)/d(partial) = 1/n
                    val = g.call_function(aten.div.Tensor, (val, n))
                cache[plain] = val
            if need_f:
                reduced = [*cur[:i], w, *cur[i + 1:]]
                val = emit("copy_ar_bwd", (val, ax.name, n), a, i, CollectiveKind.NONE,
                           CollectiveKind.ALL_REDUCE, None, "enter tp region", meta_val, reduced)
        elif isinstance(c, Partial) and isinstance(w, Shard) and c.reduce_op == "sum":
            d = w.dim % meta_val.ndim
            val = emit("reduce_scatter", (val, d, ax.name, n), a, i, CollectiveKind.REDUCE_SCATTER,
                       CollectiveKind.ALL_GATHER if grad else CollectiveKind.NONE, d,
                       "reduce-scatter partial", meta_val, cur)
        elif isinstance(c, Shard) and isinstance(w, Replicate):
            d = c.dim % meta_val.ndim
            mode = "reduce_scatter" if need_f else "split"
            bwd = CollectiveKind.REDUCE_SCATTER if (need_f and grad) else CollectiveKind.NONE
            val = emit("all_gather", (val, d, ax.name, n, mode), a, i, CollectiveKind.ALL_GATHER,
                       bwd, d, "all-gather", meta_val, cur)
            size = meta_val.shape[d]
            if isinstance(size, int) and size % n:  # a padded vocabulary: drop the padding columns
                val = g.call_function(aten.narrow.default, (val, d, 0, size))
        elif isinstance(c, Replicate) and isinstance(w, Shard):
            d = w.dim % meta_val.ndim
            val = emit("shard_slice", (val, d, ax.name, n), a, i, CollectiveKind.NONE,
                       CollectiveKind.ALL_GATHER if grad else CollectiveKind.NONE, d, "slice",
                       meta_val, cur)
        elif isinstance(c, Replicate) and isinstance(w, BlockShard) and isinstance(w.blocks, int):
            # a share of each of k equal blocks: the dim viewed as (k, size / k), the inner dim sliced
            d = w.dim % meta_val.ndim
            val = g.call_function(aten.unflatten.int, (val, d, [w.blocks, -1]))
            val = emit("shard_slice", (val, d + 1, ax.name, n), a, i, CollectiveKind.NONE,
                       CollectiveKind.ALL_GATHER if grad else CollectiveKind.NONE, d, "slice blocks",
                       meta_val, cur)
            val = g.call_function(aten.flatten.using_ints, (val, d, d + 1))
        else:
            raise NotImplementedError(f"redistribute {a.name} on {ax.name}: {c!r} -> {w!r}")
        return val

    def _fetch_cp(self, a: fx.Node, val, cur: tuple, i: int, w, meta_val):
        """Redistribute along a context-parallel axis (mcompile.passes.cp.ops). A Shard there is the tokens' split:
        on the sequence dim, or on batch*seq flattened (the sequence innermost), each rank holding its
        load-balanced chunks. The loss is the ranks' sum, so every adjoint is a partial sum's: a slice's is
        local (the gradient scattered into zeros), a gather's is a reduce-scatter, and a reduced statistic's
        is an all-reduce."""
        c, ax, emit = cur[i], self.axes[i], self.emit
        key = (a.name, cur, i, w, "cp")
        if key in self.cache:
            return self.cache[key]
        if self.seq_sym is None:
            raise NotImplementedError(f"{a.name}: context parallelism splits the sequence, and this capture has no "
                                      "dynamic sequence dim")
        seq = self.sym(self.seq_sym)
        if isinstance(c, Partial) and isinstance(w, Replicate) and c.reduce_op in ("sum", "avg"):
            v = val
            if a.name in self.rg:
                v = emit("copy_ar_bwd", (v, ax.name, ax.size), a, i, CollectiveKind.NONE,
                         CollectiveKind.ALL_REDUCE, None, "token statistic: adjoint", meta_val, cur)
            v = emit("all_reduce", (v, ax.name, ax.size), a, i, CollectiveKind.ALL_REDUCE,
                     CollectiveKind.NONE, None, "token statistic", meta_val, cur)
            if c.reduce_op == "avg":
                v = self.g.call_function(aten.div.Tensor, (v, ax.size))
        elif isinstance(c, Replicate) and isinstance(w, Shard):
            d = w.dim % meta_val.ndim
            v = emit("cp_slice", (val, d, ax.name, ax.size, seq), a, i, CollectiveKind.NONE,
                     CollectiveKind.NONE, d, "cp: the rank's tokens", meta_val, cur)
        elif isinstance(c, Shard) and isinstance(w, Replicate):
            d = c.dim % meta_val.ndim
            v = emit("cp_gather", (val, d, ax.name, ax.size, seq), a, i, CollectiveKind.ALL_GATHER,
                     CollectiveKind.REDUCE_SCATTER if a.name in self.rg else CollectiveKind.NONE, d,
                     "cp: every rank's tokens", meta_val, cur)
        else:
            raise NotImplementedError(
                f"redistribute {a.name} on {ax.name}: {c!r} -> {w!r} (context parallelism moves a value between "
                "the whole sequence and the ranks' tokens only)")
        self.cache[key] = v
        return v

    # ---- lowering the captured nodes ----------------------------------------------------------------------
    def lower_node(self, node: fx.Node) -> None:
        """Lower one captured node into the program (placeholders are already there)."""
        g, env = self.g, self.env
        if node.op == "placeholder":
            self.count = len(g.nodes)
            return
        if node.op == "output":
            self._lower_output(node)
            return
        if node.target in _DROP:
            return
        if node.target is operator.getitem:
            new = g.call_function(operator.getitem, (env[node.args[0].name], node.args[1]))
            env[node.name] = new
            self.place[node.name] = tuple(a.result.placements.get(node.name) for a in self.axes)
            _copy_meta(node, new)
        else:
            strategies = [a.result.strategies.get(node.name) for a in self.axes]
            if all(s is None for s in strategies):  # sym_size and other non-tensor nodes
                env[node.name] = g.node_copy(node, lambda x: env[x.name])
            else:
                self._lower_op(node, strategies)
        self._tag(node.name)

    def _tag(self, name: str) -> None:
        """The nodes appended since the last captured node were emitted for ``name``."""
        n = self.g._root.prev
        for _ in range(len(self.g.nodes) - self.count):
            self.emitted[n.name] = name
            n = n.prev
        self.count = len(self.g.nodes)

    def _lower_output(self, node: fx.Node) -> None:
        """The program's outputs: a tensor output stays as it is along axes whose ranks' results the runtime sums
        (dp, ep: the loss over the batch; cp: over the tokens, a value of the tokens gathered whole), and is made
        whole (Replicate) along the others."""
        outs = []
        results = node.args[0] if isinstance(node.args[0], tuple | list) else [node.args[0]]
        for a in results:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                want = tuple(R if ax.loss_replicated or (ax.context_parallel
                                                         and not isinstance(self.place[a.name][i], Partial))
                             else self.place[a.name][i] for i, ax in enumerate(self.axes))
                outs.append(self.fetch(a, want, tuple(False for _ in self.axes)))
            else:
                outs.append(self.env.get(a.name, a) if isinstance(a, fx.Node) else a)
        self.g.output(tuple(outs) if isinstance(node.args[0], tuple | list) else outs[0])

    def _lower_op(self, node: fx.Node, strategies: list) -> None:
        """A tensor op: its inputs fetched in its strategies' placements (steps 1-2), then the op emitted on local
        pieces, or its strategy's special lowering (:data:`LOWERINGS`), or dropout's / a random op's (step 3)."""
        g, axes = self.g, self.axes
        want = self._fetch_inputs(node, strategies)
        lowering = next((s.lowering for s in strategies if s is not None and s.lowering), None)
        if lowering is None and (is_training_dropout(node) or is_random(node)):
            x_node = node.args[0]
            in_pl = tuple(s.inputs[0] if s is not None else R for s in strategies)
            new = (lower_dropout if is_training_dropout(node) else lower_random)(
                g, node, want[x_node.name], in_pl, axes, self.sym, self.bsym, self.seq_sym, self.rng, self.device)
            _copy_meta(node, new)
            self.env[node.name] = new
            self.place[node.name] = tuple(s.outputs[0] if s is not None and s.outputs else R for s in strategies)
            return
        out_pl = tuple(s.outputs if len(s.outputs) > 1 else (s.outputs[0] if s.outputs else None) for s in strategies)
        if lowering is not None:
            ax_i = next(i for i, s in enumerate(strategies) if s is not None and s.lowering)
            new = LOWERINGS[lowering](g, node, want, axes[ax_i], self.emit, ax_i, self.place, self.device)
        else:
            new = self._local_op(node, strategies, want, out_pl)
        _copy_meta(node, new)
        self.env[node.name] = new
        self.place[node.name] = out_pl
        self._write_back(node, new, want, out_pl)

    def _fetch_inputs(self, node: fx.Node, strategies: list) -> dict:
        """Each tensor input of ``node`` (by name) fetched in the placements its strategies need. On an axis where
        the loss is replicated (tp), a replicated input that requires grad and feeds an op with a non-replicated
        output enters with Megatron's *f* (step 2)."""
        want = {}
        for j, a in enumerate(tensor_input_nodes(node)):
            req, pg = [], []
            for ax, s in zip(self.axes, strategies):
                r = s.inputs[j]
                req.append(r)
                out_p = s.outputs[0] if s.outputs else R
                pg.append(
                    ax.loss_replicated and isinstance(r, Replicate) and not isinstance(out_p, Replicate)
                    and a.name in self.rg and a.name not in self.cap.params
                )
            want[a.name] = self.fetch(a, tuple(req), tuple(pg))
        return want

    def _local_op(self, node: fx.Node, strategies: list, want: dict, out_pl: tuple) -> fx.Node:
        """The op on local pieces (step 3): its arguments mapped into the program (symbolic sizes rebuilt from the
        program's input sizes, a size used as a value made the whole batch's), and its size arguments recomputed
        from local shapes by the rule's localizer."""
        env, sym, device = self.env, self.sym, self.device
        glob = self.batch_global if node.target in _VALUE_OPS else None
        args = fx.node.map_aggregate(node.args, lambda x, w=want, gl=glob: _arg(x, w, env, sym, device, gl))
        kwargs = fx.node.map_aggregate(node.kwargs, lambda x, w=want, gl=glob: _arg(x, w, env, sym, device, gl))
        loc = get_localizer(node.target)
        if loc is not None:
            vals = node.meta["val"] if isinstance(node.meta["val"], list | tuple) else [node.meta["val"]]
            per_out = [tuple(p[k] if isinstance(p, tuple) else p for p in out_pl) for k in range(len(vals))]
            shapes = [[_own_size(sym, s, node.name) for s in _local_shape(v, pl, self.axes)]
                      for v, pl in zip(vals, per_out)]
            in_pl = tuple(s.inputs if s is not None else None for s in strategies)
            args, kwargs = loc(args, kwargs, in_pl, out_pl, shapes, tuple(ax.size for ax in self.axes))
        return _call(self.g, node, tuple(args), dict(kwargs), device)

    def _write_back(self, node: fx.Node, new: fx.Node, want: dict, out_pl: tuple) -> None:
        """An in-place write that ran on a copy of its destination in other placements (a fallback's all-gather, a
        re-slice): what reads the destination or its base after it (through other views) must see it, so the
        written value is put back into the rank's own piece, in the destination's placements (slow, never wrong)."""
        dst = _written(node)
        if dst is None or dst.name not in want or want[dst.name] is self.env[dst.name]:
            return
        try:
            back = self.fetch(node, tuple(self.place[dst.name]), tuple(False for _ in self.axes))
        except NotImplementedError as e:
            raise NotImplementedError(
                f"{node.name} ({node.target}) writes in place into {dst.name}, which this rank holds as "
                f"{self.place[dst.name]}; the write ran on a copy in {out_pl} and cannot be put back ({e}): write it "
                "out of place (x = x + y, torch.where, torch.cat)") from e
        wb = self.g.call_function(aten.copy_.default, (self.env[dst.name], back))
        wb.meta.update({k: v for k, v in new.meta.items() if k != "val"})


def _written(node: fx.Node) -> fx.Node | None:
    """The captured node whose value ``node`` writes in place (its first argument, for an op whose schema
    writes it: ``add_``, ``copy_``, ``masked_fill_`` ...), or None."""
    return node.args[0] if writes_first_arg(node) else None


def _rng_input(g: fx.Graph, src: fx.Graph) -> fx.Node:
    """The program input ``mc_rng`` (int64 [3]: seed, step, batch offset), after the captured ones."""
    from mcompile.ir.dropout import RNG_INPUT

    node = g.placeholder(RNG_INPUT)
    mode = next((n.meta["val"].fake_mode for n in src.graph.nodes if n.op == "placeholder"
                 and hasattr(n.meta.get("val"), "fake_mode")), None)
    if mode is not None:
        with mode:
            node.meta["val"] = torch.empty(3, dtype=torch.int64)
    return node


def _call(g: fx.Graph, node: fx.Node, args: tuple, kwargs: dict, device) -> fx.Node:
    """The op on local pieces, adapted to the device it will run on: a model captured on the meta device
    may have taken a branch for accelerators (transformers' load-balancing loss counts with ``histc``
    on int32 there, which the CPU kernel refuses: counted in float32 on the CPU, exact to 2**24)."""
    if (node.target is aten.histc.default and device is not None and torch.device(device).type == "cpu"
            and not node.args[0].meta["val"].dtype.is_floating_point):
        x = g.call_function(aten._to_copy.default, (args[0],), {"dtype": torch.float32})
        h = g.call_function(aten.histc.default, (x, *args[1:]), kwargs)
        return g.call_function(aten._to_copy.default, (h,), {"dtype": node.meta["val"].dtype})
    return g.call_function(node.target, args, kwargs)


def _copy_meta(node: fx.Node, new: fx.Node):
    for k in ("stack_trace", "nn_module_stack"):
        if k in node.meta:
            new.meta[k] = node.meta[k]
    new.meta[M.ORIGIN] = node.name
    new.meta[M.LAYER] = layer_index(node)
    if node.meta.get(M.ATTENTION_CORE):
        new.meta[M.ATTENTION_CORE] = True


def _arg(x, want, env, sym, device, glob=None):
    if isinstance(x, torch.device) and device is not None:
        return device
    if isinstance(x, fx.Node):
        if x.name in want:
            return want[x.name]
        v = x.meta.get("val")
        if isinstance(v, torch.SymInt):
            e = to_expr(v)
            if glob is not None and isinstance(e, sympy.Expr):
                e = e.subs(glob)  # a size read as a value (count / numel): the whole batch's
            return sym(e)
        if isinstance(v, torch.SymFloat) and glob is not None:
            # a float size (transformers' load-balancing loss adds 0.0 + rows per layer): the integer
            # expression under torch's ToFloat, globalised and rebuilt; aten divides by an int alike
            e = v.node.expr.replace(lambda t: type(t).__name__ == "ToFloat", lambda t: t.args[0])
            if not e.free_symbols or not all(c.is_integer for c in e.atoms(sympy.Number)):
                return env[x.name]
            return sym(e.subs(glob))
        return env[x.name]
    return x


# ---- special lowerings ------------------------------------------------------------------------
def vocab_parallel_embedding(g, node, want, ax: AxisInfo, emit, ax_i, place, device):
    """Rows [start, start + V/n) live here: look up in-range ids, zero the others (output Partial).

    ``padding_idx`` (a row that gets no gradient) becomes the local row it falls on, or none where
    it lives on another rank. ``scale_grad_by_freq`` never reaches here: the rule offers no
    vocab-parallel strategy for it (out-of-range ids looked up as row 0 would count as row 0)."""
    weight, ids = (want[a.name] for a in tensor_input_nodes(node)[:2])
    w_meta = tensor_input_nodes(node)[0].meta["val"]
    v_local = ax.local_size(int(w_meta.shape[0]), Shard(0))
    start = ax.rank * v_local
    padding_idx = embedding_args(node)[0]
    local_padding = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + v_local else -1
    shifted = g.call_function(aten.sub.Tensor, (ids, start))
    below = g.call_function(aten.lt.Scalar, (shifted, 0))
    above = g.call_function(aten.ge.Scalar, (shifted, v_local))
    outside = g.call_function(aten.logical_or.default, (below, above))
    safe = g.call_function(aten.masked_fill.Scalar, (shifted, outside, 0))
    rows = g.call_function(aten.embedding.default, (weight, safe, local_padding))
    mask = g.call_function(aten.unsqueeze.default, (outside, -1))
    return g.call_function(aten.masked_fill.Scalar, (rows, mask, 0.0))


def vocab_parallel_cross_entropy(g, node, want, ax: AxisInfo, emit, ax_i, place, device):
    """Cross-entropy over vocab-sharded logits without gathering them (Megatron's
    ``vocab_parallel_cross_entropy``): a max all-reduce (detached), then the sum of exponentials and
    the target logit, each summed over the axis; padded vocabulary columns are masked to -inf. Carries
    ``ignore_index``, ``reduction`` and ``label_smoothing``; a class ``weight`` is not offered this
    strategy (the rule keeps such logits whole)."""
    x_node, t_node = tensor_input_nodes(node)[:2]
    x, target = want[x_node.name], want[t_node.name]
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    smoothing = float((node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)) or 0.0)
    vocab = int(x_node.meta["val"].shape[1])
    n = ax.size
    v_local = ax.local_size(vocab, Shard(1))
    start = ax.rank * v_local
    out_dtype = x_node.meta["val"].dtype
    # at least fp32 (Megatron's upcast of bf16 / fp16 logits), never below the logits' own precision: a float64
    # model's loss and logit gradients stay float64, as its single-device cross-entropy computes them
    xf = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.promote_types(out_dtype, torch.float32)})
    if start + v_local > vocab:  # padded columns on this rank: never the max, never in the sum
        valid_cols = max(0, vocab - start)
        cols = g.call_function(aten.arange.default, (v_local,), {"device": device or x_node.meta["val"].device})
        pad = g.call_function(aten.ge.Scalar, (cols, valid_cols))
        xf = g.call_function(aten.masked_fill.Scalar, (xf, pad, float("-inf")))
    mx_local = g.call_function(aten.amax.default, (g.call_function(aten.detach.default, (xf,)), [1], True))
    pl = tuple(R if i == ax_i else p for i, p in enumerate(place[x_node.name]))
    mx = emit("all_reduce_max", (mx_local, ax.name, n), node, ax_i, CollectiveKind.ALL_REDUCE_MAX,
              CollectiveKind.NONE, None, "vocab-parallel loss: max", _meta_like(x_node, 1), pl)
    z = g.call_function(aten.sub.Tensor, (xf, mx))
    sumexp_local = g.call_function(aten.sum.dim_IntList, (g.call_function(aten.exp.default, (z,)), [1]))
    sumexp = emit("all_reduce", (sumexp_local, ax.name, n), node, ax_i, CollectiveKind.ALL_REDUCE,
                  CollectiveKind.NONE, None, "vocab-parallel loss: sum exp", _meta_like(x_node, None), pl)
    t_local = g.call_function(aten.sub.Tensor, (target, start))
    below = g.call_function(aten.lt.Scalar, (t_local, 0))
    above = g.call_function(aten.ge.Scalar, (t_local, v_local))
    outside = g.call_function(aten.logical_or.default, (below, above))
    safe = g.call_function(aten.masked_fill.Scalar, (t_local, outside, 0))
    picked = g.call_function(aten.gather.default, (z, 1, g.call_function(aten.unsqueeze.default, (safe, 1))))
    picked = g.call_function(aten.squeeze.dim, (picked, 1))
    picked = g.call_function(aten.masked_fill.Scalar, (picked, outside, 0.0))
    picked = emit("all_reduce", (picked, ax.name, n), node, ax_i, CollectiveKind.ALL_REDUCE,
                  CollectiveKind.NONE, None, "vocab-parallel loss: target logit", _meta_like(x_node, None), pl)
    log_sumexp = g.call_function(aten.log.default, (sumexp,))
    loss = g.call_function(aten.sub.Tensor, (log_sumexp, picked))
    if smoothing:
        # torch's label smoothing: (1 - e) * nll + e * mean over the true vocabulary of -log p, where
        # -sum_c log p_c = V * log(sum exp) - sum_c z_c: one more all-reduce, of sum_c z_c
        z_valid = z if start + v_local <= vocab else g.call_function(aten.masked_fill.Scalar, (z, pad, 0.0))
        zsum = emit("all_reduce", (g.call_function(aten.sum.dim_IntList, (z_valid, [1])), ax.name, n), node, ax_i,
                    CollectiveKind.ALL_REDUCE, CollectiveKind.NONE, None, "vocab-parallel loss: label smoothing",
                    _meta_like(x_node, None), pl)
        smooth = g.call_function(aten.sub.Tensor, (log_sumexp, g.call_function(aten.div.Tensor, (zsum, vocab))))
        loss = g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (loss, 1.0 - smoothing)),
                                                 g.call_function(aten.mul.Tensor, (smooth, smoothing))))
    ignored = g.call_function(aten.eq.Scalar, (target, ignore))
    loss = g.call_function(aten.masked_fill.Scalar, (loss, ignored, 0.0))
    if reduction == 1:
        kept = g.call_function(aten.logical_not.default, (ignored,))
        count = g.call_function(aten.sum.default, (kept,))
        total = g.call_function(aten.sum.default, (loss,))
        loss = g.call_function(aten.div.Tensor, (total, count))
    elif reduction == 2:
        loss = g.call_function(aten.sum.default, (loss,))
    return g.call_function(aten._to_copy.default, (loss,), {"dtype": out_dtype})


def _meta_like(x_node: fx.Node, keep_last):
    """Shape and dtype of a per-row fp32 statistic of the logits (for the collective's byte count)."""
    v = x_node.meta["val"]
    shape = (v.shape[0], 1) if keep_last else (v.shape[0],)
    return SimpleNamespace(shape=shape, dtype=torch.float32, ndim=len(shape))


def moe_expert_parallel(g, node, want, ax: AxisInfo, emit, ax_i, place, device):
    """An MoE layer over ``ep``: this rank's tokens dispatched to the ranks of their experts and back
    (mcompile.ir.moe.moe_ep). The plan records its collectives, bytes as this rank's input: for the
    all-to-all dispatcher the counts (E int64), the dispatch and the combine (every routed slot's token
    row, its own experts' share included), each an all-to-all forward and backward; for the all-gather
    one the tokens, routing and weights gathered and the outputs reduce-scattered."""
    from mcompile.ir.moe import moe_ep_call

    ins = tensor_input_nodes(node)
    x, idx = (a.meta["val"] for a in ins[:2])
    E = int(ins[3].meta["val"].shape[0])
    dispatcher, capacity = ax.moe
    new = g.call_function(moe_ep_call, tuple(want[a.name] for a in ins),
                          {"form": node.kwargs["form"], "n_experts": E, "axis": ax.name, "n": ax.size,
                           "dispatcher": dispatcher, "capacity": capacity})
    pl, a2a, none = place[ins[0].name], CollectiveKind.ALL_TO_ALL, CollectiveKind.NONE
    if dispatcher == "alltoall":
        rows = SimpleNamespace(shape=(x.shape[0] * idx.shape[1], x.shape[1]), dtype=x.dtype, ndim=2)
        counts = SimpleNamespace(shape=(E,), dtype=torch.int64, ndim=1)
        parts = [(a2a, none, counts, (R,) * len(pl), "moe: tokens per expert"),
                 (a2a, a2a, rows, pl, "moe: dispatch"), (a2a, a2a, rows, pl, "moe: combine")]
    else:  # every rank's tokens gathered (with their routing), the outputs reduce-scattered back
        ag, rs = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER
        w = SimpleNamespace(shape=tuple(idx.shape), dtype=torch.float32, ndim=2)
        parts = [(ag, rs, x, pl, "moe: gather tokens"), (ag, none, idx, pl, "moe: gather routing"),
                 (ag, rs, w, pl, "moe: gather weights"), (rs, ag, x, pl, "moe: reduce-scatter outputs")]
    emit.record(new, node, ax_i, parts)
    return new


def context_parallel_attention(g, node, want, ax: AxisInfo, emit, ax_i, place, device):
    """Attention over cp (mcompile.passes.cp.ops): this rank's queries against every rank's keys, by the plan's
    variant. The plan records its communication: per variant what moves (K/V around the ring in cp - 1
    steps, K/V all-gathered, or q/k/v/out all-to-all), bytes as this rank's tensors."""
    import mcompile.passes.cp.ops  # noqa: F401  (registers mcompile::cp_attention)

    ins = tensor_input_nodes(node)
    q, k, v = (want[a.name] for a in ins[:3])
    mask = want[ins[3].name] if len(ins) > 3 else None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    args = list(node.args) + [None] * (8 - len(node.args))
    opt = {k_: node.kwargs.get(k_, args[j]) for j, k_ in enumerate(names)}
    if opt["dropout_p"]:
        raise NotImplementedError(f"{node.name}: attention dropout (p={opt['dropout_p']}) under context "
                                  "parallelism is not supported; train with dropout_p=0 in attention")
    qv, kvv = ins[0].meta["val"], ins[1].meta["val"]
    hq, hkv = int(qv.shape[1]), int(kvv.shape[1])
    if hq != hkv and not opt["enable_gqa"]:
        raise NotImplementedError(f"{node.name}: {hq} query heads and {hkv} key heads without enable_gqa")
    scale = float(opt["scale"]) if opt["scale"] is not None else float(qv.shape[-1]) ** -0.5
    variant = ax.cp_attention
    both = g.call_function(torch.ops.mcompile.cp_attention.default,
                           (q, k, v, mask, ax.name, ax.size, variant, bool(opt["is_causal"]), scale, True))
    new = g.call_function(operator.getitem, (both, 0))
    pl = place[ins[0].name]
    p2p, ag, rs, a2a = "sendrecv", CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL
    kv = kvv
    if variant == "ring":
        parts = [(p2p, p2p, kv, pl, f"cp ring: K/V x {ax.size - 1} steps")] * 2
    elif variant == "allgather":
        parts = [(ag, rs, kv, pl, "cp: gather K"), (ag, rs, kv, pl, "cp: gather V")]
    else:
        parts = [(a2a, a2a, qv, pl, "cp a2a: q"), (a2a, a2a, kv, pl, "cp a2a: k"), (a2a, a2a, kv, pl, "cp a2a: v"),
                 (a2a, a2a, qv, pl, "cp a2a: out")]
    emit.record(both, node, ax_i, parts)
    return new


LOWERINGS = {
    "cp_attention": context_parallel_attention,
    "moe_ep": moe_expert_parallel,
    "vocab_parallel_embedding": vocab_parallel_embedding,
    "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
}
