"""Checkpoints at the speed of the disk (issue 40, item 7): save and load GB/s per rank of
``pm.save_checkpoint`` / ``pm.load_checkpoint`` and the training stall of an asynchronous save, against
the disk itself and a plain ``torch.save`` / ``torch.load`` of the same bytes, in the same run.

    python bench/checkpoint_io.py [--params 250] [--mesh dp=2,tp=2] [--zero 1] [--repeats 4] [--settle 5]
                                  [--dir FOLDER] [--write | --out PATH]

Model: mcompile's plain Llama (``models/llama.py``), sized by ``--params`` (millions; 250: dim 1024,
15 layers, 16 heads, vocabulary 32000, 255 M parameters), built on the meta device on every rank and
initialised by ``parallelize`` (no rank holds the whole model), fp32, AdamW through
``DistributedOptimizer`` after one training step (so the moments exist): 12 bytes per parameter in
the checkpoint, 3.1 GB at 250 M. Layout: ``dp=2,tp=2`` with ZeRO-1 by default (tensor parallel pieces
and dp-sharded optimizer state and fp32 masters, as a run on one node is laid out); each rank writes
a quarter.

Four gloo CPU processes (``mcompile.runtime.launch.spawn``), all on the same disk at once. First an
untimed warm-up (the model alone saved and loaded: one-time imports and set-up). Per round
(``--repeats``; the order of the three writers, and of the three readers, is reversed every other
round, so a change of the machine's load hits all alike; each timed write and cold read starts after
``--settle`` seconds of rest, as the host of a virtual disk goes on writing after a guest's fsync and
the next write would pay for it), every rank, between barriers:

- ``disk``: writes as many bytes as its mcompile checkpoint file holds (random bytes, 64 MiB
  ``os.write`` calls from one buffer), ``fsync``; later reads its mcompile checkpoint file (the
  checkpoint's own bytes) as one plain stream (``readinto`` 64 MiB at a time);
- ``torch``: ``torch.save`` of its pieces (the same boxes mcompile writes, as contiguous tensors: the
  rank's own bytes) to one file, ``fsync``; later ``torch.load`` of it;
- ``mcompile``: ``pm.save_checkpoint(path, opt)`` (synchronous: DCP's planning, the writes, fsync,
  the meta file and rename), later ``pm.load_checkpoint(path, opt)`` (every check, the reads into the
  live parameters and optimizer state); then ``pm.save_checkpoint(path2, opt, async_save=True)``:
  ``stall`` is the time until it returns (what training waits for: the copy of the rank's pieces to
  CPU memory and the hand-over), ``async_total`` the time until the checkpoint is complete. Round 0's
  is the process's first async save, which allocates the staging buffers that later ones reuse:
  ``async_stall_first_s`` is that one, ``async_stall_s`` the median of the later rounds (the steady
  state of a run that checkpoints every so often). What the background write costs a training step
  that runs beside it (the cores it takes) is not measured here.

Reads come ``cold`` and ``warm``: cold after ``posix_fadvise(POSIX_FADV_DONTNEED)`` of every file (no
root is needed to drop a file's clean pages from the page cache; the files are fsynced first), warm
right after (the page cache). On a virtual disk the host may cache what the guest dropped, and how
fast a "cold" read is depends on the file (a file written just before reads back faster): the disk
baseline therefore reads the very files mcompile loads from, dropped the same way.

Figures per rank: seconds and GB/s (``bytes / seconds``, 1 GB = 1e9 bytes) of each operation; a save's
bytes are the rank's file (mcompile: its ``__<rank>_0.distcp``; the disk baseline writes the same
count), a load's bytes what the rank reads (mcompile: the bytes of the boxes DCP's load planner
commits into the rank's tensors, counted by a probe around ``commit_tensor``; under ZeRO-1 a rank reads
its whole tensor-parallel piece of the parameters, not its dp segment, so it reads more than it
wrote). The summary per operation is the median over rounds of the aggregate (all ranks' bytes / the
slowest rank's seconds) and its per-rank share; the ratios (``targets``) are of these: mcompile save /
disk write and mcompile load / disk read >= 0.7, async stall (steady) / synchronous save <= 0.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
import torch  # noqa: E402

CHUNK = 64 << 20  # bytes per os.write / readinto of the disk baseline
TARGETS = {"save_over_disk_write": 0.7, "load_over_disk_read": 0.7, "async_stall_over_sync_save": 0.1}


def model_config(params_m: float) -> dict:
    """A Llama config of about ``params_m`` million parameters (untied embedding and head)."""
    target = params_m * 1e6
    dim = 1024 if target >= 100e6 else 512 if target >= 10e6 else 256 if target >= 1e6 else 64
    vocab = 32000 if target >= 100e6 else 8192 if target >= 1e6 else 512
    ffn = 64 * max(1, round(8 * dim / 3 / 64))
    per_layer = 4 * dim * dim + 3 * dim * ffn + 2 * dim
    layers = max(2, round((target - 2 * vocab * dim - dim) / per_layer))
    heads = max(2, dim // 64)
    return dict(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_hidden=ffn,
                max_seq_len=128)


# -- one rank -----------------------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(paths) -> None:
    """Drop the files' (clean) pages from the page cache: the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _disk_write(path: Path, nbytes: int, buf: torch.Tensor) -> None:
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, view[:min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_read(path: Path, buf: torch.Tensor) -> int:
    view, n = memoryview(buf.numpy()), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(view)
            if not got:
                return n
            n += got


def _torch_save(path: Path, tensors: dict) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def _own_pieces(pm, opt) -> dict:
    """This rank's pieces of the checkpoint (what ``save`` hands DCP) as contiguous tensors."""
    from mcompile.runtime import checkpoint as C

    state, _ = C._state(pm, opt, load=False)
    out = {}
    for key, v in state.items():
        if isinstance(v, C._Pieces):
            for off, (_, view) in v.boxes.items():
                out[f"{key}@{','.join(map(str, off))}"] = view.detach().clone()
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
    return out


class _ReadProbe:
    """Bytes DCP's load planner commits into this rank's tensors (every read box, whichever path read it),
    while installed."""

    def __init__(self):
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        self.cls, self.bytes = DefaultLoadPlanner, 0
        self.original = self.cls.commit_tensor

    def __enter__(self):
        probe = self

        def commit_tensor(planner, read_item, tensor):
            probe.bytes += tensor.nbytes
            return probe.original(planner, read_item, tensor)

        self.cls.commit_tensor = commit_tensor
        return self

    def __exit__(self, *exc):
        self.cls.commit_tensor = self.original


def measure(rank, world, cfg, mesh, zero, folder, repeats, settle=0.0):
    import torch.distributed as dist

    import mcompile as mc
    from mcompile.models.llama import Llama, LlamaConfig
    from mcompile.runtime.zero import DistributedOptimizer

    torch.set_num_threads(1)
    folder = Path(folder)
    mine = folder / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with torch.device("meta"):
        model = Llama(LlamaConfig(**cfg))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (4, 16), generator=g)
    targets = torch.randint(0, cfg["vocab_size"], (4, 16), generator=g)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens, targets), zero=zero)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-4)
    pm.train_step(tokens, targets)
    opt.step()
    opt.zero_grad()
    setup_s = time.perf_counter() - t
    buf = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g)
    sync_path, async_path = folder / "mcompile", folder / "mcompile_async"

    def timed(fn, *args, **kwargs):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        return time.perf_counter() - t0, out

    def clear():
        dist.barrier()
        if rank == 0:
            for p in (sync_path, async_path):
                shutil.rmtree(p, ignore_errors=True)
        for p in mine.iterdir():
            p.unlink()
        dist.barrier()

    # warm-up (first-call costs: imports, DCP's and gloo's set-up), untimed: the model alone, saved and loaded
    pm.save_checkpoint(sync_path, None)
    pm.load_checkpoint(sync_path, None)
    rounds, nbytes = [], None
    for r in range(repeats):
        clear()
        row: dict = {}
        # even rounds write mcompile first (its file size is what the disk baseline writes, also in odd rounds)
        writers = ["mcompile", "torch", "disk"] if r % 2 == 0 else ["disk", "torch", "mcompile"]
        for w in writers:
            time.sleep(settle)  # the disk idle again (a virtual disk's host goes on writing after an fsync)
            if w == "mcompile":
                row["save_s"], _ = timed(pm.save_checkpoint, sync_path, opt)
                row["save_bytes"] = (sync_path / f"__{rank}_0.distcp").stat().st_size
                nbytes = nbytes or row["save_bytes"]
            elif w == "torch":
                pieces = _own_pieces(pm, opt)  # made (and freed) outside the timing
                row["torch_save_s"], _ = timed(_torch_save, mine / "torch.pt", pieces)
                row["torch_save_bytes"] = (mine / "torch.pt").stat().st_size
                row["torch_pieces"], row["torch_pieces_bytes"] = len(pieces), sum(v.nbytes for v in pieces.values())
                del pieces
            else:
                row["disk_write_s"], _ = timed(_disk_write, mine / "disk.bin", nbytes, buf)
                row["disk_write_bytes"] = nbytes
        # the disk's read speed for the checkpoint's own bytes: this rank's file of it, read as one plain stream
        own = sync_path / f"__{rank}_0.distcp"
        readers = ["mcompile", "torch", "disk"] if r % 2 else ["disk", "torch", "mcompile"]
        for cache in ("cold", "warm"):
            for w in readers:
                if cache == "cold":
                    dist.barrier()
                    files = [mine / "torch.pt"] if w == "torch" else [own] if w == "disk" else (
                        [p for p in sync_path.iterdir() if p.is_file()] if rank == 0 else [])
                    _drop_cache(files)
                    time.sleep(settle)
                if w == "mcompile":
                    with _ReadProbe() as probe:
                        row[f"load_{cache}_s"], _ = timed(pm.load_checkpoint, sync_path, opt)
                    row[f"load_{cache}_bytes"] = probe.bytes
                elif w == "torch":
                    row[f"torch_load_{cache}_s"], loaded = timed(
                        torch.load, mine / "torch.pt", map_location="cpu", weights_only=True)
                    row[f"torch_load_{cache}_bytes"] = sum(v.nbytes for v in loaded.values())
                    del loaded
                else:
                    row[f"disk_read_{cache}_s"], n = timed(_disk_read, own, buf)
                    row[f"disk_read_{cache}_bytes"] = n
        # the asynchronous save: the stall is the call, the rest runs while training would (round 0's is the
        # process's first: it allocates the staging buffers the later ones reuse)
        dist.barrier()
        t0 = time.perf_counter()
        pending = pm.save_checkpoint(async_path, opt, async_save=True)
        row["async_stall_s"] = time.perf_counter() - t0
        pending.wait()
        row["async_total_s"] = time.perf_counter() - t0
        rounds.append(row)
    clear()
    return {"rank": rank, "setup_s": setup_s, "rounds": rounds}


