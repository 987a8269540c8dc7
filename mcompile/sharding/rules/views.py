"""Views and data movement: view/reshape (and ``view_as`` / ``reshape_as``), unsqueeze/squeeze,
transpose/permute, expand (``expand_as``), ``view_as_complex`` / ``view_as_real``, slice, select,
split / chunk / unbind / tensor_split, cat / concatenate, pad, im2col.

view/reshape group input and output dims into minimal runs of equal product (the same idea as
DTensor's view groups, Ansel et al. 2024). A sharded input dim stays sharded when it is the
outermost non-unit dim of its group: it becomes the outermost output dim of the group, which must
split evenly (``tp=3`` does not divide 8 heads: the rule records why and offers no such strategy).
"""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard
from mcompile.sharding.rules.base import OpInfo, R, Strategy, divisible, localizer, norm_dim, rule, same

aten = torch.ops.aten


def _bigger(a, b) -> int:
    """Compare two positive sizes: 1 if a > b, -1 if a < b, 0 if equal (symbols count as large)."""
    if same(a, b):
        return 0
    ratio = sympy.simplify(sympy.sympify(a) / sympy.sympify(b))
    if ratio.is_Number:
        return 1 if ratio > 1 else -1
    num, den = sympy.fraction(ratio)
    if den == 1:
        return 1
    if num == 1:
        return -1
    return 1 if len(num.free_symbols) >= len(den.free_symbols) else -1


def view_groups(ishape, oshape) -> list[tuple[list[int], list[int]]]:
    """Minimal (input dims, output dims) runs of equal product; unit dims form their own groups."""
    groups = []
    i = j = 0
    while i < len(ishape) or j < len(oshape):
        if i < len(ishape) and same(ishape[i], 1) and not (j < len(oshape) and same(oshape[j], 1)):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(oshape) and same(oshape[j], 1) and not (i < len(ishape) and same(ishape[i], 1)):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(ishape) or j >= len(oshape):
            raise ValueError(f"view from {ishape} to {oshape}: products differ")
        ins, outs = [i], [j]
        pi, po = ishape[i], oshape[j]
        i += 1
        j += 1
        while True:
            c = _bigger(po, pi)
            if c == 0:
                break
            if (i if c > 0 else j) >= (len(ishape) if c > 0 else len(oshape)):
                # sizes whose products cannot be matched (a size that depends on values: BLT's patch count)
                raise ValueError(f"view from {ishape} to {oshape}: no grouping of dims with equal products")
            if c > 0:
                pi = pi * ishape[i]
                ins.append(i)
                i += 1
            else:
                po = po * oshape[j]
                outs.append(j)
                j += 1
        groups.append((ins, outs))
    return groups


