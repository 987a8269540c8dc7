"""``mcompile train CONFIG.toml [--set KEY=VALUE ...] [--nproc N] [--max-restarts R] [--nnodes N|MIN:MAX ...]``.

Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) every process runs the loop
directly. Otherwise this command starts the processes itself with torch.distributed's elastic
launcher (the agent torchrun runs): gloo on CPU, NCCL on GPUs, ``--nproc`` processes per node
(default: the mesh's ranks over the nodes), and after a failure of any process it restarts all of
them, up to ``--max-restarts`` / ``launch.max_restarts`` times; the restarted run resumes from the
newest complete checkpoint. On several nodes run it once per node with ``--nnodes``, ``--node-rank``
and ``--rdzv-endpoint`` (under Slurm they are read from its environment); ``--nnodes MIN:MAX`` goes
on with fewer nodes after one is lost, data parallelism re-planned (mcompile.apps.train.elastic).

``python -m mcompile.apps.train.cli CONFIG ...`` is the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import uuid

from mcompile.apps.train.config import ConfigError, load_config
from mcompile.apps.train.elastic import Nodes, eval_needs_one, nproc_per_node, resolve_nodes

__all__ = ["add_parser", "run", "main"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's TOML config (examples/train/llama3-tiny.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config key, value in TOML syntax: --set optimizer.lr=1e-3 "
                        "--set parallel.mesh=dp=4 (repeatable)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start on this node without torchrun (default: launch.nproc, else the mesh's "
                        "ranks over the nodes)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restart all processes this many times after a failure (default: launch.max_restarts)")
    nodes = p.add_argument_group("several nodes (run the command once per node; Slurm's environment fills them in)")
    nodes.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="nodes of the run; MIN:MAX goes on with fewer after a node is lost, dp re-planned "
                            "(default: launch.nnodes, SLURM_NNODES, else 1)")
    nodes.add_argument("--node-rank", type=int, default=None,
                       help="this node's rank; node 0 hosts the rendezvous (default: launch.node_rank, SLURM_NODEID)")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the c10d rendezvous every node reaches: node 0's address (default: launch.rdzv_endpoint, "
                            "under Slurm MASTER_ADDR or the job's first host, port 29500)")
    nodes.add_argument("--rdzv-id", default=None,
                       help="the run's id, the same on every node (default: launch.rdzv_id, SLURM_JOB_ID)")
    nodes.add_argument("--rdzv-timeout", type=int, default=None, metavar="SECONDS",
                       help="how long to wait for the nodes to join and the endpoint to answer (default: "
                            "launch.rdzv_timeout = 600)")
    nodes.add_argument("--rdzv-last-call", type=int, default=None, metavar="SECONDS",
                       help="with MIN:MAX nodes, how long a rendezvous that has MIN waits for more (default: "
                            "launch.rdzv_last_call = 30)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse subparsers object; its ``func`` is :func:`run`."""
    p = subparsers.add_parser("train", help="train a model as a TOML config says (resumes from its checkpoints)",
                              description=__doc__.split("\n\n")[1])
    _arguments(p)
    p.set_defaults(func=run)
    return p


def _entry(cfg):
    """What each launched process runs (module level: the elastic agent spawns it by reference)."""
    from mcompile.apps.train.loop import train

    return train(cfg)


def run(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        from mcompile.apps.train.preflight import preflight

        preflight(cfg)  # what would fail in the processes: packages, model.hf, init_from, the tokenizer
    except ConfigError as e:
        print(f"mcompile train: error: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or another launcher) started us
        _entry(cfg)
        return 0
    try:
        nodes = resolve_nodes(cfg.launch, nnodes=args.nnodes, node_rank=args.node_rank, endpoint=args.rdzv_endpoint,
                              run_id=args.rdzv_id, timeout=args.rdzv_timeout, last_call=args.rdzv_last_call)
        mesh = cfg.parallel.mesh.strip()
        nproc = nproc_per_node(mesh, args.nproc or cfg.launch.nproc, nodes, global_batch=cfg.train.global_batch,
                               microbatches=cfg.parallel.microbatches, eval_needs_one=eval_needs_one(cfg))
    except ConfigError as e:
        print(f"mcompile train: error: {e}", file=sys.stderr)
        return 2
    restarts = args.max_restarts if args.max_restarts is not None else cfg.launch.max_restarts
    if nodes.elastic and restarts < 1:
        print(f"mcompile train: note: --nnodes {nodes.spec} with --max-restarts 0 ends the run when a node is lost; "
              "give --max-restarts >= 1 to go on with the nodes that remain", file=sys.stderr)
    # the workers read the launch as resolved: launch.nnodes tells them whether the world may shrink (elastic
    # re-planning), launch.node_rank which node they are on
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
        cfg.launch, nproc=nproc, max_restarts=restarts, nnodes=nodes.spec,
        node_rank=-1 if nodes.node_rank is None else nodes.node_rank))
    return launch(cfg, nproc, restarts, nodes=nodes)


