"""The training loop of ``mcompile train``: run on every rank with the same TrainConfig.

One step: the learning rate of the step (mcompile.apps.train.schedule) is set on the optimizer; the global
batch is samples ``consumed .. consumed + global_batch - 1`` of the deterministic sample dataset, and each
rank reads only its rows of it (``data.read = "local"``, mcompile.apps.train.reads): the data-parallel ranks
(dp x ep) ``global_batch / (dp x ep)`` consecutive samples each (``pm.batch_rows``), the tp, cp and pp ranks of
those rows the same ones, a cp rank only the positions of each sequence its programs read (``pm.input_positions``),
a pipeline rank whose stages read only the inputs' shapes nothing. ``pm`` runs with
``inputs="local"`` and splits its rows into microbatches: the same tensors on every rank as when each reads
the whole batch and ``pm.train_step`` picks the rows (``data.read = "global"``), so the same losses bit for
bit. The gradients are clipped to a global norm (``pm.clip_grad_norm_``, or the ``DistributedOptimizer``'s
under ZeRO-1/2); the optimizer steps.

Resuming: a checkpoint ``checkpoint.dir/step-XXXXXXX`` holds the model, the optimizer and, in its
``extra``, the step and the number of samples consumed. A checkpoint is complete when its folder has
``mcompile_plan.json`` (``pm.save_checkpoint`` writes into a hidden temporary folder and renames it
when every rank is done). On start the newest complete one is loaded and the run goes on with the
next step and the next sample: no sample is lost or repeated, and since the learning rate is a
function of the step and the data a function of the sample index, the resumed run takes the steps
the uninterrupted run takes (tests/test_train.py checks the weights equal exactly).

Metrics and MFU: mcompile.apps.train.metrics.
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcompile.apps.train.config import ConfigError, TrainConfig
from mcompile.apps.train.metrics import Metrics, hardware_profile, model_flops_per_step
from mcompile.apps.train.model import _hf_config, _import, _shipped, build_model, example_inputs  # noqa: F401  (re-exported)
from mcompile.apps.train.objective import resolve
from mcompile.apps.train.reads import Reader
from mcompile.apps.train.schedule import lr_at

__all__ = ["train", "build_model", "example_inputs", "latest_checkpoint"]

log = logging.getLogger("mcompile.train")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_META = "mcompile_plan.json"  # what makes a checkpoint complete (mcompile.runtime.checkpoint writes it last)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says on this rank; returns a summary (the same on every rank but for timings).

    Initialises torch.distributed from torchrun's environment when it is not initialised yet (and
    then shuts it down at the end)."""
    from mcompile.runtime.launch import init_distributed, shutdown_distributed

    own_group = not dist.is_initialized()
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("RANK") == "0"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        log.warning("torchrun --max-restarts with the rendezvous store shared: a restarted attempt may read the "
                    "previous attempt's addresses and fail to connect (pytorch/pytorch#135712); launch with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    init_distributed()
    from mcompile.apps.train.elastic import fit_world

    cfg, note = fit_world(cfg, dist.get_world_size())  # an elastic run on fewer (or more) nodes: dp re-planned
    if note and dist.get_rank() == 0:
        print(note, flush=True)
    summary = _train(cfg)  # returns first: the model and its process groups are freed before shutdown
    if own_group:
        gc.collect()
        shutdown_distributed()
    return summary


_PARALLEL_OPTIONS = ("sequence_parallel", "zero", "microbatches", "schedule", "virtual_stages", "recompute", "fp8",
                     "fuse")


def applied_updates(step: int, pm) -> int:
    """The learning-rate schedule's position at ``step``: the steps whose update was applied before it, plus one.
    Under fp16 an overflowed step is skipped (no update) and, as in Megatron (its scheduler advances only on a
    successful update), does not advance the schedule: after k skipped steps, step s runs at lr_at(s - k). The
    count is the loss scaler's, which checkpoints save, so a resumed run continues at the same position."""
    scaler = getattr(pm, "loss_scaler", None)
    return step - (scaler.skipped_steps if scaler is not None else 0)


def _options(cfg: TrainConfig) -> dict:
    """parallelize's options (mcompile.Config fields) from [parallel] and [train]; under plan "auto" only
    what the user set (the search keeps given options fixed and chooses the rest)."""
    auto = cfg.parallel.mesh.strip() == "auto"
    out = {}
    for name in _PARALLEL_OPTIONS:
        if not auto or f"parallel.{name}" in cfg.explicit:
            value = getattr(cfg.parallel, name)
            out[name] = None if name == "fp8" and value == "none" else value
    out.update(dtype=_DTYPES[cfg.train.dtype], init_seed=cfg.train.seed)
    if cfg.data.read == "local":  # each rank passes its own rows of the batch (Reader)
        out["inputs"] = "local"
    if cfg.train.dtype == "fp16":  # dynamic loss scaling (mcompile.runtime.loss_scale)
        out.update({k: getattr(cfg.train, k) for k in ("initial_loss_scale", "loss_scale_window", "min_loss_scale",
                                                       "loss_scale_hysteresis")})
    if not auto:
        out["pipeline_seq"] = cfg.train.seq_len
    # the hang watchdog: the timeout only when set (else $MCOMPILE_HANG_TIMEOUT), reports beside the checkpoints
    d = cfg.debug
    if "debug.hang_timeout_s" in cfg.explicit:
        out["hang_timeout_s"] = d.hang_timeout_s
    hang_dir = d.hang_dir or (str(Path(cfg.checkpoint.dir) / "hangs") if cfg.checkpoint.dir else "")
    if hang_dir:
        out["hang_dump_dir"] = hang_dir
    if d.hang_abort:
        out["hang_abort"] = True
    return out


# ---------------------------------------------------------------------------------------------- data
def _prepare_data(cfg: TrainConfig, rank: int) -> None:
    """``data.tokenize``: rank 0 writes the dataset ``data.sources`` when it cannot be opened yet."""
    d = cfg.data
    if not d.tokenize:
        return
    error = [None]
    if rank == 0:
        from mcompile.apps.data import IndexedDataset, preprocess

        try:
            IndexedDataset(d.sources)
        except Exception:  # noqa: BLE001 - missing or partial: (re)write it
            try:
                Path(d.sources).parent.mkdir(parents=True, exist_ok=True)
                preprocess([_shipped(x, "corpus") for x in d.tokenize], d.sources, _shipped(d.tokenizer, "tokenizer"),
                           text_key=d.text_key, progress=False)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error[0] = f"data.tokenize: writing {d.sources} failed: {type(e).__name__}: {e}"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise RuntimeError(error[0])


def _dataset(cfg: TrainConfig, split: str):
    d, t = cfg.data, cfg.train
    if d.factory:
        return _import(d.factory, "data.factory")(seq_len=t.seq_len, seed=t.seed, split=split)
    from mcompile.apps.data import SampleDataset

    sources = d.sources if isinstance(d.sources, str) else [(p, w) for p, w in d.sources]
    return SampleDataset(sources, t.seq_len, seed=t.seed, split=split, valid_fraction=d.valid_fraction)


# ---------------------------------------------------------------------------------------------- checkpoints
def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete checkpoint of the highest step in ``folder`` (``step-XXXXXXX`` with its meta file)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / _META).is_file()]
    return max(found)[1] if found else None