# -- the parent: figures, ratios, the record ----------------------------------------------------------
OPS = {  # figure -> (seconds key, bytes key)
    "disk_write": ("disk_write_s", "disk_write_bytes"), "torch_save": ("torch_save_s", "torch_save_bytes"),
    "mcompile_save": ("save_s", "save_bytes"),
    **{f"{who}_{cache}": (f"{key}_{cache}_s", f"{key}_{cache}_bytes") for cache in ("cold", "warm")
       for who, key in (("disk_read", "disk_read"), ("torch_load", "torch_load"), ("mcompile_load", "load"))},
}


def summarise(ranks: list[dict]) -> dict:
    """Per operation: per round the aggregate (all bytes / the slowest rank), then the median over rounds."""
    n = len(ranks)
    out = {}
    for op, (skey, bkey) in OPS.items():
        per_round = []
        for i in range(len(ranks[0]["rounds"])):
            rows = [r["rounds"][i] for r in ranks]
            seconds = max(row[skey] for row in rows)
            total = sum(row[bkey] for row in rows)
            per_round.append({"seconds": seconds, "bytes": total, "gb_s": total / seconds / 1e9,
                              "gb_s_per_rank": [row[bkey] / row[skey] / 1e9 for row in rows]})
        out[op] = {"gb_s": statistics.median(x["gb_s"] for x in per_round),
                   "gb_s_per_rank_mean": statistics.median(x["gb_s"] for x in per_round) / n,
                   "seconds": statistics.median(x["seconds"] for x in per_round),
                   "bytes_all_ranks": per_round[0]["bytes"], "rounds": per_round}
    rounds = len(ranks[0]["rounds"])
    for key in ("async_stall_s", "async_total_s"):
        slowest = [max(r["rounds"][i][key] for r in ranks) for i in range(rounds)]
        out[f"{key[:-2]}_first_s"] = slowest[0]  # with the staging buffers' allocation
        out[key] = statistics.median(slowest[1:] or slowest)  # reusing them (the steady state)
    return out


