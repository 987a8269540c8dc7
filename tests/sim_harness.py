"""Per-rank programs run together in one process (mcompile.runtime.sim): the single-device loss and
gradients from a compiled plan, without processes. Shared by tests/test_planner.py and
tests/test_op_args.py."""

from __future__ import annotations

from mcompile.ir.placements import Replicate, unshard_tensors
from mcompile.runtime.sim import ThreadedWorld, run_threads


def combine_grads(c, grads_per_rank, dp_mean: bool = True):
    """Full gradients from every rank's local ones, by the plan's placements and partial axes.
    ``dp_mean``: each dp rank's loss is its own batch mean (the dp ranks' gradients are averaged); False:
    the ranks' losses are sums (token-weighted, :func:`run_sim_token_weighted`), their gradients added."""
    mesh = c.mesh
    full = {}
    for fqn, pp in c.plan.params.items():
        ph = next(k for k, v in c.captured.params.items() if v == fqn)
        pieces = {r: grads_per_rank[r][ph] for r in range(mesh.size())}
        for ax, pl in reversed(list(zip(mesh.axis_names, pp.placements))):
            merged = {}
            for group in mesh.group_ranks(ax):
                vals = [pieces[r] for r in group]
                if isinstance(pl, Replicate):
                    out = sum(vals) if ax in pp.grad_partial_axes else vals[0]
                    if ax == "dp" and dp_mean:
                        out = out / len(vals)  # each dp rank's loss is its own batch mean
                else:
                    true = pp.shape[pl.dim % len(pp.shape)]
                    out = unshard_tensors(vals, pl, true_size=true)
                for r in group:
                    merged[r] = out
            pieces = merged
        full[fqn] = pieces[0]
    return full


def run_sim(c, inputs, backward: bool):
    world = ThreadedWorld(c.mesh)
    state = c.captured.state_values()
    dp = c.mesh.size("dp")

    def rank_fn(r):
        local = {k: v.detach().clone().requires_grad_(k in c.captured.params) for k, v in
                 c.local_state(r, state).items()}
        coords = c.mesh.coords(r)
        mine = tuple(t.chunk(dp)[coords.get("dp", 0)] for t in inputs)
        out = c.run_local(r, local, mine)
        # a token-weighted program returns (loss sum, count) (passes/loss.py): the mean is their ratio
        loss = out[0] / out[1] if len(out) == 2 else out[0]
        grads = None
        if backward:
            loss.backward()
            grads = {k: v.grad for k, v in local.items() if k in c.captured.params}
        return loss.detach(), grads, list(world_comm_logs.setdefault(r, []))

    world_comm_logs: dict = {}
    orig = world.communicator

    def communicator(r):
        comm = orig(r)
        world_comm_logs[r] = comm.log
        return comm

    world.communicator = communicator
    return run_threads(world, rank_fn)


def run_sim_token_weighted(c, inputs):
    """One training step of a plan compiled with ``token_weighted_loss=True`` (as ``parallelize`` does), with
    the runtime's loss convention (``ParallelModule.train_step``): each rank's program returns the loss sum and
    the target count of its own tokens (its slice of the batch over dp x ep, as the runtime splits it: the batch
    axes flattened in mesh order; its cp share of the sequence), backward runs on that sum, and the global mean
    divides by the count summed over the data axes (dp, ep, cp). A plan the plain :func:`run_sim` cannot check:
    under cp (and ep, whose experts see every rank's tokens) no rank's output is a mean of its own batch. A plan
    compiled without it (a model whose loss is its own mean, e.g. with MoE losses) counts each rank's piece once.
    (global mean loss, full gradients by FQN)."""
    import torch

    mesh = c.mesh
    world = ThreadedWorld(mesh)
    state = c.captured.state_values()
    batch_axes = [a for a in mesh.axis_names if a in ("dp", "ep")]

    def batch_slice(r):  # runtime/module.py's batch coordinate
        n, i = 1, 0
        for a in batch_axes:
            n, i = n * mesh.size(a), i * mesh.size(a) + mesh.coords(r)[a]
        return n, i

    def rank_fn(r):
        local = {k: v.detach().clone().requires_grad_(k in c.captured.params) for k, v in
                 c.local_state(r, state).items()}
        n, i = batch_slice(r)
        mine = tuple(t.chunk(n)[i] for t in inputs)
        out = c.run_local(r, local, mine)
        # a model's own mean loss (not token-weighted): the runtime counts each rank's piece once (_loss_parts)
        total, count = out if len(out) == 2 else (out[0], torch.ones(()))
        total.backward()
        return total.detach(), count.detach(), {k: v.grad for k, v in local.items() if k in c.captured.params}

    results = run_threads(world, rank_fn)
    # one rank per piece of the data: the others (tp) hold the same sum and count
    data = [r for r in range(mesh.size())
            if all(v == 0 for ax, v in mesh.coords(r).items() if ax not in ("dp", "ep", "cp"))]
    total = sum(results[r][0] for r in data)
    count = sum(results[r][1] for r in data)
    grads = combine_grads(c, [g for _, _, g in results], dp_mean=False)
    return total / count, {k: g / count for k, g in grads.items()}


def rank_args(c, r, inputs, state):
    """Rank ``r``'s program and its positional inputs for one step (parameters require grad; this
    rank's dp slice of ``inputs``)."""
    prog = c.program(r)
    local = {k: v.detach().clone().requires_grad_(k in c.captured.params) for k, v in c.local_state(r, state).items()}
    dp = c.mesh.size("dp")
    mine = tuple(t.chunk(dp)[c.mesh.coords(r).get("dp", 0)] for t in inputs)
    by = dict(zip(c.captured.user_inputs, mine))
    return prog, [local[n.name] if n.name in local else by[n.name] for n in prog.graph.nodes if n.op == "placeholder"]


def assert_sim_parity(c, model, inputs, label: str = ""):
    """The thread-simulated ranks of ``c`` give ``model``'s single-device loss and every gradient. fp32, another
    summation order over the pieces: ~1e-7 relative measured, so rtol 1e-5, with an atol of 1e-5 of a
    gradient's largest entry for entries near zero."""
    import torch

    model.zero_grad()
    ref_loss = model(*inputs)
    ref_loss.backward()
    ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    results = run_sim(c, inputs, backward=True)
    for loss, _, _ in results:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    full = combine_grads(c, [g for _, g, _ in results])
    assert set(ref) <= set(full)
    for fqn, want in ref.items():
        torch.testing.assert_close(full[fqn], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, fqn=fqn: f"{label} {fqn}: {m}")