def map_view_placement(p, ishape, oshape, n: int, notes: list[str] | None = None):
    """Where placement ``p`` of the input lands on the output of a view, or None."""
    if isinstance(p, Replicate | Partial):
        return p
    d = p.dim % len(ishape)
    try:
        groups = view_groups(ishape, oshape)
    except ValueError as e:  # no dim of the output is known to hold the sharded one: not offered
        if notes is not None:
            notes.append(str(e))
        return None
    for ins, outs in groups:
        if d not in ins:
            continue
        big_in = [k for k in ins if not same(ishape[k], 1)]
        big_out = [k for k in outs if not same(oshape[k], 1)]
        if not big_out or big_in[0] != d:
            if notes is not None:
                notes.append(f"sharded dim {d} (size {ishape[d]}) is not the outermost dim of its view group")
            return None
        o = big_out[0]
        if isinstance(p, BlockShard):
            if len(big_in) == 1 and len(big_out) == 1:
                return BlockShard(o, p.blocks)
            # equal blocks viewed apart ([.., 2F] -> [.., 2, F]: Moshi's fused gate/up; [.., 3F] -> [.., 3, heads,
            # head_dim]: ModernBERT's fused q/k/v): every rank holds its share of each block, a shard of the
            # block's outermost inner dim
            if len(big_in) == 1 and len(big_out) >= 2 and isinstance(p.blocks, int) and \
                    same(oshape[o], p.blocks) and divisible(oshape[big_out[1]], n):
                return Shard(big_out[1])
            # blocks of whole heads viewed apart or merged ([.., 2 * heads * d] -> [.., 2 * heads, d], and back):
            # each block is a run of the outermost dim, a rank's share of a block its share of that run (DiffLlama's
            # head pairs: q_proj's rows in two blocks of heads, head i paired with head i + heads / 2); unequal blocks
            # of whole heads likewise (Ergo's fused q/k/v viewed into [.., 4 + 2 + 2 heads, d] before the cut)
            units = oshape[o] if len(big_out) > 1 else ishape[d]
            if (len(big_in) == 1) != (len(big_out) == 1) and (
                    divisible(units, p.blocks * n) if isinstance(p.blocks, int)
                    else isinstance(units, int) and p.divides(units, n)):
                return BlockShard(o, p.blocks)
            return None
        if len(big_out) > 1 and not divisible(oshape[o], n):
            if notes is not None:
                notes.append(
                    f"indivisible: dim {d} of size {ishape[d]} splits into {oshape[o]} x "
                    f"{sympy.prod([oshape[k] for k in big_out[1:]])} and {oshape[o]} does not divide by {n}"
                )
            return None
        return Shard(o)
    return None


def map_token_view(p: Shard, ishape, oshape, tok):
    """Where the tokens' split (cp: a Shard on the sequence, or on batch*seq flattened with the sequence
    innermost) lands on the output of a view: the dim of the same view group that holds the sequence,
    which must stay the innermost non-unit dim of its group on both sides ((b, s) <-> b*s), so each
    rank's tokens stay its tokens. None otherwise."""
    d = p.dim % len(ishape)

    def has_tok(size) -> bool:
        return isinstance(size, sympy.Expr) and tok in size.free_symbols

    try:
        groups = view_groups(ishape, oshape)
    except ValueError:
        return None
    for ins, outs in groups:
        if d not in ins:
            continue
        big_in = [k for k in ins if not same(ishape[k], 1)]
        big_out = [k for k in outs if not same(oshape[k], 1)]
        if not has_tok(ishape[d]) or not big_in or big_in[-1] != d or not big_out or not has_tok(oshape[big_out[-1]]):
            return None
        return Shard(big_out[-1])
    return None


def _cur(info: OpInfo, i: int = 0):
    return info.current[i] if len(info.current) > i else R


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
      aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int)
