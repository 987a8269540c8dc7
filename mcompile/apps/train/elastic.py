"""Multi-node launch and elastic re-planning for ``mcompile train``.

**Nodes.** ``mcompile train`` starts one torch elastic agent per node (the agent ``torchrun`` runs); the
agents meet at a c10d rendezvous (``--rdzv-endpoint HOST:PORT``, ``--rdzv-id``), whose key-value store
the agent of node rank 0 hosts, and each starts ``nproc`` processes. :func:`resolve_nodes` decides the
launch from, in order: the command line, the config's ``[launch]`` table, Slurm's environment
(``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_ID``, ``MASTER_ADDR`` or the first host of
``SLURM_JOB_NODELIST``; a job step's own ``SLURM_STEP_*`` first), then one node on this machine.

**Elastic re-planning.** ``--nnodes MIN:MAX`` lets the run go on with fewer nodes after one is lost (torch
elastic's ``min_nodes``: the agents that remain meet again and restart their processes). The layout is
re-planned for the smaller world by one rule, Megatron's (its data-parallel size is always
``world / (tp x pp x cp)``): every axis but dp keeps its size and

    dp' = world / (tp x pp x cp x ep)

The global batch stays (the learning-rate schedule, the data order and the loss are those of the full
run) and so does the microbatch size ``b = global_batch / (dp x microbatches)`` (the activation memory of
a rank): the microbatches per rank grow to ``m' = global_batch / (dp' x b)``. Where evaluation runs without
pipeline parallelism (``pm.forward`` takes the local batch at once, so it needs ``m = 1``) the microbatches
stay and each grows instead. A world that tp x pp x cp x ep does not divide, or a global batch that
dp' (x b) does not divide, cannot be re-planned: :func:`replan` says so, and the launcher checks every node
count of MIN..MAX before a process starts.

Nothing here imports torch: launch errors answer at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mcompile.apps.train.config import ConfigError, mesh_size, parse_nnodes  # noqa: F401  (parse_nnodes: re-exported)

__all__ = ["Nodes", "parse_nnodes", "first_slurm_host", "resolve_nodes", "nproc_per_node", "replan", "fit_world",
           "eval_needs_one", "DEFAULT_PORT"]

DEFAULT_PORT = 29500  # torchrun's default rendezvous port


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """How many nodes a launch spans and how they meet. ``endpoint`` None: one node on this machine (a
    private rendezvous on 127.0.0.1)."""

    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None  # None: not given (torch's c10d guesses which node hosts the store)
    endpoint: str | None = None  # "host:port" of the c10d rendezvous
    run_id: str = ""
    timeout: int = 600  # seconds for the nodes to join (and for this node to reach the endpoint)
    last_call: int = 30  # seconds a rendezvous with MIN (< MAX) nodes waits for more before it starts
    source: str = ""  # where the node settings came from, for messages ("command line", "Slurm", ...)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    @property
    def spec(self) -> str:
        """The ``--nnodes`` form: "N" or "MIN:MAX"."""
        return str(self.max_nodes) if not self.elastic else f"{self.min_nodes}:{self.max_nodes}"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"`` (zero padding kept)."""
    text = nodelist.strip()
    m = re.match(r"([^,\[]*)(\[([^\]]*)\])?", text)
    if not m or not (m.group(1) or m.group(2)):
        raise ConfigError(f"SLURM_JOB_NODELIST = {nodelist!r} is not a host list: pass --rdzv-endpoint HOST:PORT")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    return prefix + first


def _endpoint(text: str, where: str) -> str:
    host, colon, port = text.strip().rpartition(":")
    if not colon:
        host, port = text.strip(), str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where} = {text!r}: write HOST:PORT, e.g. node01:{DEFAULT_PORT}")
    return f"{host}:{int(port)}"


