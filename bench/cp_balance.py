"""Causal load balance of context parallelism: per-rank attention FLOPs, the load-balanced layout against
the naive contiguous split, counted by the kernel itself.

    python bench/cp_balance.py [--cp 2 4 8] [--seq 1024 4096] [--variants ring allgather]
                               [--batch 1] [--heads 4] [--head-dim 16] [--write] [--out PATH]

For every variant, sequence length s and cp = n, ``mcompile.passes.cp.ops.cp_attention`` (causal, forward) runs on
n simulated ranks in one process (:class:`mcompile.runtime.sim.ThreadedWorld`, one thread a rank, each
with its communicator bound), every rank holding its tokens of random global q, k, v (batch ``--batch``,
``--heads`` query heads = kv heads, ``--head-dim``) in

- the load-balanced layout (``balanced=True``: 2n chunks of c = s / 2n tokens, rank r holds chunks r and
  2n − 1 − r), and
- the contiguous split (``balanced=False``: rank r holds tokens [r s/n, (r + 1) s/n)).

The count is the kernel's own (:class:`mcompile.passes.cp.ops.CPStats`, reset per rank before the call, read after):
the (query, key) score pairs each rank computed, at chunk granularity — a fully visible chunk pair c·c,
a diagonal one c(c + 1)/2 (causal inside the chunk), an invisible one nothing, as a kernel that skips
masked tiles does — times batch × heads (``CPStats.elements``). Attention FLOPs = 4 · head_dim · that:
2·d per score for QKᵀ and 2·d for PV, forward only (the softmax's exp / max / sum are not counted; the
backward repeats the same pairs, so its balance is the forward's).

Expected, and checked in the JSON (``checks``): the diagonal chunks count the causal triangle exactly, so
the ranks' sum is s(s + 1)/2 pairs per (batch, head) under both layouts; balanced, every rank computes
s(s + 1)/(2n) — chunk r sees r whole chunks and its diagonal, chunk 2n − 1 − r sees 2n − 1 − r and its
diagonal: (2n − 1)c² + c(c + 1) = c(2nc + 1) — so the spread is exactly 0; contiguous (chunks of
L = s/n), rank i computes i·L² + L(L + 1)/2, max/min = ((n − 1)·L² + L(L + 1)/2) / (L(L + 1)/2) =
(2(n − 1)L + L + 1)/(L + 1) ≈ 2n − 1.

The ``a2a`` (Ulysses) variant is not run: it splits heads, not the sequence, so every rank computes the
whole causal triangle for hq/n heads under either layout (balanced by construction; and it needs n | hq).
Counts only, no timing: the threads share this machine's cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_results", Path(__file__).resolve().parent / "_results.py")
_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_results)  # bench/ is not left on sys.path (bench/kernels.py would shadow `kernels`)

NAME = "cp_balance"
LAYOUTS = {"balanced": True, "contiguous": False}


def flops_of(elements: int, head_dim: int) -> int:
    """Forward attention FLOPs of ``elements`` score elements: QKᵀ (2·d) and PV (2·d) each."""
    return 4 * head_dim * elements


def expected_pairs(seq: int, n: int, balanced: bool) -> list[int]:
    """Per rank, the (query, key) pairs per (batch, head) the chunked causal kernel computes (module docstring)."""
    if balanced:
        c = seq // (2 * n)
        return [c * (2 * n * c + 1)] * n
    L = seq // n
    return [i * L * L + L * (L + 1) // 2 for i in range(n)]


def count(variant: str, seq: int, n: int, balanced: bool, *, batch: int, heads: int, head_dim: int,
          seed: int = 0) -> list[tuple[int, int]]:
    """Run causal ``cp_attention`` (forward) on n simulated ranks: per rank (pairs, elements) from CPStats."""
    import torch

    from mcompile.ir import ops
    from mcompile.ir.mesh import Mesh
    from mcompile.passes.cp import ops as cp
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(3))
    scale = head_dim ** -0.5

    def rank(r):
        comm = ops.current()
        cp.CPStats.reset(comm)
        pos = cp.local_positions(seq, n, r, balanced)
        with torch.no_grad():
            out, _ = cp.cp_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], None, "cp", n, variant, True, scale,
                                     balanced)
        assert out.shape == (batch, heads, seq // n, head_dim)
        return cp.CPStats.of(comm), cp.CPStats.elements(comm)

    return run_threads(ThreadedWorld(Mesh(cp=n)), rank)


def summary(flops: list[int]) -> dict:
    lo, hi, mean = min(flops), max(flops), statistics.fmean(flops)
    return {"flops_per_rank": flops, "max_flops": hi, "min_flops": lo, "max_over_min": hi / lo,
            "spread": (hi - lo) / mean}


def measure(variants, seqs, cps, *, batch: int, heads: int, head_dim: int) -> list[dict]:
    rows = []
    for variant in variants:
        for seq in seqs:
            for n in cps:
                row = {"variant": variant, "seq": seq, "cp": n, "checks": {}}
                total = seq * (seq + 1) // 2
                for name, balanced in LAYOUTS.items():
                    t = time.perf_counter()
                    got = count(variant, seq, n, balanced, batch=batch, heads=heads, head_dim=head_dim)
                    pairs = [p for p, _ in got]
                    elements = [e for _, e in got]
                    row[name] = {"pairs_per_rank": pairs, "elements_per_rank": elements,
                                 **summary([flops_of(e, head_dim) for e in elements]),
                                 "expected_pairs_per_rank": expected_pairs(seq, n, balanced),
                                 "wall_s": time.perf_counter() - t}
                    row["checks"][f"{name}_pairs_as_expected"] = pairs == expected_pairs(seq, n, balanced)
                    row["checks"][f"{name}_sum_is_causal_total"] = sum(pairs) == total
                    row["checks"][f"{name}_elements_are_pairs_x_batch_heads"] = all(
                        e == p * batch * heads for p, e in zip(pairs, elements))
                row["causal_pairs_total"] = total
                row["causal_flops_total"] = flops_of(total * batch * heads, head_dim)
                row["contiguous_max_over_min_expected"] = max(row["contiguous"]["expected_pairs_per_rank"]) / min(
                    row["contiguous"]["expected_pairs_per_rank"])
                row["checks"]["balanced_spread_within_1pct"] = row["balanced"]["spread"] <= 0.01
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Per rank, balanced | contiguous side by side, for every (variant, seq, cp); then one line each."""
    lines = []
    head = f"{'variant':<10}{'seq':>6}{'cp':>4}{'rank':>9} | {'balanced GFLOP':>15} | {'contiguous GFLOP':>17}"
    for row in rows:
        lines += ["", head, "-" * len(head)]
        lead = f"{row['variant']:<10}{row['seq']:>6}{row['cp']:>4}"
        b, c = row["balanced"], row["contiguous"]
        for r, (fb, fc) in enumerate(zip(b["flops_per_rank"], c["flops_per_rank"])):
            lines.append(f"{lead}{r:>9} | {fb / 1e9:>15.6f} | {fc / 1e9:>17.6f}")
        pad = " " * len(lead)
        lines.append(f"{pad}{'max/min':>9} | {b['max_over_min']:>15.4f} | {c['max_over_min']:>17.4f}")
        lines.append(f"{pad}{'spread':>9} | {b['spread']:>15.2%} | {c['spread']:>17.2%}")
    lines += ["", "summary: per-rank attention FLOPs (forward), balanced | contiguous",
              f"{'variant':<10}{'seq':>6}{'cp':>4} | {'max/min':>8} {'spread':>8} | {'max/min':>8} {'spread':>8} "
              f"{'expected':>9} | {'sum = s(s+1)/2':>14}  checks"]
    for row in rows:
        b, c, ch = row["balanced"], row["contiguous"], row["checks"]
        total_ok = ch["balanced_sum_is_causal_total"] and ch["contiguous_sum_is_causal_total"]
        bad = [k for k, v in ch.items() if not v]
        lines.append(f"{row['variant']:<10}{row['seq']:>6}{row['cp']:>4} | {b['max_over_min']:>8.4f} "
                     f"{b['spread']:>8.2%} | {c['max_over_min']:>8.4f} {c['spread']:>8.2%} "
                     f"{row['contiguous_max_over_min_expected']:>9.4f} | {'yes' if total_ok else 'NO':>14}  "
                     f"{'pass' if not bad else 'FAIL ' + ', '.join(bad)}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--variants", nargs="+", default=["ring", "allgather"], choices=["ring", "allgather"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    _results.add_arguments(ap, NAME)
    args = ap.parse_args(argv)
    for s in args.seq:
        for n in args.cp:
            if s % (2 * n):
                ap.error(f"--seq {s} does not divide by 2 x cp = {2 * n} (the balanced layout's chunks)")

    import torch

    t0 = time.perf_counter()
    rows = measure(args.variants, args.seq, args.cp, batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    wall = time.perf_counter() - t0
    print(table(rows))
    out = {
        "benchmark": NAME,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**_results.machine(), "torch": torch.__version__, "simulator": "mcompile.runtime.sim threads"},
        "commit": _results.commit(),
        "settings": {"cp": args.cp, "seq": args.seq, "variants": args.variants, "batch": args.batch,
                     "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim, "causal": True,
                     "dtype": "float32"},
        "method": {
            "count": "mcompile.passes.cp.ops.CPStats per rank (reset before, read after one causal cp_attention "
                     "forward on "
                     "the threaded simulator): the kernel's own count of (query, key) pairs per (batch, head) at "
                     "chunk granularity (full chunk pair c*c, diagonal c(c+1)/2, invisible 0); elements = pairs x "
                     "batch x heads",
            "flops": "4 * head_dim * elements: QK^T (2*d per score) + PV (2*d per score), forward only; softmax not "
                     "counted; the backward visits the same pairs, so it is balanced the same way",
            "spread": "(max - min) / mean of the per-rank FLOPs; max_over_min = max / min",
            "total": "the diagonal chunks count the causal triangle exactly: the per-rank sum is s(s+1)/2 pairs per "
                     "(batch, head) under both layouts (checks.*_sum_is_causal_total)",
            "expected": "balanced: s(s+1)/(2 cp) every rank; contiguous (L = s/cp): rank i computes i*L^2 + L(L+1)/2",
            "not_run": "a2a (Ulysses) splits heads, not the sequence: every rank computes the whole causal triangle "
                       "for hq/cp heads, balanced by construction under either layout",
        },
        "rows": rows,
        "all_checks_pass": all(all(r["checks"].values()) for r in rows),
        "wall_s": wall,
    }
    _results.save(NAME, out, args.write, args.out)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["all_checks_pass"] else 1)