def ratios(s: dict) -> dict:
    return {
        "save_over_disk_write": s["mcompile_save"]["gb_s"] / s["disk_write"]["gb_s"],
        "load_over_disk_read": s["mcompile_load_cold"]["gb_s"] / s["disk_read_cold"]["gb_s"],
        "load_warm_over_disk_read_warm": s["mcompile_load_warm"]["gb_s"] / s["disk_read_warm"]["gb_s"],
        "async_stall_over_sync_save": s["async_stall_s"] / s["mcompile_save"]["seconds"],
        "first_async_stall_over_sync_save": s["async_stall_first_s"] / s["mcompile_save"]["seconds"],
        "save_over_torch_save": s["mcompile_save"]["gb_s"] / s["torch_save"]["gb_s"],
        "load_over_torch_load": s["mcompile_load_cold"]["gb_s"] / s["torch_load_cold"]["gb_s"],
        "torch_save_over_disk_write": s["torch_save"]["gb_s"] / s["disk_write"]["gb_s"],
        "torch_load_over_disk_read": s["torch_load_cold"]["gb_s"] / s["disk_read_cold"]["gb_s"],
    }


def _filesystem(folder: Path) -> dict:
    best = ("", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if str(folder.resolve()).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fs)
    usage = shutil.disk_usage(folder)
    return {"device": best[0], "mount": best[1], "type": best[2], "free_gb": round(usage.free / 1e9, 1)}


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        return round(next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable")) / 1e6, 1)


def run(params: float, mesh: str = "dp=2,tp=2", zero: int = 1, repeats: int = 4, folder=None, launch=None,
        settle: float = 0.0) -> dict:
    """The record (without machine and commit): 4 ranks run :func:`measure` through ``launch(fn, world,
    *args)`` (default: ``mcompile.runtime.launch.spawn``; a test passes its worker pool) in a fresh folder
    under ``folder`` (default: $TMPDIR), removed after."""
    if launch is None:
        from mcompile.runtime.launch import spawn as launch
    cfg = model_config(params)
    n_params = (2 * cfg["vocab_size"] * cfg["dim"] + cfg["dim"] + cfg["n_layers"] * (
        4 * cfg["dim"] ** 2 + 3 * cfg["dim"] * cfg["ffn_hidden"] + 2 * cfg["dim"]))
    world = 4
    t_start = time.perf_counter()
    result = {"benchmark": "checkpoint_io", "model": {"class": "mcompile.models.llama.Llama", **cfg,
                                                      "parameters": n_params, "dtype": "float32",
                                                      "optimizer": "AdamW (DistributedOptimizer)",
                                                      "checkpoint_bytes_expected": 12 * n_params},
              "layout": {"mesh": mesh, "zero": zero, "ranks": world}, "repeats": repeats, "settle_s": settle,
              "targets": TARGETS, "load_average_before": os.getloadavg(), "mem_available_gb_before":
              _mem_available_gb()}
    base = Path(folder) if folder else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="checkpoint_io-", dir=base))
    try:
        result["filesystem"] = _filesystem(where)
        ranks = launch(measure, world, cfg, mesh, zero, str(where), repeats, settle)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    s = summarise(ranks)
    result.update(figures=s, ratios=ratios(s), per_rank=ranks)
    r = result["ratios"]
    result["meets_targets"] = {"save": r["save_over_disk_write"] >= TARGETS["save_over_disk_write"],
                               "load": r["load_over_disk_read"] >= TARGETS["load_over_disk_read"],
                               "async_stall": r["async_stall_over_sync_save"] <= TARGETS["async_stall_over_sync_save"]}
    result["machine"] = {**_results.machine(), "torch": torch.__version__, "backend": "gloo",
                         "load_average_after": os.getloadavg(), "mem_available_gb_after": _mem_available_gb()}
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["run_seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=250, help="model size in millions of parameters (250)")
    ap.add_argument("--mesh", default="dp=2,tp=2", help="the 4-rank layout (dp=2,tp=2)")
    ap.add_argument("--zero", type=int, default=1, help="ZeRO level (1)")
    ap.add_argument("--repeats", type=int, default=4, help="rounds, the order reversed every other one (4)")
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds of rest before each timed write and cold read (5; the disk idle again)")
    ap.add_argument("--dir", default=None, help="where the files go (a temporary folder in $TMPDIR)")
    _results.add_arguments(ap, "checkpoint_io")
    args = ap.parse_args(argv)
    result = run(args.params, args.mesh, args.zero, args.repeats, args.dir, settle=args.settle)
    _results.save("checkpoint_io", result, args.write, args.out)
    f, r = result["figures"], result["ratios"]
    n = result["model"]["parameters"]
    print(f"{n / 1e6:.0f} M params, {args.mesh} zero={args.zero}: GB/s all ranks (per rank)")
    for op in OPS:
        print(f"  {op:22s} {f[op]['gb_s']:6.3f} ({f[op]['gb_s_per_rank_mean']:.3f})  {f[op]['seconds']:.2f} s")
    print(f"  sync save {f['mcompile_save']['seconds']:.2f} s, async stall {f['async_stall_s']:.3f} s (first "
          f"{f['async_stall_first_s']:.3f} s), async total {f['async_total_s']:.2f} s")
    print("  ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