def resolve_nodes(launch, *, nnodes: str | None = None, node_rank: int | None = None, endpoint: str | None = None,
                  run_id: str | None = None, timeout: int | None = None, last_call: int | None = None,
                  environ: dict | None = None) -> Nodes:
    """The launch's nodes: each setting from the command line (the keyword arguments), else the config's
    ``[launch]`` table (``launch``: its LaunchConfig), else Slurm's environment (``environ``), else one node."""
    import os

    env = os.environ if environ is None else environ
    slurm = "SLURM_JOB_ID" in env
    source = []

    def pick(given, configured, unset, slurm_value):
        if given is not None:
            source.append("command line")
            return given
        if configured != unset:
            source.append("config")
            return configured
        if slurm_value is not None:
            source.append("Slurm")
            return slurm_value
        return None

    step_nodes = (env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) if slurm else None
    spec = pick(nnodes, launch.nnodes, "", step_nodes)
    lo, hi = parse_nnodes(spec, "--nnodes" if nnodes is not None else
                          "launch.nnodes" if launch.nnodes else "SLURM_NNODES") if spec else (1, 1)
    rank = pick(node_rank, launch.node_rank, -1,
                int(env["SLURM_NODEID"]) if slurm and env.get("SLURM_NODEID", "").isdigit() else None)
    if rank is not None and not 0 <= rank < hi:
        raise ConfigError(f"node rank {rank} is outside the {hi} node(s) of --nnodes {spec}: give 0..{hi - 1}")
    if slurm and "SLURM_STEP_NUM_TASKS" in env and env.get("SLURM_STEP_NUM_NODES") and hi > 1 and \
            env["SLURM_STEP_NUM_TASKS"] != env["SLURM_STEP_NUM_NODES"]:
        raise ConfigError(f"this Slurm step runs {env['SLURM_STEP_NUM_TASKS']} tasks on "
                          f"{env['SLURM_STEP_NUM_NODES']} nodes, but mcompile train starts the processes of a node "
                          "itself: run one task per node (srun --ntasks-per-node=1)")
    slurm_endpoint = None
    if slurm:
        if env.get("MASTER_ADDR"):
            slurm_endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
        elif env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST"):
            slurm_endpoint = f"{first_slurm_host(env.get('SLURM_STEP_NODELIST') or env['SLURM_JOB_NODELIST'])}:" \
                             f"{DEFAULT_PORT}"
    where = "--rdzv-endpoint" if endpoint is not None else "launch.rdzv_endpoint"
    at = pick(endpoint, launch.rdzv_endpoint, "", slurm_endpoint if hi > 1 else None)
    at = _endpoint(at, where) if at else None
    if hi > 1 and at is None:
        raise ConfigError(f"--nnodes {spec} needs the rendezvous endpoint all nodes can reach: pass "
                          f"--rdzv-endpoint HOST:PORT (HOST: node 0's address; port {DEFAULT_PORT} is torchrun's "
                          "default), set launch.rdzv_endpoint, or run under Slurm")
    rid = pick(run_id, launch.rdzv_id, "", env.get("SLURM_JOB_ID") if slurm else None) or "mcompile"
    t = timeout if timeout is not None else launch.rdzv_timeout
    lc = last_call if last_call is not None else launch.rdzv_last_call
    for name, value in (("--rdzv-timeout", t), ("--rdzv-last-call", lc)):
        if value < 1:
            raise ConfigError(f"{name} = {value}: give a number of seconds >= 1")
    return Nodes(min_nodes=lo, max_nodes=hi, node_rank=rank, endpoint=at, run_id=str(rid), timeout=t,
                 last_call=lc, source=", ".join(dict.fromkeys(source)))


def nproc_per_node(mesh: str, nproc: int, nodes: Nodes, *, global_batch: int, microbatches: int,
                   eval_needs_one: bool) -> int:
    """The processes to start on each node: ``nproc`` where given, else the mesh's size over MAX nodes;
    checked against the mesh (MAX x nproc ranks are the full layout) and, for an elastic range, every node
    count MIN..MAX re-planned (:func:`replan`) before any process starts."""
    if mesh == "auto":
        if nproc < 1:
            raise ConfigError('parallel.mesh = "auto" needs the number of processes per node: pass --nproc N or '
                              "set launch.nproc")
        return nproc
    size = mesh_size(mesh)
    nodes_text = f"--nnodes {nodes.spec}" if nodes.max_nodes > 1 or nodes.elastic else "one node"
    if nproc < 1:
        if size % nodes.max_nodes:
            raise ConfigError(f"parallel.mesh = {mesh!r} has {size} ranks, which {nodes.max_nodes} nodes "
                              f"({nodes_text}) cannot share equally: give --nproc (processes per node) and a mesh of "
                              f"{nodes.max_nodes} x nproc ranks")
        nproc = size // nodes.max_nodes
    if nproc * nodes.max_nodes != size:
        per = f"{nodes.max_nodes} node(s) x {nproc} processes = {nodes.max_nodes * nproc}" if nodes.max_nodes > 1 \
            else f"{nproc} processes"
        raise ConfigError(f"parallel.mesh = {mesh!r} has {size} ranks but {nodes_text} runs {per}: make them "
                          f"equal (--nproc {size // nodes.max_nodes if size % nodes.max_nodes == 0 else 'N'} per "
                          "node, another --nnodes, or another mesh; or mesh = \"auto\")")
    for n in range(nodes.min_nodes, nodes.max_nodes):
        try:
            replan(mesh, microbatches, global_batch, n * nproc, eval_needs_one=eval_needs_one)
        except ConfigError as e:
            fits = [k for k in range(nodes.min_nodes, nodes.max_nodes + 1) if _fits(mesh, microbatches, global_batch,
                                                                                   k * nproc, eval_needs_one)]
            raise ConfigError(f"--nnodes {nodes.spec}: the run could not go on with {n} node(s): {e}. Use a "
                              f"range whose node counts all fit (these do: {', '.join(map(str, fits))})") from None
    return nproc


