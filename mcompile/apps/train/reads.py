"""What each rank reads of a batch: under ``data.read = "local"`` its rows (``pm.batch_rows``: the data-parallel
ranks, dp x ep, consecutive samples each) and, on a context-parallel rank, only the positions of each sequence its
programs read (``pm.input_positions``: mcompile/passes/cp/reads.py); a pipeline rank whose stages read only the
inputs' shapes reads nothing. Used by the training loop (mcompile/apps/train/loop.py) and by
:func:`mcompile.apps.evaluate.perplexity` under ``inputs="local"`` (``mcompile eval``)."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

__all__ = ["Reader"]


class Reader:
    """Each batch's model inputs on this rank: under ``data.read = "local"`` only its rows of the batch, and on a
    context-parallel rank only its positions of their sequences (:meth:`_share`), read alone; else the whole batch
    (from which ``pm`` picks the rows)."""

    def __init__(self, pm, objective, seq_len: int, local: bool):
        self.pm, self.objective, self.seq_len, self.local = pm, objective, seq_len, local
        self.blanks: dict[int, tuple] = {}  # a rank that reads nothing: its inputs' zeros, by batch size
        self.shares: dict[int, tuple] = {}  # by batch size: (window positions read, label positions counted, mode)

    def read(self, data, start: int, n: int) -> tuple[tuple, torch.Tensor | None]:
        """(the model inputs for samples ``start .. start + n - 1``, the tokens read; None where none were).

        Local: the rows ``pm.batch_rows(n)`` (consecutive samples), read as ``data.batch(start + first row,
        rows, columns=)`` with the window positions of the rank's share of each sequence (:meth:`_share`); a
        pipeline rank whose stages read no more of the inputs than their shapes (``pm.reads_inputs`` False: a
        middle stage) reads nothing and passes zeros of the inputs' shapes."""
        pm, objective = self.pm, self.objective
        if not self.local:
            tokens, targets = data.batch(start, n)
            return objective.inputs(tokens, targets, start), tokens
        rows = pm.batch_rows(n)
        if not pm.reads_inputs:
            return self._blank(n, rows), None
        window = self._share(data, n, rows)[0]
        tokens, targets = data.batch(start + rows.start, len(rows)) if window is None else \
            data.batch(start + rows.start, len(rows), columns=window)
        return objective.inputs(tokens, targets, start, rows=rows, batch=n), tokens

    def _blank(self, n: int, rows: range) -> tuple:
        if n not in self.blanks:
            zeros = torch.zeros((len(rows), self.seq_len), dtype=torch.int64)
            self.blanks[n] = tuple(torch.zeros_like(t) for t in self.objective.inputs(zeros, zeros, 0, rows=rows,
                                                                                       batch=n))
        return self.blanks[n]

    def _share(self, data, n: int, rows: range) -> tuple:
        """(the window positions this rank reads, None for all; the label positions it counts, None for all;
        how it counts: "share", "whole" or "none"), for batches of ``n`` samples.

        Context parallelism: a cp rank's programs read only some positions of each input's sequence (its tokens,
        and a neighbour a shifted label needs: ``pm.input_positions``), so it reads only the window positions
        the objective fills them from (``Objective.window_columns``): about 1/cp of each sequence. The cp ranks
        of one data rank count the labels as a partition ("share": each the positions it reads that no lower cp
        rank reads) when together they read every scored position; else each reads and counts its labels whole
        ("whole"), or, a pipeline rank whose stages read no label, counts none ("none")."""
        if n in self.shares:
            return self.shares[n]
        pm, objective, cp = self.pm, self.objective, self.pm.mesh.size("cp")
        columns = "columns" in inspect.signature(data.batch).parameters  # a data.factory's batch may not take them
        if cp == 1 or not columns:
            self.shares[n] = (None, None, "whole")
            return self.shares[n]
        piece = self._blank(n, rows)
        piece = tuple(t[:max(len(rows) // pm.config.microbatches, 1)] for t in piece)  # one microbatch's shapes
        me = pm.mesh.coords(dist.get_rank())["cp"]
        peers = [pm.input_positions(piece, k) for k in range(cp)]  # the same programs, run as each cp rank
        own, labels = peers[me], [p[1] for p in peers]
        scored = torch.arange(1 if objective.kind == "causal-lm" else 0, piece[1].shape[1])
        if all(p is not None for p in labels) and torch.isin(scored, torch.cat(labels)).all():
            lower = torch.cat([torch.zeros(0, dtype=torch.int64), *labels[:me]])
            counted = labels[me][~torch.isin(labels[me], lower)]
            self.shares[n] = (objective.window_columns(own, self.seq_len), counted, "share")
        elif pm.mesh.size("pp") > 1 and all(p is not None and not p.numel() for p in labels):
            self.shares[n] = (objective.window_columns(own, self.seq_len), None, "none")
        else:
            self.shares[n] = (objective.window_columns([own[0], None], self.seq_len), None, "whole")
        return self.shares[n]

    def counted(self, inputs: tuple, tokens: torch.Tensor | None, n: int, data) -> int:
        """The targets the model's mean averages over in the whole batch of ``n`` samples (read from ``data``).
        Local: each rank counts its rows (0 where it read nothing), a cp rank its share of their labels, scaled by
        cp (:meth:`_share`: the cp ranks' shares partition the rows' labels), and one all-reduce over the world sums
        (count, counters): every data rank has the same number of counting ranks, so the sum of the counts is the
        batch's times the counters over the data ranks (0 where no rank counts: a pipeline none of whose stages
        reads the labels)."""
        if not self.local:
            return self.objective.counted(inputs)
        mode, positions = "none", None
        if tokens is not None:
            _, positions, mode = self._share(data, n, self.pm.batch_rows(n))
        count = self.objective.counted(inputs, positions) if mode != "none" else 0
        if mode == "share":
            count *= self.pm.mesh.size("cp")
        if dist.get_world_size() == 1:
            return count
        data_ranks = n // len(self.pm.batch_rows(n))
        from mcompile.runtime.launch import uses_nccl

        device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl(dist.get_backend()) else "cpu"
        t = torch.tensor([count, int(mode != "none")], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        counts, counters = t.tolist()
        return counts // (counters // data_ranks) if counters else 0