def view(info: OpInfo) -> list[Strategy]:
    ishape, oshape = info.inputs[0].shape, info.outputs[0].shape
    squeezed = _squeezed_dims(info)
    out = []
    for p in {_cur(info), *[Shard(d) for d in range(len(ishape))]}:
        if isinstance(p, Shard | BlockShard) and p.dim % len(ishape) in squeezed:
            size = ishape[p.dim % len(ishape)]
            if not (isinstance(size, int) and size // info.n > 1):  # a local piece of size 1 would be squeezed
                if p == _cur(info):
                    info.notes.append(f"squeezing dim {p.dim} (size {size}) sharded over {info.n}: "
                                      "a local piece may have size 1 and would be squeezed")
                continue
        if info.token_symbol is not None and isinstance(p, Shard):
            q = map_token_view(p, ishape, oshape, info.token_symbol)
        else:
            q = map_view_placement(p, ishape, oshape, info.n, info.notes if p == _cur(info) else None)
        if q is not None and not isinstance(p, Replicate):
            out.append(Strategy((p,), (q,), name="view"))
    out.sort(key=lambda s: s.inputs[0] != _cur(info))  # the current placement first
    return out + [Strategy((Partial(),), (Partial(),), name="partial"), Strategy((R,), (R,), name="replicate")]


def _squeezed_dims(info: OpInfo) -> set[int]:
    """The dims a squeeze removes where they have size 1 -- on local pieces too, where a sharded dim
    of global size n has size 1 although the global op keeps it."""
    nd = info.inputs[0].ndim
    if info.op is aten.squeeze.default:
        return set(range(nd))
    if info.op is aten.squeeze.dim:
        return {norm_dim(info.arg(1), nd)}
    if info.op is aten.squeeze.dims:
        return {norm_dim(d, nd) for d in info.arg(1)}
    return set()


def _local_shape_args(args, local_shape, idx=1):
    args = list(args)
    orig = list(args[idx])
    new = []
    for k, s in enumerate(local_shape):
        new.append(-1 if k < len(orig) and isinstance(orig[k], int) and orig[k] == -1 and not isinstance(s, int)
                   else s)
    args[idx] = new
    return tuple(args)


@localizer(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view_local(args, kwargs, in_p, out_p, local_shapes, n):
    return _local_shape_args(args, local_shapes[0]), kwargs


@localizer(aten.unflatten.int)
def _unflatten_local(args, kwargs, in_p, out_p, local_shapes, n):
    # unflatten(x, dim, sizes): the sizes are those of the output dims dim .. dim + len(sizes) - 1
    k = len(args[2])
    dim = args[1] % (len(local_shapes[0]) - k + 1)
    return _local_shape_args(args, local_shapes[0][dim:dim + k], idx=2), kwargs


@localizer(aten.expand.default)
def _expand_local(args, kwargs, in_p, out_p, local_shapes, n):
    return _local_shape_args(args, local_shapes[0]), kwargs


def _perm_rule(info: OpInfo, perm: list[int]) -> list[Strategy]:
    """Output dim k is input dim perm[k]."""
    out = []
    inv = {src: k for k, src in enumerate(perm)}
    cur = _cur(info)
    cands = [cur] + [Shard(d) for d in range(info.inputs[0].ndim)]
    for p in cands:
        if isinstance(p, Shard) or isinstance(p, BlockShard):
            d = p.dim % info.inputs[0].ndim
            q = BlockShard(inv[d], p.blocks) if isinstance(p, BlockShard) else Shard(inv[d])
            s = Strategy((p,), (q,), name="permute")
            if s not in out:
                out.append(s)
    return out + [Strategy((Partial(),), (Partial(),), name="partial"), Strategy((R,), (R,), name="replicate")]


@rule(aten.transpose.int)
def transpose(info: OpInfo) -> list[Strategy]:
    nd = info.inputs[0].ndim
    a, b = norm_dim(info.arg(1), nd), norm_dim(info.arg(2), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _perm_rule(info, perm)


@rule(aten.t.default, aten.numpy_T.default)
def t(info: OpInfo) -> list[Strategy]:
    """``x.t()`` and ``x.T`` (``numpy_T``: every dim reversed, at any rank; Falcon's ``input @ weight.T``)."""
    return _perm_rule(info, list(reversed(range(info.inputs[0].ndim))))


@rule(aten.permute.default)
def permute(info: OpInfo) -> list[Strategy]:
    nd = info.inputs[0].ndim
    return _perm_rule(info, [norm_dim(d, nd) for d in info.arg(1)])


@rule(aten.expand.default)
def expand(info: OpInfo) -> list[Strategy]:
    i, o = info.inputs[0], info.outputs[0]
    off = o.ndim - i.ndim
    out = []
    for d in range(i.ndim):
        if not same(i.shape[d], 1) or same(o.shape[d + off], 1):
            out.append(Strategy((Shard(d),), (Shard(d + off),), name="expand"))
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    # a replicated value broadcast along a new or size-1 static dim (a key shared by every head: MLA's
    # decoupled RoPE key; a mask over heads) can come out sharded on it at no cost: each rank keeps its part.
    # Only for a value attention reads: a broadcast read whole (an MoE router's group mask over its experts,
    # on the way to a top-k) would come out split at no cost here and be gathered by its next op.
    bcast = [Strategy((R,), (Shard(d),), name="expand_broadcast") for d in range(o.ndim)
             if (d < off or same(i.shape[d - off], 1)) and isinstance(o.shape[d], int) and o.shape[d] > 1
             and o.shape[d] % info.n == 0] if info.node is None or _read_by_attention(info.node) else []
    return out + [Strategy((Partial(),), (Partial(),), name="partial")] + bcast + [
        Strategy((R,), (R,), name="replicate")]


_STOP = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.embedding.default, aten.topk.default,
         aten.sort.default, aten.argmax.default}
_ATTENTION = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_efficient_attention.default}


def _read_by_attention(node, depth: int = 12) -> bool:
    """Whether attention reads ``node``'s value through ops short of a projection (at most ``depth`` of them):
    an SDPA, or a product of two computed values (``q @ k.transpose(-1, -2)``, ``probs @ v``)."""
    todo, seen = [(node, 0)], set()
    while todo:
        cur, d = todo.pop()
        for u in cur.users:
            if u in seen or u.op != "call_function" or d > depth or u.target in _STOP:
                continue
            seen.add(u)
            if u.target in _ATTENTION or (u.target in (aten.matmul.default, aten.bmm.default) and all(
                    a.op == "call_function" for a in u.all_input_nodes)):
                return True
            todo.append((u, d + 1))
    return False


def _keep_other_dims(info: OpInfo, dim: int, out_dim_of=lambda d: d, n_out: int = 1) -> list[Strategy]:
    out = []
    for d in range(info.inputs[0].ndim):
        if d == dim:
            continue
        od = out_dim_of(d)
        if od is not None:
            out.append(Strategy((Shard(d),), tuple(Shard(od) for _ in range(n_out)), name="other_dim"))
    cur = _cur(info)
    if isinstance(cur, BlockShard) and cur.dim % info.inputs[0].ndim != dim and \
            out_dim_of(cur.dim % info.inputs[0].ndim) is not None:
        # blocks of another dim stay blocks (a causal conv's output cut to the sequence, channels as blocks)
        od = out_dim_of(cur.dim % info.inputs[0].ndim)
        out.append(Strategy((cur,), tuple(BlockShard(od, cur.blocks) for _ in range(n_out)), name="other_dim_blocks"))
    out.sort(key=lambda s: s.inputs[0] != cur)
    P = Partial()
    return out + [Strategy((P,), tuple(P for _ in range(n_out)), name="partial"),
                  Strategy((R,), tuple(R for _ in range(n_out)), name="replicate")]


@rule(aten.repeat_interleave.self_int)
def repeat_interleave(info: OpInfo) -> list[Strategy]:
    """``repeat_interleave(x, r, dim)`` repeats each element of ``dim`` r times in place (GQA's key/value heads
    repeated for their query heads): a rank's share of ``dim`` repeated is its share of the result, so every
    dim may stay sharded, the repeated one too. Without ``dim`` the input is flattened first: replicated."""
    dim = info.arg(2, "dim", None)
    if dim is None or not isinstance(info.arg(1), int):
        return [Strategy((R,), (R,), name="replicate")]
    out = [Strategy((Shard(d),), (Shard(d),), name="same_dim") for d in range(info.inputs[0].ndim)]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    d = norm_dim(dim, info.inputs[0].ndim)
    if same(info.inputs[0].shape[d], 1) and divisible(info.arg(1), info.n):
        # one group repeated for every head (Mamba-2's B and C with n_groups = 1): each rank repeats the whole
        # group for its own heads, r / n times, as expand splits a broadcast (its gradient: the ranks' sum)
        out.append(Strategy((R,), (Shard(d),), name="one_group"))
    return out + [Strategy((Partial(),), (Partial(),), name="partial"), Strategy((R,), (R,), name="replicate")]


@localizer(aten.repeat_interleave.self_int)
def _repeat_interleave_local(args, kwargs, in_p, out_p, local_shapes, n):
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is None:  # flattened first: replicated
        return args, kwargs
    for ins, o, size in zip(in_p, out_p, n):
        if isinstance(o, Shard) and ins is not None and isinstance(ins[0], Replicate):  # one_group: r / n a rank
            args = (args[0], args[1] // size, *args[2:])
    if kwargs.get("output_size") is not None:  # the result's size along dim, of the local piece
        kwargs = dict(kwargs, output_size=local_shapes[0][dim % len(local_shapes[0])])
    return args, kwargs


@rule(aten.slice.Tensor)
def slice_(info: OpInfo) -> list[Strategy]:
    """Other dims stay sharded. A slice that cuts exactly one block out of a ``BlockShard`` dim (Phi-3's
    ``qkv[..., :q_size]``) is that block's plain ``Shard``: each rank slices its share of the block
    (the localizer below moves the bounds)."""
    x = info.inputs[0]
    dim = norm_dim(info.arg(1, "dim", 0), x.ndim)
    out = _keep_other_dims(info, dim)
    cur = _cur(info)
    if isinstance(cur, BlockShard) and cur.dim % x.ndim == dim and isinstance(x.shape[dim], int):
        start, end, step = info.arg(2, "start", None), info.arg(3, "end", None), info.arg(4, "step", 1)
        n = x.shape[dim]
        bounds, at = [], 0
        for size in cur.sizes(n):
            bounds.append((at, at + size))
            at += size
        start = 0 if start is None else start
        end = n if end is None or (isinstance(end, int) and end >= n) else end
        if step == 1 and (start, end) in bounds and all(divisible(b - a, info.n) for a, b in bounds):
            out.insert(0, Strategy((cur,), (Shard(dim),), name="slice_block"))
    return out


@localizer(aten.slice.Tensor)
def _slice_local(args, kwargs, in_p, out_p, local_shapes, n):
    """A block cut out of a ``BlockShard`` dim: on a rank's piece every block is 1/n as long, so the bounds
    are the global ones over n (the last block's end may be the int64 maximum: kept)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    args = list(args)
    for ins, o, size in zip(in_p, out_p, n):
        nd = len(local_shapes[0])
        if (isinstance(o, Shard) and o.dim % nd == dim % nd and ins is not None and isinstance(ins[0], BlockShard)
                and len(args) > 3):
            args[2] = (args[2] or 0) // size
            if args[3] < 2**62:
                args[3] //= size
    return tuple(args), kwargs


@rule(aten.select.int)
def select(info: OpInfo) -> list[Strategy]:
    dim = norm_dim(info.arg(1), info.inputs[0].ndim)
    return _keep_other_dims(info, dim, lambda d: d if d < dim else d - 1)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
def split(info: OpInfo) -> list[Strategy]:
    """Any dim but the split one may stay sharded; a fused ``[q | k | v]`` dim held as
    ``BlockShard(dim, k)`` splits into k plain shards. ``chunk(x, k, dim)`` needs no localizer: on local
    pieces of a blocked dim (k*m/n) it still cuts k chunks of m/n, and other dims do not change it."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(2, "dim", 0) if info.op is not aten.unbind.int else info.arg(1, "dim", 0), nd)
    k = len(info.outputs)
    unbind = info.op is aten.unbind.int
    out = _keep_other_dims(info, dim, (lambda d: d if d < dim else d - 1) if unbind else (lambda d: d), k)
    cur = _cur(info)
    sizes = [o.shape[dim] for o in info.outputs] if not unbind else []
    if (isinstance(cur, BlockShard) and cur.dim % nd == dim and cur.count == k and not unbind
            and all(divisible(s, info.n) for s in sizes) and _at_block_bounds(cur, info.inputs[0].shape[dim], sizes)):
        out.insert(0, Strategy((cur,), tuple(Shard(dim) for _ in range(k)), name="split_blocks"))
    elif isinstance(cur, BlockShard) and cur.dim % nd == dim and not unbind and cur.count > k:
        parts = _block_groups(cur, dim, info.inputs[0].shape[dim], sizes, info.n)
        if parts is not None:
            out.insert(0, Strategy((cur,), tuple(parts), name="split_block_groups"))
    return out


def _block_groups(p: BlockShard, dim: int, n, sizes, size: int):
    """The pieces' placements where pieces of ``sizes`` are runs of ``p``'s blocks (Mamba-2's in_proj held as
    [z | x | B | C | dt] cut into z, x | B | C and dt): a piece of one block a ``Shard``, of several the
    ``BlockShard`` of those blocks; None where a piece cuts a block or a block does not divide by ``size``."""
    if not isinstance(n, int) or not all(isinstance(s, int) for s in sizes) or not p.divides(n, size):
        return None
    blocks, out, at = p.sizes(n), [], 0
    for s in sizes:
        run, total = [], 0
        while total < s and at < len(blocks):
            run.append(blocks[at])
            total += blocks[at]
            at += 1
        if total != s or not all(b % size == 0 for b in run):
            return None
        out.append(Shard(dim) if len(run) == 1 else BlockShard(dim, tuple(run)))
    return out if at == len(blocks) else None


def _at_block_bounds(p: BlockShard, n, sizes) -> bool:
    """Whether pieces of ``sizes`` (in order) are the blocks of ``p`` in a dim of ``n`` elements."""
    if isinstance(p.blocks, int):
        return all(same(s, sizes[0]) for s in sizes)
    return isinstance(n, int) and all(isinstance(s, int) for s in sizes) and p.sizes(n) == list(sizes)


@localizer(aten.split.Tensor)
def _split_local(args, kwargs, in_p, out_p, local_shapes, n):
    args = list(args)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    args[1] = local_shapes[0][dim % len(local_shapes[0])]
    return tuple(args), kwargs


@localizer(aten.split_with_sizes.default)
def _split_sizes_local(args, kwargs, in_p, out_p, local_shapes, n):
    args = list(args)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    args[1] = [s[dim % len(s)] for s in local_shapes]
    return tuple(args), kwargs


@rule(aten.tensor_split.indices, aten.tensor_split.sections)
def tensor_split(info: OpInfo) -> list[Strategy]:
    """``tensor_split(x, indices_or_sections, dim)`` (HF Mamba's ``[gate | x | B | C | dt]`` cut): like
    ``split`` any other dim may stay sharded; the cut positions refer to ``dim`` alone, so they need no
    rewriting on local pieces."""
    dim = norm_dim(info.arg(2, "dim", 0), info.inputs[0].ndim)
    return _keep_other_dims(info, dim, n_out=len(info.outputs))


@rule(aten.cat.default, aten.concatenate.default, aten.concat.default)
def cat(info: OpInfo) -> list[Strategy]:
    o = info.outputs[0]
    dim = norm_dim(info.arg(1, "dim", 0), o.ndim)
    k = len(info.inputs)
    # legacy cat skips 1-D empty tensors (an empty KV cache): they stay replicated
    empty = [t.ndim == 1 and same(t.shape[0], 0) for t in info.inputs]
    out = []
    for d in range(o.ndim):
        if d != dim:
            out.append(Strategy(tuple(R if e else Shard(d) for e in empty), (Shard(d),), name="other_dim"))
    # parts projected apart, each split over the axis on the cat dim, joined along it and cut apart into the same
    # parts later (BailingHybrid's separate q, k, v projections concatenated for one depthwise conv): each rank's
    # pieces joined are its share of every part, the blocks of a fused projection's output (BlockShard, part
    # sizes), which the ops on the way keep and the cut makes plain shards again (channels.cut_apart; a
    # block layout read by anything else, a linear, could only be gathered whole, and nothing gathers blocks)
    sizes = [] if any(empty) else [t.shape[dim] for t in info.inputs]
    if k >= 2 and sizes and all(isinstance(s, int) and s > 0 for s in sizes) and info.node is not None:
        from mcompile.sharding.channels import cut_apart

        if not cut_apart(info.node, dim, sizes):
            sizes = []
    if k >= 2 and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        blocks = BlockShard(dim, tuple(sizes))
        if blocks.divides(sum(sizes), info.n):
            out.append(Strategy(tuple(Shard(dim) for _ in range(k)), (blocks,), name="blocks"))
    cur = info.current
    blk = cur[0] if cur and not any(empty) else None
    if isinstance(blk, BlockShard) and blk.dim % o.ndim != dim and all(c == blk for c in cur):
        # blocks of another dim (DiffLlama's head pairs, RoPE's halves joined along head_dim): kept, as a Shard is
        out.append(Strategy(tuple(cur), (BlockShard(blk.dim % o.ndim, blk.blocks),), name="other_dim_blocks"))
    out.sort(key=lambda s: tuple(s.inputs) != tuple(cur))
    P = Partial()
    return out + [Strategy(tuple(P for _ in range(k)), (P,), name="partial"),
                  Strategy(tuple(R for _ in range(k)), (R,), name="replicate")]


def _shape_of_other(info: OpInfo, rule_fn) -> list[Strategy]:
    """``x.view_as(other)`` / ``reshape_as`` / ``expand_as``: the view / expand rule for x with the output
    shape, which is ``other``'s. ``other`` lends only its shape, read from its local piece, so it must be
    split like the output (a Shard / BlockShard where the output has one, else whole): its local piece then
    has the output's local shape and the op needs no rewriting."""
    strategies = rule_fn(replace(info, inputs=info.inputs[:1], current=tuple(info.current[:1])))
    out = []
    for s in strategies:
        q = s.outputs[0]
        other = q if isinstance(q, Shard | BlockShard) else R
        # a whole x broadcast along other's split dim (XLM's mask expanded to the head-split scores): each rank
        # keeps its part at no cost, where a whole output would need other gathered just for its shape. Not
        # named expand_broadcast, which the propagator keeps off input-only values (their consumers slice)
        name = "expand_as_broadcast" if s.name == "expand_broadcast" else s.name
        out.append(Strategy((s.inputs[0], other), s.outputs, s.lowering, name))
    return out


@rule(aten.view_as.default, aten.reshape_as.default)
def view_as(info: OpInfo) -> list[Strategy]:
    return _shape_of_other(info, view)


@rule(aten.expand_as.default)
def expand_as(info: OpInfo) -> list[Strategy]:
    return _shape_of_other(info, expand)


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def view_as_complex(info: OpInfo) -> list[Strategy]:
    """``view_as_complex`` reads the last dim (of size 2) as (real, imaginary); ``view_as_real`` makes it
    (rotary embeddings as complex products: DeepSeek-V2, Llama 4). Every other dim may stay sharded. No
    Partial: a complex partial sum would need complex collectives."""
    nd = info.inputs[0].ndim - (1 if info.op is aten.view_as_complex.default else 0)
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd)]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad(info: OpInfo) -> list[Strategy]:
    """A dim the pad leaves alone may stay sharded: one before the last ``len(pad) // 2`` dims, or one of those
    whose pair is (0, 0) (HF's Mamba-2 scan pads only the sequence of a (b, s, heads, head_dim) value:
    ``(0, 0, 0, 0, 0, p, 0, 0)``, so its heads stay split)."""
    nd = info.inputs[0].ndim
    pads = list(info.arg(1))
    untouched = [d for d in range(nd) if d < nd - len(pads) // 2 or all(
        isinstance(v, int) and v == 0 for v in pads[2 * (nd - 1 - d):2 * (nd - 1 - d) + 2])]
    out = []
    for d in untouched:
        out.append(Strategy((Shard(d),), (Shard(d),), name="other_dim"))
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten.im2col.default)
def im2col(info: OpInfo) -> list[Strategy]:
    """``im2col(x, kernel, dilation, padding, stride)`` (``F.unfold``; ConvBERT's span-based convolution):
    ``(N, C, H, W) -> (N, C*kh*kw, L)``. Each channel's patches are a contiguous run of kh*kw rows, so a
    shard of the channels is the same shard of the rows; the batch stays the batch. Linear: Partial stays."""
    nd = info.inputs[0].ndim
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd - 2)]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((Partial(),), (Partial(),), name="partial"), Strategy((R,), (R,), name="replicate")]