def _fits(mesh, microbatches, global_batch, world, eval_needs_one) -> bool:
    try:
        replan(mesh, microbatches, global_batch, world, eval_needs_one=eval_needs_one)
        return True
    except ConfigError:
        return False


def _axes(mesh: str) -> list[tuple[str, int]]:
    return [(name.strip(), int(size)) for name, _, size in (p.partition("=") for p in mesh.split(","))]


def replan(mesh: str, microbatches: int, global_batch: int, world: int, *, eval_needs_one: bool = False
           ) -> tuple[str, int]:
    """(mesh, microbatches) for ``world`` processes (module docstring): dp' = world / (the other axes), the
    global batch and the microbatch size kept. The mesh as given when it has ``world`` ranks."""
    axes = _axes(mesh)
    if math.prod(n for _, n in axes) == world:
        return mesh, microbatches
    others = math.prod(n for a, n in axes if a != "dp")
    kept = ",".join(f"{a}={n}" for a, n in axes if a != "dp") or "dp only"
    if world % others:
        verb = "processes do" if world != 1 else "process does"
        raise ConfigError(f"{world} {verb} not divide by {others} (= {kept}, the axes kept): parallel.mesh = "
                          f"{mesh!r} cannot be re-planned for {world}")
    dp, dp_new = dict(axes).get("dp", 1), world // others
    if global_batch % dp_new:
        raise ConfigError(f"train.global_batch = {global_batch} does not divide by dp={dp_new} ({world} processes / "
                          f"{others}): the run keeps its global batch, so it cannot go on at dp={dp_new}")
    m_new = microbatches
    if not eval_needs_one and global_batch % (dp * microbatches) == 0:
        b = global_batch // (dp * microbatches)  # the microbatch size the full run has
        if global_batch % (dp_new * b) == 0:
            m_new = global_batch // (dp_new * b)
    if global_batch % (dp_new * m_new):
        raise ConfigError(f"train.global_batch = {global_batch} does not divide by dp={dp_new} x microbatches="
                          f"{m_new}: the run cannot go on at dp={dp_new}")
    names = [a for a, _ in axes]
    sizes = {a: n for a, n in axes} | {"dp": dp_new}
    order = names if "dp" in names else ["dp", *names]  # dp first where the mesh did not name it (outermost)
    return ",".join(f"{a}={sizes[a]}" for a in order), m_new


def eval_needs_one(cfg) -> bool:
    """Whether evaluation needs parallel.microbatches = 1 (it runs pm.forward, which takes the local batch at once
    without pipeline parallelism): evaluation on and no pp axis over 1."""
    mesh = cfg.parallel.mesh.strip()
    return bool(cfg.eval.interval) and (mesh == "auto" or dict(_axes(mesh)).get("pp", 1) == 1)


def fit_world(cfg, world: int):
    """(cfg, note): the config for a world of ``world`` processes. Its own where the mesh has that many ranks (or is
    "auto"); re-planned (:func:`replan`; ``note`` says how) where ``launch.nnodes`` is a range MIN:MAX, i.e. the
    world may change between attempts; an error otherwise."""
    import dataclasses

    mesh = cfg.parallel.mesh.strip()
    if mesh == "auto" or mesh_size(mesh) == world:
        return cfg, None
    lo, hi = parse_nnodes(cfg.launch.nnodes, "launch.nnodes") if cfg.launch.nnodes else (1, 1)
    if lo == hi:
        raise ConfigError(f"parallel.mesh = {mesh!r} has {mesh_size(mesh)} ranks but the world has {world} processes: "
                          "make them equal, or for a run whose nodes may change set launch.nnodes = \"MIN:MAX\" "
                          "(mcompile train --nnodes MIN:MAX does): data parallelism is then re-planned for the world")
    try:
        new_mesh, m = replan(mesh, cfg.parallel.microbatches, cfg.train.global_batch, world,
                             eval_needs_one=eval_needs_one(cfg))
    except ConfigError as e:
        kept = f" in {cfg.checkpoint.dir}" if cfg.checkpoint.dir else ""
        raise ConfigError(f"{e}. The run stops here and its checkpoints{kept} are kept: resume them on a number of "
                          "nodes that fits") from None
    note = (f"re-planned for {world} processes (parallel.mesh = {mesh!r} has {mesh_size(mesh)}): mesh {new_mesh}, "
            f"microbatches {m} (was {cfg.parallel.microbatches}), global batch {cfg.train.global_batch} kept")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mesh=new_mesh, microbatches=m)), note