def launch(cfg, nproc: int, max_restarts: int = 0, entry=None, payload: tuple | None = None,
           nodes: Nodes | None = None) -> int:
    """Start ``nproc`` processes on this node under torch's elastic agent and run the loop in each (or
    ``entry(*payload)``: a module-level function, as ``mcompile eval`` / ``generate`` run). ``nodes``: the
    nodes the run spans and their rendezvous (default: this machine alone)."""
    entry = entry or _entry
    payload = (cfg,) if payload is None else payload
    nodes = nodes or Nodes()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mcompile.runtime.launch import free_port

    if os.getcwd() not in sys.path:  # a factory in a package of the current folder (the workers inherit sys.path)
        # appended, not first: installed packages keep their names (a checkout's folders, such as mcompile's own
        # kernels/, would otherwise shadow the Hub's `kernels` that transformers imports)
        sys.path.append(os.getcwd())
    # the workers create their own store for each attempt: with the rendezvous store shared (torch's default since
    # 2.5) a restarted attempt reads the previous attempt's gloo / NCCL addresses and cannot connect
    # (pytorch/pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # one compute thread per process unless the user says otherwise (what torchrun does)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    what = "train" if entry is _entry else entry.__name__.strip("_").split("_")[0]
    if nodes.endpoint is None:  # one node: a private rendezvous on this machine
        endpoint, run_id, rdzv = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:12], {}
    else:
        endpoint, run_id = nodes.endpoint, nodes.run_id
        # join_timeout: every node joins within it; read_timeout: each store operation, the first connection to the
        # endpoint included (so an endpoint nobody answers at fails within the timeout, not after torch's 60 s);
        # is_host: node 0 hosts the store (torch's own guess, "the endpoint names this machine", holds for every
        # node of a run on one machine)
        rdzv = {"join_timeout": nodes.timeout, "read_timeout": min(nodes.timeout, 60),
                "last_call_timeout": nodes.last_call}
        if nodes.node_rank is not None:
            rdzv["is_host"] = nodes.node_rank == 0
        where = f"node rank {nodes.node_rank}" if nodes.node_rank is not None else "this node"
        print(f"mcompile {what}: {where} of --nnodes {nodes.spec}, {nproc} processes, rendezvous {endpoint} "
              f"(id {run_id!r}){f' from {nodes.source}' if nodes.source else ''}", file=sys.stderr, flush=True)
        if nodes.node_rank:  # not node 0: the store is elsewhere; wait for it here, where a failure reads plainly
            waited = _wait_for(endpoint, nodes.timeout)
            if waited is not None:
                print(f"mcompile {what}: error: {_unreachable(nodes, endpoint, f'waited {waited:.1f} s')}",
                      file=sys.stderr)
                return 1
    config = LaunchConfig(min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, nproc_per_node=nproc, run_id=run_id,
                          rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_configs=rdzv, max_restarts=max_restarts,
                          monitor_interval=0.5, start_method="spawn", rdzv_timeout=nodes.timeout)
    try:
        elastic_launch(config, entry)(*payload)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        message = first.message if first is not None else str(e)
        if isinstance(message, dict):  # the worker's error file: {"message": ..., "extraInfo": {traceback}}
            message = message.get("message", message)
        hint = ""
        if nodes.max_nodes > 1 and not (nodes.elastic and max_restarts > 0):
            hint = (" (a node lost? --nnodes MIN:MAX with --max-restarts >= 1 goes on with the nodes that remain)")
        print(f"mcompile {what}: failed after {max_restarts} restart(s) (tracebacks above): {message}{hint}",
              file=sys.stderr)
        return 1
    except RendezvousError as e:
        print(f"mcompile {what}: error: {_rendezvous_error(e, nodes, endpoint)}", file=sys.stderr)
        return 1
    return 0


def _wait_for(endpoint: str, timeout: float) -> float | None:
    """None once ``endpoint`` (HOST:PORT) accepts a TCP connection, else the seconds waited: connection attempts
    every half second up to ``timeout`` (node 0 may start after this node)."""
    import socket
    import time

    host, _, port = endpoint.rpartition(":")
    start = time.monotonic()
    deadline = start + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return None
        except OSError:
            now = time.monotonic()
            if now >= deadline:
                return now - start
            time.sleep(min(0.5, deadline - now))


def _unreachable(nodes: Nodes, endpoint: str, detail: str) -> str:
    return (f"could not reach the rendezvous at {endpoint} within --rdzv-timeout {nodes.timeout} s ({detail}): start "
            "node 0 (it hosts the rendezvous) with the same --rdzv-endpoint and --rdzv-id, and check that this node "
            "reaches that host and port")


def _rendezvous_error(e: Exception, nodes: Nodes, endpoint: str) -> str:
    """What a failed rendezvous means and what to do, from torch elastic's exception."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    cause = f"{type(e).__name__}: {e}" + (f" ({e.__cause__})" if e.__cause__ else "")
    if isinstance(e, RendezvousConnectionError):
        if nodes.node_rank == 0:
            return (f"node 0 could not host the rendezvous store at {endpoint}: the endpoint must name this machine "
                    f"and a free port (--rdzv-endpoint THIS_HOST:PORT) [{cause}]")
        return _unreachable(nodes, endpoint, cause)
    if isinstance(e, RendezvousTimeoutError):
        need = f"{nodes.min_nodes}" if nodes.elastic else f"all {nodes.max_nodes}"
        return (f"the rendezvous at {endpoint} (id {nodes.run_id!r}) did not gather {need} nodes within "
                f"--rdzv-timeout {nodes.timeout} s: start mcompile train on every node with the same --nnodes, "
                f"--rdzv-endpoint and --rdzv-id (under Slurm: one task per node, srun --ntasks-per-node=1) [{cause}]")
    return f"the rendezvous at {endpoint} failed: {cause}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcompile train", description=__doc__.split("\n\n")[1])
    _arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
