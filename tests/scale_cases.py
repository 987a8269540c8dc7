"""Worker functions for tests/test_scale.py (module level: they run in the gloo worker pool)."""

from __future__ import annotations

import torch

from mcompile.runtime.pipeline import MessageSpec, PipelineExecutor
from mcompile.runtime.schedules import build_schedule


class _Stage:
    """A stage that computes nothing: forward returns a (4,) activation, backward zero gradients."""

    splits_weight = False

    def __init__(self, last: bool):
        self.last = last

    def forward(self, mb, inputs):
        return torch.full((), float(mb)) if self.last else (torch.full((4,), float(mb)),)

    def backward(self, mb, outputs, grads, received):
        return [torch.zeros(4) for _ in received]

    def backward_weight(self, mb):
        pass


class _KeepSends(PipelineExecutor):
    """The executor before sends were released on completion: every send held to the step's end."""

    def _release_sent(self) -> None:
        pass


def held_sends(rank, world, schedule, m, keep):
    """Peak send buffers held by this rank over one step (keep: the previous behaviour)."""
    k = world
    actions = build_schedule(schedule, world, 1, m)
    stages = {s: _Stage(s == k - 1) for s in range(k) if s % world == rank}
    specs = {s: [MessageSpec((4,), torch.float32, True)] for s in range(k - 1)}
    cls = _KeepSends if keep else PipelineExecutor
    ex = cls(rank=rank, pp_rank=rank, num_stages=k, actions=actions, microbatches=m,
             peer_of_stage=lambda s: s % world, stages=stages, send_specs=specs)
    torch.distributed.barrier()
    ex.run(torch.device("cpu"))
    return ex.peak_held_sends


class _Logits(torch.nn.Module):
    """Returns the mean square of its logits: a scalar that is not a token-weighted loss, so a
    pipelined forward broadcasts it as the model's output (the pipeline's last stage needs one scalar
    to run backward from; a model returning more does not pipeline)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.l1 = torch.nn.Linear(16, 16)
        self.l2 = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.l2(torch.relu(self.l1(self.emb(tokens))))
        logits = self.head(h)
        return logits.float().pow(2).mean()


def pipe_forward_outputs(rank, world, mesh, opts):
    """pm(tokens) under pp: every rank's outputs, and the single-device ones."""
    import mcompile as mc

    torch.manual_seed(0)
    model = _Logits()
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens,), **opts)
    out = pm(tokens)
    with torch.no_grad():
        ref = model(tokens)
    return out.clone(), ref.clone()


def derived_lists(rank, world, name, mesh, opts, fake_run=False):
    """After one train step: the op lists this rank derived for every member of its pipeline group, the stages
    it traced (built a joint runner for), the stages it owns and the collectives its own stage's forward and
    backward modules run per microbatch (counted on the built modules). ``fake_run``: the probe records the
    stage's collectives by running its modules on fake tensors instead of reading their graphs."""
    import mcompile as mc
    from mcompile.runtime import pipeline as P

    from conftest import build

    model, inputs = build(name, batch=4)
    read, unread = P.graph_collectives, []
    if fake_run:  # the stage's collectives recorded from a fake run of its modules, not read from their graphs
        P.graph_collectives = lambda module: None
    else:  # which modules' graphs could not be read (the probe falls back to a fake run for those)
        P.graph_collectives = lambda module: (lambda got: unread.append(got is None) or got)(read(module))
    try:
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **opts)
        pm.train_step(*inputs)
    finally:
        P.graph_collectives = read
    from mcompile.runtime.pipeline import _COMM_OPS

    def comm(m):  # the communicating nodes of a built module (eager: a GraphModule; codegen: its .gm)
        return sum(n.op == "call_function" and getattr(n.target, "namespace", None) == "mcompile"
                   and n.target._opname in _COMM_OPS for n in getattr(m, "gm", m).graph.nodes)

    jp = pm._pipe.runners[pm._pipe.own[0]].last
    built = comm(jp.forward) + comm(jp.backward)
    return pm._pipe.derived_ops, sorted(pm._pipe.runners), pm._pipe.own, built, any(unread)


def seeded_collective_mismatch(rank, world, seed_rank, seed_op):
    """Hand-made collective lists over the world group, rank ``seed_rank``'s op #``seed_op`` of another
    shape (seed_rank=None: all equal). Returns (the error text or None, whether lists were gathered)."""
    import torch.distributed as dist

    from mcompile.runtime import verify as V

    group = tuple(range(world))
    mine = [V.CommOp("coll", f"all_reduce {i}", (4, 8 if (rank, i) == (seed_rank, seed_op) else 4),
                     "torch.float32", group=group, axis="tp") for i in range(5)]
    gathered = []
    real = dist.all_gather_object

    def counting(*a, **k):
        gathered.append(1)
        return real(*a, **k)

    dist.all_gather_object = counting
    try:
        err = V.check_collectives_across(mine, [(dist.group.WORLD, group)])
    finally:
        dist.all_gather_object = real
    return (None if err is None else str(err)), bool(gathered)


def seeded_derived_mismatch(rank, world, where):
    """Two pipeline ranks deriving lists: ``where`` = "peer" (rank 1 derives rank 0's list wrongly: the
    lists each rank runs match) or "own" (rank 1's own step differs) or None."""
    import torch.distributed as dist

    from mcompile.runtime import verify as V

    def lst(r, extra):
        peer = 1 - r
        return [V.CommOp("send" if r == 0 else "recv", "act 0->1 mb0 #0", (4,), "torch.float32", peer=peer,
                         comm=("direction", 0, 1)),
                V.CommOp("coll", "broadcast loss", (2 + extra,), "torch.float32", group=(0, 1), axis="pp")]

    derived = {0: lst(0, 0), 1: lst(1, 0)}
    if rank == 1 and where == "peer":
        derived[0] = lst(0, 1)
    if where == "own":  # rank 1's own step has another loss shape (everyone derived it so, but rank 1 runs it)
        if rank == 1:
            derived[1] = lst(1, 1)
    err = V.check_derived_across(rank, derived, dist.group.WORLD, (0, 1))
    return None if err is None else str(err)


def full_state_to_one_rank(rank, world, name, mesh, opts):
    """After one train step: full_state_dict / full_grads on every rank, then with rank=0 and with
    rank=world-1 (a rank that owns no pipeline-shared tensor), and the devices of what came back."""
    import mcompile as mc

    from conftest import build

    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **opts)
    pm.train_step(*inputs)
    out = {"state": pm.full_state_dict(), "grads": pm.full_grads()}
    for r in (0, world - 1):
        out[f"state@{r}"] = pm.full_state_dict(rank=r)
        out[f"grads@{r}"] = pm.full_grads(rank=r)
    out["devices"] = sorted({str(t.device) for d in out.values() for t in d.values()})
    return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in out.items()}


def one_rank_fails_to_trace(rank, world, name, mesh, opts, failing):
    """Rank ``failing`` cannot trace its stages (its loss hook raises inside the fake run): every rank
    must raise, none may wait in the verification's exchanges. Returns each rank's error."""
    import mcompile as mc

    from conftest import build

    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **opts)
    if rank == failing:
        def broken(out):
            raise RuntimeError("the last stage returned no scalar loss")
        pm._loss_parts = broken
    try:
        pm.train_step(*inputs)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return None
