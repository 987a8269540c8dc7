"""How a :class:`~mcompile.runtime.module.ParallelModule` runs a step on this rank (DESIGN §3, §6): the rank's
program (under pp its stages, through runtime/pipeline.py; with ``execution="joint"`` the joint program,
runtime/joint_runner.py) on the parameters' local leaves, with mcompile's collective ops bound to the mesh's
process groups; forward only, and the timeline of the steps.

One ``train_step``:

1. split the global batch: this rank's data-parallel slice (``inputs="local"``: already sliced),
   then ``microbatches`` pieces;
2. per piece: forward and backward of the *summed* token loss on plain local leaves (the
   parameters' storage in fp32, or one compute-dtype copy per step), each piece's gradients added
   in fp32 into flat bucket buffers (runtime/leaves.py);
3. gradient reduction: every gradient that the plan marks Partial over an axis is all-reduced over
   it — over dp per bucket of ``bucket_mb``, in place, launched from post-accumulate-grad hooks
   during the last piece's backward (overlapped with the rest of backward), over tp
   (sequence-parallel norm weights) in one coalesced all-reduce; in fp32;
4. the token count of the global batch is summed and every new gradient divided by it, so the
   gradients and the returned loss are the single-device mean over the whole batch (labels -100
   ignored), however the batch was split. Gradients that were already in ``.grad`` are kept and
   added to, as ``loss.backward()`` does.

:class:`StepRunner` is one of the two halves ParallelModule is made of (runtime/module.py; the other,
runtime/state.py, holds the parameters and buffers). Besides what the module's construction set (``config``,
``mesh``, ``plan``, ``fp8``, ``_compiled``, ``_comm``, ``_rank``, ``_device``, the data and batch axes' sizes and
coordinates, ``_cp``, ``_has_moe_ep``, ``_program``, ``_runner``, ``_pipe``, ``_placeholders``,
``_token_weighted``) it reads the state's ``_local_inputs`` and ``_params``, and the gradient buffers
(``_leaves``, ``_zero``, ``_tp_partial``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from mcompile.ir import ops
from mcompile.ir.config import Config, Inputs
from mcompile.ir.dropout import RNG_INPUT, rng_state
from mcompile.ir.ops import grad_sink

__all__ = ["StepRunner"]


class StepRunner:
    """Runs this rank's steps: ``train_step``, ``forward``, the timeline (module docstring); a part of
    :class:`~mcompile.runtime.module.ParallelModule`."""

    # -- construction -------------------------------------------------------------------------
    def _init_step(self, config: Config) -> None:
        """What the steps keep between calls: the dropout step counter (saved in checkpoints), fp16's dynamic loss
        scaler (runtime/loss_scale.py; bf16 and fp32 need none), the last step's skip flag and MoE drop count."""
        # training-mode dropout (mcompile/ir/dropout.py): the programs read (seed, step, batch offset) from an input;
        # the step counts train_step and forward calls, and is saved in checkpoints
        self._uses_rng = RNG_INPUT in self._placeholders
        self.dropout_step = 0
        self.moe_dropped = 0  # routed slots dropped by capacity on this rank in the last step (moe_capacity_factor)
        # fp16 compute: dynamic loss scaling (runtime/loss_scale.py); bf16 and fp32 need none
        self.loss_scaler = None
        if config.dtype == torch.float16:
            from mcompile.runtime.loss_scale import DynamicLossScaler

            self.loss_scaler = DynamicLossScaler.from_config(config)
        self.step_skipped = False  # the last train_step's gradients overflowed (fp16): its optimizer step is skipped

    # -- what a data loader passes ----------------------------------------------------------------
    def batch_rows(self, n: int) -> range:
        """The rows of a global batch of ``n`` samples that this rank's steps run on, what it passes under
        ``inputs="local"``: the data-parallel ranks (dp x ep, in rank order) take ``n / (dp x ep)`` consecutive
        rows each (``train_step`` on the global batch picks the same ones); the tp, pp and cp ranks of one data
        rank take the same rows (cp's programs slice their tokens of each sequence: the rows hold whole
        sequences, of which a cp rank reads only ``input_positions``)."""
        k = self._batch_size
        if n < 0 or n % k:
            raise ValueError(f"a batch of {n} samples does not split over the {k} data-parallel ranks "
                             f"({' x '.join(f'{a}={self.mesh.size(a)}' for a in self._batch_axes)}): use a "
                             f"multiple of {k}")
        rows = n // k
        return range(self._batch_coord * rows, (self._batch_coord + 1) * rows)

    @property
    def reads_inputs(self) -> bool:
        """Whether this rank's programs read the values of the model's inputs: False on a pipeline rank none of
        whose stages reads more of one than its shape (a middle stage receives activations from its neighbour and
        may take the sequence length from the token ids), which may then pass tensors of the inputs' shapes
        holding anything."""
        if self._pipe is None:
            return True
        return any(_reads_values(self._pipe.stages[s].gm, self._pipe.stages[s].user_inputs) for s in self._pipe.own)

    def input_positions(self, inputs: tuple, cp_rank: int | None = None) -> list[torch.Tensor | None]:
        """Per positional model input of ``inputs`` (one microbatch of them: the shapes the programs run on; the
        values are not read), the positions along its dim 1 (the sequence) that this rank's programs read when they
        run as cp rank ``cp_rank`` (default: this rank's): a sorted int64 tensor (empty: the program reads no value
        of it, only its shape), or None for every position. What a loader must give: a cp program keeps its tokens
        of the whole-sequence inputs it is passed (mcompile.passes.cp.reads), so positions it does not read may
        hold anything. Without cp every read input is read whole (None)."""
        cap = self._compiled.captured
        named = {n: t for n, t in zip(cap.user_inputs, inputs) if isinstance(t, torch.Tensor)}
        rank = self._coords.get("cp", 0) if cp_rank is None else cp_rank
        if not 0 <= rank < self._cp:
            raise ValueError(f"cp_rank={cp_rank}: the mesh has cp={self._cp}")
        if self._pipe is not None:
            programs = [(self._pipe.stages[s].gm, self._pipe.stages[s].user_inputs) for s in self._pipe.own]
        else:
            programs = [(self._program, list(cap.user_inputs))]
        found: dict[str, torch.Tensor | None] = {n: torch.zeros(0, dtype=torch.int64) for n in named}
        for gm, names in programs:
            for n, cols in self._programs.input_columns(gm, names, named, rank).items():
                found[n] = None if cols is None or found[n] is None else torch.unique(torch.cat([found[n], cols]))
        return [found.get(n) if isinstance(t, torch.Tensor) else None for n, t in zip(cap.user_inputs, inputs)]

    # -- running --------------------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        dp = self._batch_size
        m = self.config.microbatches
        flat = list(args) + list(kwargs.values())
        batch = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.ndim > 0), None)
        if batch is None:
            return [(args, kwargs)]
        if self.config.inputs == Inputs.GLOBAL:
            if batch % (dp * m):
                raise ValueError(
                    f"the global batch of {batch} does not divide by dp={dp} x microbatches={m}; use a batch "
                    f"that is a multiple of {dp * m}"
                )
            pick = lambda t: t.chunk(dp)[self._batch_coord] if _batched(t, batch) else t  # noqa: E731
            args = tuple(pick(a) for a in args)
            kwargs = {k: pick(v) for k, v in kwargs.items()}
            batch //= dp
        elif batch % m:
            raise ValueError(f"the local batch of {batch} does not divide by microbatches={m}")
        if self._cp > 1:
            from mcompile.ir.mesh import check_sequence

            for t in flat:
                if _batched(t, batch) and t.ndim >= 2:
                    check_sequence(int(t.shape[1]), self._cp)
        if self._device.type == "cuda":  # this rank's slice pinned once: the copies below overlap the host
            pin = lambda t: t.contiguous().pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu" \
                else t  # noqa: E731
            args = tuple(pin(a) for a in args)
            kwargs = {k: pin(v) for k, v in kwargs.items()}
        move = lambda t: t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
        pieces = []
        for i in range(m):
            cut = lambda t: t.chunk(m)[i] if _batched(t, batch) else t  # noqa: E731, B023
            pieces.append((tuple(move(cut(a)) for a in args), {k: move(cut(v)) for k, v in kwargs.items()}))
        return pieces

    def _rng_states(self, pieces: list) -> list:
        """Per piece of this step's batch, the dropout program input (mcompile/ir/dropout.py): the seed, this step,
        and the piece's first row in the global batch — this data rank's slice (dp x ep, in rank order; a
        ``inputs="local"`` slice counts as one of equal slices), then the microbatch within it. Advances the
        step. Empty when no program draws dropout masks."""
        if not self._uses_rng:
            return [None] * len(pieces)
        step, self.dropout_step = self.dropout_step, self.dropout_step + 1
        out = []
        for i, (a, k) in enumerate(pieces):
            rows = next((int(t.shape[0]) for t in list(a) + list(k.values()) if isinstance(t, torch.Tensor)
                         and t.ndim), 0)
            out.append(rng_state(self.config.dropout_seed, step, (self._batch_coord * len(pieces) + i) * rows,
                                 self._device))
        return out

    def _call_args(self, args: tuple, kwargs: dict, local: dict | None = None, rng=None) -> list:
        """The program's positional inputs for one piece of the batch (``rng``: its dropout input)."""
        local = local if local is not None else self._local_inputs()
        cap = self._compiled.captured
        user = list(args) + [kwargs[n] for n in cap.input_names[len(args):]]
        by_name = dict(zip(cap.user_inputs, user))
        by_name[RNG_INPUT] = rng
        return [local[n] if n in local else by_name[n] for n in self._placeholders]

    def _run(self, args: tuple, kwargs: dict, local: dict | None = None, rng=None):
        call = self._call_args(args, kwargs, local, rng)
        with ops.bind(self._comm):
            return self._program(*call)

    def _joint_step(self, args: tuple, kwargs: dict, local: dict, rng=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one piece on the joint program; weight gradients added into the
        fp32 buffers. Returns (loss sum, token count)."""
        call = self._call_args(args, kwargs, local, rng)
        runner = self._runner
        rec = self._comm.recorder  # the timeline (start_timeline): this call's F and B intervals
        t0 = rec.mark() if rec is not None else None
        outs, ctx = runner.forward(call)
        if rec is not None:
            rec.compute("F", t0)
        loss_sum, c = self._loss_parts(outs)
        jp = ctx.jp
        self._leaves.before_backward()
        t0 = rec.mark() if rec is not None else None
        grads = runner.backward(ctx, runner.tangents(ctx, outs, scale=self._loss_scale()))
        self._leaves.add_grads(call, jp.joint.grad_primals, grads, jp.ready_positions)
        if rec is not None:
            rec.compute("B", t0)
        self._leaves.after_backward()
        return loss_sum, c

    def _loss_parts(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        if self._token_weighted:
            loss_sum, count = out
            return loss_sum.float(), count.to(torch.float32)
        outs = out if isinstance(out, tuple | list) else (out,)
        if len(outs) != 1 or outs[0].ndim != 0:
            raise TypeError(f"train_step needs forward to return one scalar loss; the model's output is "
                            f"{getattr(self._compiled.captured, 'output', '') or 'not one'}: return the loss "
                            "from forward, or pass labels")
        (loss,) = outs
        return loss.float(), torch.ones((), dtype=torch.float32, device=loss.device)

    def _loss_scale(self) -> float:
        """The gradient the backward of a piece's loss sum starts from: 1, or under fp16 the loss scale over the
        tokens per piece (runtime/loss_scale.py: the scale of the mean, as Megatron's), else 1."""
        return self.loss_scaler.sum_scale() if self.loss_scaler is not None else 1.0

    def _backward_root(self, out) -> torch.Tensor:
        """The tensor an autograd backward starts from: the loss sum, times the loss scale under fp16."""
        loss_sum = self._loss_parts(out)[0]
        return loss_sum * self.loss_scaler.sum_scale() if self.loss_scaler is not None else loss_sum

    def _first_tokens_per_piece(self, args: tuple, kwargs: dict) -> None:
        """fp16, the first step (no count seen yet): the tokens per piece of a token-weighted loss estimated
        from the shapes of the global batch, the same on every rank — the largest integer input (token ids,
        labels) over data ranks x microbatches, ignored targets included (a ``inputs="local"`` slice counts as
        one of equal slices: the same estimate); 1 for a mean loss."""
        if not self._token_weighted:
            self.loss_scaler.tokens_per_piece = 1.0
            return
        ints = [t.numel() for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
        slices = self._batch_size if self.config.inputs == Inputs.LOCAL else 1
        self.loss_scaler.observe_tokens(max(ints, default=0) * slices / (self._data_size * self.config.microbatches))

    @torch.no_grad()
    def _check_overflow(self, count: torch.Tensor) -> bool:
        """fp16: whether any gradient of this step is inf or NaN on ANY rank of the job — the flag reduced
        with MAX over every rank (dp, tp, pp, ep, cp), so all skip together —; on an overflow every gradient
        is set to None (any optimizer's step then leaves the parameters and its state as they are). Updates
        the scale, and the tokens per piece from this step's global token count ``count`` (the same on every
        rank). One host read per step."""
        zero = self._zero
        grads = [b.owned_grad for b in zero.buckets if b.valid] if zero is not None else \
            [b.buf for b in self._leaves.buckets]
        from mcompile.runtime.loss_scale import nonfinite

        found = nonfinite(grads, self._device)
        if dist.get_world_size() > 1:
            with self._comm.timed("all_reduce", "world", found, "overflow"):
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        flag, tokens = torch.stack([found, count.float()]).tolist()
        overflow = bool(flag)
        if overflow:
            if zero is not None:
                zero.zero_grad(set_to_none=True)
            for p in self._params.values():
                p.grad = None
        self.loss_scaler.update(overflow)
        self.loss_scaler.observe_tokens(tokens / (self._data_size * self.config.microbatches))
        return overflow

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward + backward of the global batch; gradients accumulate into ``.grad``; returns the
        single-device loss of the global batch (detached 0-d tensor, no host sync)."""
        pieces = self._split(args, kwargs)
        rngs = self._rng_states(pieces)
        if self.loss_scaler is not None and self.loss_scaler.tokens_per_piece is None:
            self._first_tokens_per_piece(args, kwargs)
        if self._has_moe_ep:
            from mcompile.ir.moe import clear_stash

            clear_stash(self._comm)  # what a forward without backward (evaluation) left
        leaves = self._leaves
        leaves.begin()  # compute copies refreshed, main gradients cleared (earlier ones kept aside)
        rec = self._comm.recorder  # the timeline (start_timeline): this step's events replace the last one's
        if rec is not None:
            rec.begin_step()
        total = torch.zeros((), dtype=torch.float32, device=self._device)
        count = torch.zeros((), dtype=torch.float32, device=self._device)
        # backward: collectives, bucket launches; FP8 weights cast once for all microbatches of the step
        with ops.bind(self._comm, process_wide=True), grad_sink(leaves), self._fp8_step():
            if self._pipe is not None:  # the schedule's microbatches through this rank's stages
                pipe_stats = self._pipe.reduce_results(self._pipe.run(pieces, rngs=rngs))
                self._pipe.push_grads()  # weights tied across stages: summed, then their buckets reduce
                total, count = pipe_stats[0], pipe_stats[1]
            local = self._local_inputs() if self._pipe is None else None
            for i, (a, k) in enumerate(pieces if self._pipe is None else ()):
                leaves.armed = i == len(pieces) - 1
                if self._runner is not None:
                    loss_sum, c = self._joint_step(a, k, local, rngs[i])
                else:
                    t0 = rec.mark() if rec is not None else None
                    out = self._run(a, k, local, rngs[i])
                    loss_sum, c = self._loss_parts(out)
                    if rec is not None:
                        rec.compute("F", t0)
                        t0 = rec.mark()
                    self._backward_root(out).backward()
                    if rec is not None:
                        rec.compute("B", t0)
                total += loss_sum.detach()
                count += c
        leaves.armed = False
        stats = torch.stack([total, count])
        if self._data_size > 1:
            with self._comm.timed("all_reduce", "dp", stats):
                dist.all_reduce(stats, group=self._comm.groups["data"])
        # the gradients are sums over the tokens, times the loss scale (fp16): both divided out here, before any
        # clipping
        leaves.finish(1.0 / (stats[1] * self._loss_scale()), self._tp_partial)
        if self.loss_scaler is not None:
            self.step_skipped = self._check_overflow(stats[1])
        if self._has_moe_ep:
            from mcompile.ir.moe import MoEStats

            self.moe_dropped = MoEStats.of(self._comm)  # routed slots this rank's capacity dropped in this step
        return (stats[0] / stats[1]).detach()

    def _fp8_step(self):
        """FP8 linears: each weight's cast cached over this step's microbatches (kernels/fp8.py step_cache)."""
        if self.fp8 is None or not self.fp8.converted:
            return contextlib.nullcontext()
        from mcompile.kernels.fp8 import step_cache

        return step_cache()

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        """Forward only: the model's own output for the global batch (a loss: the global mean)."""
        self._leaves.refresh()
        if self._pipe is not None:
            return self._pipe_forward(args, kwargs)
        pieces = self._split(args, kwargs) if self.config.microbatches == 1 else None
        if pieces is None:
            raise ValueError("forward runs the whole local batch at once: use a Config with microbatches=1")
        out = self._run(*pieces[0], rng=self._rng_states(pieces)[0])
        loss_like = self._token_weighted or (isinstance(out, tuple | list) and len(out) == 1 and out[0].ndim == 0)
        if loss_like:
            total, count = self._loss_parts(out)
            stats = torch.stack([total, count])
            if self._data_size > 1:
                with self._comm.watch("all_reduce", "data"):
                    dist.all_reduce(stats, group=self._comm.groups["data"])
            return stats[0] / stats[1]
        outs = out if isinstance(out, tuple | list) else (out,)
        if self._batch_size > 1:  # the batch dim of each output, gathered over dp (and ep; cp's are whole)
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "batch") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    def _pipe_forward(self, args, kwargs):
        """Forward through the pipeline: every microbatch, outputs from the last stage to all ranks.

        The last stage concatenates its microbatches' outputs and broadcasts them over pp as tensors
        (nothing pickled): an int64 header (the number of outputs, then per output its dtype code,
        ndim and shape) sized by a one-element broadcast before it, then each output into a buffer
        the others allocate from the header."""
        with ops.bind(self._comm, process_wide=True):
            pieces = self._split(args, kwargs)
            results = self._pipe.run(pieces, forward_only=True, rngs=self._rng_states(pieces))
        if self._token_weighted:
            stats = self._pipe.reduce_results(results)
            if self._data_size > 1:  # every data rank's tokens: dp, cp (each rank's share of a sequence) and ep
                with self._comm.watch("all_reduce", "data"):
                    dist.all_reduce(stats, group=self._comm.groups["data"])
            return stats[0] / stats[1]
        dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)  # the wire codes: indices here
        src, group = self._pipe.peer_of_stage(self._pipe.k - 1), self._comm.groups["pp"]
        i64 = {"dtype": torch.int64, "device": self._device}
        if results:  # the last stage's rank
            per_mb = [o if isinstance(o, tuple | list) else (o,) for o in (results[i] for i in sorted(results))]
            # batch dims concatenated; a scalar (the pipeline's last stage returns one: its loss) is the
            # mean over the equal microbatches, as the single-device model's mean over the whole batch
            outs = tuple(torch.cat([mb[j] for mb in per_mb]) if per_mb[0][j].ndim else
                         torch.stack([mb[j] for mb in per_mb]).mean(0) for j in range(len(per_mb[0])))
            bad = [f"output #{j} is {o.dtype if isinstance(o, torch.Tensor) else type(o).__name__}"
                   for j, o in enumerate(outs) if not isinstance(o, torch.Tensor) or o.dtype not in dtypes]
            header = torch.tensor([len(outs)] + [x for o in outs for x in (dtypes.index(o.dtype), o.ndim, *o.shape)],
                                  **i64) if not bad else None
            size = torch.tensor([-1 if bad else header.numel()], **i64)
        else:
            bad, size = [], torch.zeros(1, **i64)
        with self._comm.watch("broadcast", "pp"):
            dist.broadcast(size, src=src, group=group)
        if int(size) < 0:  # every rank raises, none waits for a broadcast that will not come
            raise TypeError(f"forward under pipeline parallelism: {'; '.join(bad) or 'an output (see the last rank)'}"
                            f" of the model; outputs are broadcast as tensors of {', '.join(map(str, dtypes))}")
        if not results:
            header = torch.empty(int(size), **i64)
        with self._comm.watch("broadcast", "pp"):
            dist.broadcast(header, src=src, group=group)
        spec, at, bufs = header.tolist(), 1, []
        for j in range(spec[0]):
            code, ndim = spec[at], spec[at + 1]
            shape, at = spec[at + 2:at + 2 + ndim], at + 2 + ndim
            buf = outs[j].to(self._device).contiguous() if results else \
                torch.empty(shape, dtype=dtypes[code], device=self._device)
            with self._comm.watch("broadcast", "pp"):
                dist.broadcast(buf, src=src, group=group)
            bufs.append(buf)
        outs = tuple(bufs)
        if self.mesh.size("dp") > 1 and len(outs) == 1 and outs[0].ndim == 0:  # a loss: the mean over dp too
            loss = outs[0].float().clone()
            with self._comm.watch("all_reduce", "dp"):
                dist.all_reduce(loss, group=self._comm.groups["dp"])
            return loss / self.mesh.size("dp")
        if self.mesh.size("dp") > 1:
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "dp") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    # -- timeline ---------------------------------------------------------------------------------
    def start_timeline(self):
        """Record the timeline of the following steps (mcompile.ir.timeline), on any layout: per rank each
        forward and backward (under pp: every pipeline action and message wait), every collective
        (the programs', the dp gradient buckets', ZeRO's parameter all-gathers, the step's own) and
        every wait for a started one; the latest step is kept. Returns this rank's
        :class:`mcompile.ir.timeline.Recorder` (``.events()``: its events in seconds, e.g. for
        :func:`mcompile.ir.timeline.overlap_stats`). Recording stays on for this module's life."""
        from mcompile.ir.timeline import Recorder, clock_for

        rec = Recorder(self._rank, clock_for(self._device))
        self._comm.recorder = rec
        if self._pipe is not None:
            self._pipe.record = True
            self._pipe.events = []
        return rec

    def save_timeline(self, path) -> dict | None:
        """Gather every rank's recorded events; rank 0 writes a Chrome trace to ``path`` and returns
        it (other ranks return None). Collective: call it on every rank."""
        from mcompile.ir import timeline

        rec = self._comm.recorder
        if rec is None and self._pipe is None:
            raise ValueError("save_timeline: nothing was recorded; call pm.start_timeline() before the steps")
        mine = rec.events() if rec is not None else []
        if self._pipe is not None:
            mine += [dict(e.__dict__) for e in self._pipe.events if e.cat != "step"]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if self._rank != 0:
            return None
        meta = {"layout": self.mesh.spec(), "overlap": self.config.overlap, "zero": self.config.zero,
                "tp_overlap": self.config.tp_overlap, "microbatches": self.config.microbatches}
        if self._pipe is not None:
            meta.update({"schedule": self._pipe.schedule, "pp": self._pipe.pp, "virtual": self._pipe.virtual,
                         "microbatches": self._pipe.m, "bubble_formula": self.plan.pipeline.get("bubble")})
        timeline.save_trace(path, [e for r in everyone for e in r], meta)
        return timeline.load_trace(path)

    # -- programs ---------------------------------------------------------------------------------
    def recompute_choices(self) -> list:
        """``recompute="auto"``: what passes/remat.py chose for each program this rank runs, once the first
        step has compiled them (runtime/joint_runner.py ``RecomputeChoice``: the budget per microbatch, the
        forwards in flight it was divided by, the bytes saved, the ops recomputed); one per pipeline stage
        of this rank under pp. [] before the first step and under a named policy."""
        if self._pipe is not None:
            return self._pipe.recompute_choices()
        choice = self._runner.choice() if self._runner is not None else None
        return [choice] if choice is not None else []

    def program_code(self) -> str:
        return self._program.code


_SHAPE_ONLY = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default, torch.ops.aten.sym_numel.default,
               torch.ops.aten.sym_stride.int, torch.ops.aten.sym_stride.default}


def _reads_values(gm, names) -> bool:
    """Whether program ``gm`` uses any of its placeholders ``names`` other than through its shape."""
    names = set(names)
    return any(n.op == "placeholder" and n.name in names and any(u.target not in _SHAPE_ONLY for u in n.users)
               for n in gm.graph.nodes)


def _batched(t, batch) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == batch