@rule(aten.unfold.default)
def unfold(info: OpInfo) -> list[Strategy]:
    """``x.unfold(dim, size, step)``: dim becomes the count of windows, ``(x.shape[dim] - size) // step + 1``,
    and a new last dim holds each window's ``size`` elements (Inkling-2's causal conv gathers its kernel's
    windows over the sequence this way). A window may cross a shard's boundary, so the unfolded dim stays
    whole; every other dim keeps its index and its shard (the channels of a depthwise conv). A view:
    Partial stays."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1, "dimension"), max(nd, 1))
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd) if d != dim]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((Partial(),), (Partial(),), name="partial"), Strategy((R,), (R,), name="replicate")]


@rule(aten.index.Tensor)
def index(info: OpInfo) -> list[Strategy]:
    """``x[i0, i1, ...]`` with leading index tensors: a trailing, unindexed dim of ``x`` may stay sharded."""
    indices = info.arg(1)
    n_idx = len(info.inputs) - 1
    # dims of x the indices consume: one per integer index, a boolean mask as many as it has dims
    k = sum(m.ndim if m.dtype in (torch.bool, torch.uint8) else 1 for m in info.inputs[1:])
    out_nd = info.outputs[0].ndim
    s = []
    if all(i is not None for i in indices):
        x_nd = info.inputs[0].ndim
        for d in range(k, x_nd):
            s.append(Strategy((Shard(d),) + (R,) * n_idx, (Shard(out_nd - (x_nd - d)),), name="other_dim"))
    # the current placement first, whole included: a whole table's rows stay whole (Ergo's per-expert norm scales
    # weight[expert_ids], multiplied into a whole activation); split, they would be gathered back
    s.append(Strategy((R,) * len(info.inputs), (R,), name="replicate"))
    s.sort(key=lambda st: st.inputs[0] != _cur(info))
    return s


@rule(aten.gather.default)
def gather(info: OpInfo) -> list[Strategy]:
    """``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``dim``: a dim other than ``dim`` may be
    sharded on both (positions pair up when the two sizes are equal); ``index`` sharded along ``dim``
    reads a whole ``x`` (each output position looks up any row). ``sparse_grad`` only picks the
    gradient's layout: carried as it is."""
    x, idx = info.inputs[0], info.inputs[1]
    dim = norm_dim(info.arg(1), x.ndim)
    s = [Strategy((Shard(d), Shard(d)), (Shard(d),), name="other_dim")
         for d in range(x.ndim) if d != dim and same(x.shape[d], idx.shape[d])]
    s.append(Strategy((R, Shard(dim)), (Shard(dim),), name="index_dim"))
    s.sort(key=lambda st: st.inputs[0] != _cur(info))
    return s + [Strategy((R, R), (R,), name="replicate")]


@rule(aten.index_select.default)
def index_select(info: OpInfo) -> list[Strategy]:
    """``x.index_select(dim, index)``: any other dim of ``x`` may stay sharded; a sharded ``index`` reads
    a whole ``x`` and shards the output along ``dim``."""
    x = info.inputs[0]
    dim = norm_dim(info.arg(1), x.ndim)
    s = [Strategy((Shard(d), R), (Shard(d),), name="other_dim") for d in range(x.ndim) if d != dim]
    s.sort(key=lambda st: st.inputs[0] != _cur(info))
    return s + [Strategy((R, Shard(0)), (Shard(dim),), name="index_dim"), Strategy((R, R), (R,), name="replicate")]


@rule(aten.tril.default, aten.triu.default)
def triangle(info: OpInfo) -> list[Strategy]:
    """``tril`` / ``triu`` keep or zero by (row, column) position in the last two dims: a leading dim may
    be sharded; ``diagonal`` is carried as it is. Linear, so a Partial sum stays one."""
    nd = info.inputs[0].ndim
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd - 2)]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if info.outputs[0].dtype.is_floating_point:
        out.append(Strategy((Partial(),), (Partial(),), name="partial"))
    return out + [Strategy((R,), (R,), name="replicate")]