def _prune(folder: Path, keep: int) -> None:
    """Rank 0: delete all but the newest ``keep`` complete checkpoints."""
    if keep <= 0:
        return
    done = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))
                  and (p / _META).is_file())
    for _, p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def _leftovers(folder: Path) -> None:
    """Rank 0 on start: temporary folders of saves a killed run left (never renamed: incomplete)."""
    for p in folder.glob(".step-*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the loop
def _optimizer(cfg: TrainConfig, pm):
    """(optimizer, clip function): mcompile's DistributedOptimizer under ZeRO-1/2 (gradients live in its
    sharded buffers), else a torch optimizer over pm.parameters() clipped by pm.clip_grad_norm_ (right on
    every layout, pipelines included)."""
    o = cfg.optimizer
    if o.name == "adamw":
        cls, kwargs = torch.optim.AdamW, {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps,
                                          "weight_decay": o.weight_decay}
    else:
        cls, kwargs = torch.optim.SGD, {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay}

    def no_decay(fqn: str) -> bool:  # 1-D parameters: norm weights, biases
        return not o.decay_1d and len(pm.plan.params[fqn].shape) < 2

    if pm.config.zero in (1, 2):
        from mcompile.runtime.zero import DistributedOptimizer

        opt = DistributedOptimizer(pm, cls, options_for=lambda f: {"weight_decay": 0.0} if no_decay(f) else {},
                                   **kwargs)
        return opt, opt.clip_grad_norm_
    named = list(pm.named_parameters())
    groups = [{"params": [p for f, p in named if not no_decay(f)]},
              {"params": [p for f, p in named if no_decay(f)], "weight_decay": 0.0}]
    return cls([g for g in groups if g["params"]], **kwargs), pm.clip_grad_norm_


def _evaluate(pm, valid, batches: int, batch_size: int, reader: Reader) -> tuple[float, int]:
    """Token-weighted mean loss over the fixed valid batches (each batch's mean times its token count), each
    batch given to the model as the run's objective says; each rank reads its rows as in training (``reader``)."""
    total, count = 0.0, 0
    for i in range(batches):
        inputs, tokens = reader.read(valid, i * batch_size, batch_size)
        n = reader.counted(inputs, tokens, batch_size, valid)  # the whole batch's: the same on every rank
        if n == 0:
            continue
        total += float(pm.forward(*inputs)) * n
        count += n
    return total / max(count, 1), count


def _peak_memory_gib() -> float:
    """This process's peak memory: the CUDA allocator's peak on a GPU, else the peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _wait(pending) -> None:
    """An asynchronous save finished (mcompile.runtime.checkpoint's PendingSave.wait, or a future)."""
    if pending is not None:
        (getattr(pending, "wait", None) or pending.result)()


def _lose_node() -> None:
    """debug.kill_node: this node is lost. The agent (this process's parent) and, where the agent leads its own
    process group (a Slurm task, the tests' agents), every process of that group die by SIGKILL; otherwise the
    agent and this process, and the node's other processes fail at their next collective."""
    sys.stdout.flush()
    agent = os.getppid()
    if os.getpgid(0) == agent:
        os.killpg(agent, signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _train(cfg: TrainConfig) -> dict:
    """The run on this rank (module docstring): compiled and resumed by :class:`_Run`, its steps, then its final
    saves; returns the summary."""
    run = _Run(cfg)
    for step in range(run.start_step + 1, cfg.train.steps + 1):
        run.step(step)
        if step == cfg.train.stop_at:
            break
    return run.finish()


def _datasets(cfg: TrainConfig, rank: int, vocab: int | None):
    """(train, valid) datasets (valid None without evaluation), written first where ``data.tokenize`` says;
    refused where a split's ids exceed the model's vocabulary or it holds no sample of ``train.seq_len``."""
    _prepare_data(cfg, rank)  # the data before planning: its errors come before the model's compile
    data = _dataset(cfg, "train")
    valid = _dataset(cfg, "valid") if cfg.eval.interval else None
    for split, ds in (("train", data), ("valid", valid)):
        if ds is not None and vocab is not None and getattr(ds, "vocab_size", 0) > vocab:
            raise ConfigError(f"the {split} data's vocabulary has {ds.vocab_size} ids but the model's {vocab}: "
                              "preprocess with the model's tokenizer, or set model.overrides.vocab_size = "
                              f"{ds.vocab_size}")
        if ds is not None and hasattr(ds, "__len__") and len(ds) == 0:
            raise ConfigError(f"the {split} split of data.sources holds no sample of train.seq_len = "
                              f"{cfg.train.seq_len} tokens: use more data, a shorter seq_len"
                              + (", or a larger data.valid_fraction" if split == "valid" else ""))
    return data, valid


def _compile(cfg: TrainConfig, rank: int):
    """(pm, objective, vocab, train data, valid data, hardware): the model built, its data opened, then the model
    parallelized over ``parallel.mesh`` (or the plan searched for, under ``auto``), its weights from
    ``model.init_from`` where given."""
    import mcompile as mc

    tc = cfg.train
    model, vocab, example = build_model(cfg)
    objective = resolve(cfg, vocab_size=vocab or 0)
    if example is None:
        example = example_inputs(cfg, objective, vocab)
    data, valid = _datasets(cfg, rank, vocab)
    mesh_spec = cfg.parallel.mesh.strip()
    options = _options(cfg)
    hw = hardware_profile(cfg.parallel.hardware)
    if mesh_spec == "auto":
        pm = mc.parallelize(model, example_inputs=tuple(example), plan="auto", hardware=hw,
                            global_batch=tc.global_batch, weights=cfg.model.init_from or None,
                            distributed_optimizer="parallel.zero" not in cfg.explicit, **options)
    else:
        pm = mc.parallelize(model, mc.Mesh.parse(mesh_spec), tuple(example), weights=cfg.model.init_from or None,
                            **options)
    del model
    if rank == 0 and cfg.model.init_from:
        print(f"weights loaded from {cfg.model.init_from} (model.init_from)", flush=True)
    return pm, objective, vocab, data, valid, hw


def _check_batches(cfg: TrainConfig, pm) -> int:
    """The evaluation batch size, once the global batch divides over dp x microbatches and the evaluation batch
    over dp (and evaluation, which runs ``pm.forward``, has no microbatches to split without pp)."""
    tc = cfg.train
    # the batch splits over dp x ep (mcompile folds expert parallelism into data parallelism)
    dp, m = pm.mesh.size("dp") * pm.mesh.size("ep"), pm.config.microbatches
    dp_name = "dp" if pm.mesh.size("ep") == 1 else "dp x ep"
    if tc.global_batch % (dp * m):
        raise ConfigError(f"train.global_batch = {tc.global_batch} does not divide by {dp_name}={dp} x "
                          f"parallel.microbatches={m}: use a multiple of {dp * m}")
    eval_bs = cfg.eval.batch_size or tc.global_batch
    if cfg.eval.interval:
        if eval_bs % dp:
            raise ConfigError(f"eval.batch_size = {eval_bs} does not divide by {dp_name}={dp}: use a multiple of "
                              f"{dp}")
        if m > 1 and pm.mesh.size("pp") == 1:
            raise ConfigError("eval runs pm.forward, which takes the local batch at once: without pipeline "
                              f"parallelism it needs parallel.microbatches = 1 (got {m}); set eval.interval = 0 "
                              "or parallel.microbatches = 1")
    return eval_bs


def _resume(cfg: TrainConfig, pm, opt, rank: int, world: int) -> tuple[int, int, str | None]:
    """(step, samples consumed, checkpoint path or None): rank 0 picks the newest complete checkpoint of
    ``checkpoint.dir`` (and clears what killed saves left), every rank loads it (model and optimizer)."""
    tc, cc = cfg.train, cfg.checkpoint
    start_step, consumed, resumed = 0, 0, None
    if not cc.dir:
        return start_step, consumed, resumed
    choice = [None]
    if rank == 0:
        Path(cc.dir).mkdir(parents=True, exist_ok=True)
        _leftovers(Path(cc.dir))
        found = latest_checkpoint(cc.dir)
        choice[0] = str(found) if found else None
    if world > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0]:
        resumed = choice[0]
        extra = pm.load_checkpoint(resumed, opt)
        start_step, consumed = int(extra["step"]), int(extra["consumed_samples"])
        if rank == 0:
            changed = {k: (extra.get(k), v) for k, v in (("seq_len", tc.seq_len), ("seed", tc.seed))
                       if extra.get(k) not in (None, v)}
            if changed:
                log.warning("resuming %s with changed %s: the data order differs from the saved run's",
                            resumed, ", ".join(f"train.{k} {a} -> {b}" for k, (a, b) in changed.items()))
            print(f"resumed from {resumed} (step {start_step}, {consumed} samples consumed)", flush=True)
    return start_step, consumed, resumed


class _Run:
    """One training run on this rank and the state its parts share: the compiled model (``pm``), its optimizer,
    the data, the position (``consumed`` samples; the step is the loop's), the metrics (rank 0), the pending
    asynchronous save, and what the summary reports (losses, evaluation, the last log row, the first step's
    time)."""

    def __init__(self, cfg: TrainConfig):
        self.t0 = time.perf_counter()
        self.cfg, self.tc, self.cc = cfg, cfg.train, cfg.checkpoint
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pm, self.objective, self.vocab, self.data, self.valid, self.hw = _compile(cfg, self.rank)
        self.eval_bs = _check_batches(cfg, self.pm)
        self.opt, self.clip = _optimizer(cfg, self.pm)
        self.start_step, self.consumed, self.resumed = _resume(cfg, self.pm, self.opt, self.rank, self.world)
        self.consumed_at_start = self.consumed
        self._metrics()
        self.save_kw = self._save_options()
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.pending = None
        self.reader = Reader(self.pm, self.objective, self.tc.seq_len, cfg.data.read == "local")
        self.losses: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad norm) of this attempt
        self.eval_loss, self.best_eval, self.last_log, self.last_time = None, None, self.start_step, time.perf_counter()
        self.row, self.first_step_s = {}, None
        self.saved_at = self.start_step if self.resumed else None

    def _metrics(self) -> None:
        """Rank 0: the model FLOPs per step and the hardware's peak for MFU, the metrics files, and the run's
        banner."""
        cfg, tc, pm, hw, rank = self.cfg, self.tc, self.pm, self.hw, self.rank
        self.flops = flops = model_flops_per_step(pm, tc.global_batch, tc.seq_len) if rank == 0 else None
        dtype_name = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16"}[tc.dtype]
        if pm.config.fp8 is not None and hw.fp8_flops is not None:
            dtype_name = "fp8"
        self.peak = hw.peak_flops(dtype_name)
        self.metrics = Metrics(cfg, self.start_step, hw.name) if rank == 0 else None
        if rank == 0:
            n_params = sum(math.prod(p.shape) for p in pm.plan.params.values())
            print(f"training {cfg.model.preset or cfg.model.hf or cfg.model.factory} ({n_params:,} parameters) on "
                  f"{pm.mesh!r}, {self.world} processes: sequence_parallel={pm.config.sequence_parallel}, "
                  f"zero={pm.config.zero}, microbatches={pm.config.microbatches}, dtype={tc.dtype}; "
                  f"{tc.global_batch} x {tc.seq_len} tokens per step"
                  + (f", {flops / 1e9:.3g} GFLOP (model)" if flops else "")
                  + f"; objective: {self.objective.describe()}", flush=True)

    def _save_options(self) -> dict:
        """``save_checkpoint``'s options: ``async_save`` where ``checkpoint.async_save`` asks and it is offered."""
        save_kw = {}
        if self.cc.async_save:
            if "async_save" in inspect.signature(self.pm.save_checkpoint).parameters:
                save_kw["async_save"] = True
            elif self.rank == 0:
                log.warning("checkpoint.async_save: this mcompile's save_checkpoint has no async_save; saving "
                            "synchronously")
        return save_kw

    # ---- checkpoints
    def _finish_saving(self) -> None:
        """The previous (asynchronous) save complete, then the old ones pruned."""
        _wait(self.pending)
        self.pending = None
        if self.rank == 0:
            _prune(Path(self.cc.dir), self.cc.keep)

    def _save(self, step: int) -> None:
        """Checkpoint ``step`` (after the previous save completed): the model, the optimizer and the position."""
        tc = self.tc
        self._finish_saving()
        path = Path(self.cc.dir) / f"step-{step:07d}"
        self.pending = self.pm.save_checkpoint(path, self.opt, extra={
            "step": step, "consumed_samples": self.consumed, "global_batch": tc.global_batch, "seq_len": tc.seq_len,
            "seed": tc.seed}, **self.save_kw)
        if not self.save_kw:
            self._finish_saving()
        if self.rank == 0:
            print(f"checkpoint saved: {path}" + (" (writing in the background)" if self.save_kw else ""), flush=True)

    # ---- the steps
    def step(self, step: int) -> None:
        """One step (module docstring): its learning rate, its global batch, the train step, the clip and the
        optimizer's step; then its log row, the evaluation and the checkpoint where they are due."""
        cfg, tc, opt = self.cfg, self.tc, self.opt
        if cfg.debug.kill_step == step and self.restart == 0:  # fault injection (tests), first attempt only
            if cfg.debug.kill_node < 0 and cfg.debug.kill_rank == self.rank:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # the elastic agent restarts all
            elif cfg.debug.kill_node >= 0 and cfg.debug.kill_node == cfg.launch.node_rank \
                    and os.environ.get("LOCAL_RANK") == "0":
                _lose_node()
        lr = lr_at(applied_updates(step, self.pm), cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, tokens = self.reader.read(self.data, self.consumed, tc.global_batch)
        if tokens is not None and self.vocab is not None and int(tokens.max()) >= self.vocab:
            raise ValueError(f"the data holds token id {int(tokens.max())} but the model's vocabulary has "
                             f"{self.vocab} entries: preprocess with the model's tokenizer, or set "
                             "model.overrides.vocab_size")
        self.consumed += tc.global_batch
        loss = self.pm.train_step(*inputs)
        if getattr(self.pm, "step_skipped", False):  # fp16: a gradient overflowed on some rank; every rank skips the
            norm = torch.zeros(())  # step (its gradients are None) and the loss scale backed off
        else:
            norm = self.clip(tc.clip if tc.clip > 0 else math.inf)
            opt.step()
        opt.zero_grad()
        self.losses.append((step, loss, norm.detach() if isinstance(norm, torch.Tensor) else torch.tensor(norm)))
        logged = step % cfg.logging.interval == 0 or step in (tc.steps, tc.stop_at)
        if self.first_step_s is None:
            self._first_step(step, loss, logged)
        if logged:
            self._log(step, loss, lr)
        elif self.metrics is not None:
            self.metrics.advance(step)
        paused = time.perf_counter()
        self._evaluate_and_save(step)
        self.last_time += time.perf_counter() - paused  # throughput counts training steps only

    def _first_step(self, step: int, loss, logged: bool) -> None:
        """The first step of an attempt compiles (joint trace, warm-up): its time is reported on its own and
        left out of the throughput of the window it opens."""
        float(loss)
        self.first_step_s = time.perf_counter() - self.last_time
        if self.rank == 0:
            print(f"step {step}: first step {self.first_step_s:.1f} s (includes compilation)", flush=True)
        if not logged:
            self.last_log, self.last_time = step, time.perf_counter()

    def _log(self, step: int, loss, lr: float) -> None:
        """The log row of the steps since the last one (mcompile.apps.train.metrics): loss, learning rate, grad norm,
        throughput, MFU, memory, and the fp16 loss scale."""
        tc, pm, flops = self.tc, self.pm, self.flops
        now = time.perf_counter()
        loss_v, norm_v = float(loss), float(self.losses[-1][2])
        dt = now - self.last_time
        n = max(step - self.last_log, 1)
        self.row = row = {
            "step": step, "loss": loss_v, "lr": lr, "grad_norm": norm_v,
            "tokens_per_s": n * tc.global_batch * tc.seq_len / dt, "step_time_s": dt / n,
            "mfu": (flops * n / dt / self.world / self.peak) if flops else None, "consumed_samples": self.consumed,
            "restart": self.restart, "world_size": self.world, "mem_gib": round(_peak_memory_gib(), 3)}
        if getattr(pm, "loss_scaler", None) is not None:  # fp16
            row.update(loss_scale=pm.loss_scaler.scale, skipped_steps=pm.loss_scaler.skipped_steps)
        if self.metrics is not None:
            self.metrics.record(row)
        self.last_log, self.last_time = step, time.perf_counter()

    def _evaluate_and_save(self, step: int) -> None:
        """The evaluation every ``eval.interval`` steps (and at the last), the checkpoint every
        ``checkpoint.interval``."""
        cfg, tc, cc = self.cfg, self.tc, self.cc
        if cfg.eval.interval and (step % cfg.eval.interval == 0 or step == tc.steps):
            self.eval_loss, n_tokens = _evaluate(self.pm, self.valid, cfg.eval.batches, self.eval_bs, self.reader)
            self.best_eval = self.eval_loss if self.best_eval is None else min(self.best_eval, self.eval_loss)
            if self.metrics is not None:
                self.metrics.record({"step": step, "eval_loss": self.eval_loss, "eval_tokens": n_tokens})
        if cc.dir and cc.interval and step % cc.interval == 0:
            self._save(step)
            self.saved_at = step

    # ---- the end
    def finish(self) -> dict:
        """The final checkpoint, state dict and Hugging Face export where asked, then the summary (printed on rank
        0, returned on every rank)."""
        tc, rank = self.tc, self.rank
        last = min(tc.steps, tc.stop_at or tc.steps)
        exported = self._final_saves(last)
        if self.metrics is not None:
            self.metrics.close()
        logged = [(s, float(lv)) for s, lv, _ in self.losses]
        wall = time.perf_counter() - self.t0
        tokens_seen = (self.consumed - self.consumed_at_start) * tc.seq_len
        best_eval = self.best_eval
        if rank == 0 and self.losses:
            print(f"done: steps {self.start_step + 1}-{logged[-1][0]} in {wall:.1f} s ({tokens_seen:,} tokens), "
                  f"final loss {logged[-1][1]:.4f}"
                  + (f", best eval loss {best_eval:.4f}" if best_eval is not None else "")
                  + (f", peak memory {_peak_memory_gib():.2f} GiB (rank 0)"), flush=True)
        return {"steps": tc.steps, "start_step": self.start_step, "resumed_from": self.resumed, "losses": logged,
                "final_loss": logged[-1][1] if logged else None, "eval_loss": self.eval_loss,
                "best_eval_loss": best_eval, "mesh": repr(self.pm.mesh), "consumed_samples": self.consumed,
                "tokens_per_s": self.row.get("tokens_per_s"), "mfu": self.row.get("mfu"), "hardware": self.hw.name,
                "restart": self.restart, "wall_s": wall, "first_step_s": self.first_step_s,
                "objective": self.objective.kind, "exported_hf": exported}

    def _final_saves(self, last: int) -> str | None:
        """A checkpoint of the ``last`` step where it was not saved yet (and every save complete), the full state
        dict (``checkpoint.final_state_dict``), and the export for ``from_pretrained`` once the run reached
        ``train.steps``: its folder, or None."""
        tc, cc, pm, rank = self.tc, self.cc, self.pm, self.rank
        if cc.dir and self.saved_at != last and last > self.start_step:
            self._save(last)
        if cc.dir:
            self._finish_saving()
        if cc.final_state_dict:
            sd = pm.full_state_dict(rank=0)
            if rank == 0:
                Path(cc.final_state_dict).parent.mkdir(parents=True, exist_ok=True)
                torch.save(sd, cc.final_state_dict)
        exported = None
        if cc.export_hf_dir and last == tc.steps and last > self.start_step:
            from mcompile.apps.train.export import export_run

            exported = str(export_run(self.cfg, pm, cc.export_hf_dir))
            if rank == 0:
                print(f"exported for from_pretrained: {exported}", flush=True)
        return exported
