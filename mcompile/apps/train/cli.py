"""``mcompile train CONFIG.toml [--set KEY=VALUE ...] [--nproc N] [--max-restarts R]``.

Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) every process runs the loop
directly. Otherwise this command starts the processes itself on this machine with
torch.distributed's elastic launcher (the agent torchrun runs): gloo on CPU, NCCL on GPUs, one
process per rank of the mesh (``--nproc`` / ``launch.nproc`` for ``mesh = "auto"``), and after a
failure of any process it restarts all of them, up to ``--max-restarts`` / ``launch.max_restarts``
times; the restarted run resumes from the newest complete checkpoint.

``python -m mcompile.apps.train.cli CONFIG ...`` is the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from mcompile.apps.train.config import ConfigError, load_config, mesh_size

__all__ = ["add_parser", "run", "main"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's TOML config (examples/train/llama3-tiny.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config key, value in TOML syntax: --set optimizer.lr=1e-3 "
                        "--set parallel.mesh=dp=4 (repeatable)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start here without torchrun (default: launch.nproc, else the mesh's size)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restart all processes this many times after a failure (default: launch.max_restarts)")


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
    mesh = cfg.parallel.mesh.strip()
    nproc = args.nproc or cfg.launch.nproc or (mesh_size(mesh) if mesh != "auto" else 0)
    if nproc < 1:
        print("mcompile train: error: parallel.mesh = \"auto\" needs the number of processes: pass --nproc N or "
              "set launch.nproc", file=sys.stderr)
        return 2
    if mesh != "auto" and nproc != mesh_size(mesh):
        print(f"mcompile train: error: parallel.mesh = {mesh!r} has {mesh_size(mesh)} ranks but {nproc} processes "
              "were asked for: make them equal (or use mesh = \"auto\")", file=sys.stderr)
        return 2
    restarts = args.max_restarts if args.max_restarts is not None else cfg.launch.max_restarts
    return launch(cfg, nproc, restarts)


def launch(cfg, nproc: int, max_restarts: int = 0, entry=None, payload: tuple | None = None) -> int:
    """Start ``nproc`` processes on this machine under torch's elastic agent and run the loop in each (or
    ``entry(*payload)``: a module-level function, as ``mcompile eval`` / ``generate`` run)."""
    entry = entry or _entry
    payload = (cfg,) if payload is None else payload
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:12],
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(config, entry)(*payload)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        message = first.message if first is not None else str(e)
        if isinstance(message, dict):  # the worker's error file: {"message": ..., "extraInfo": {traceback}}
            message = message.get("message", message)
        what = "train" if entry is _entry else entry.__name__.strip("_").split("_")[0]
        print(f"mcompile {what}: failed after {max_restarts} restart(s) (tracebacks above): {message}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcompile train", description=__doc__.split("\n\n")[1])
    _arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
