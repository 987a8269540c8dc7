"""Process replay (issue 39): the programs every rank runs, printed for reference models and layouts, so a
refactor of the compiler can show that it changed nothing, or name what it changed.

``python scripts/replay.py --out DIR`` writes one file per (case, rank): ``mcompile show MODEL --mesh ...
--rank R --after codegen`` (the per-rank forward and backward programs, under pp each stage's, traced on fake
tensors: no memory, no communication). ``python scripts/replay.py --compare OLD NEW`` diffs two such folders
and exits 1 when any program differs, printing the first differing lines of each.

The cases cover tp, sequence parallelism, dp with gradient buckets, ZeRO-3, pp under each schedule, cp, ep,
the fusion pass, FP8 and recompute, on the dense decoder (``llama3-tiny``), the MoE decoder (``mixtral-tiny``)
and the encoder (``bert-tiny``). A case the compiler refuses is recorded with its error, so a refusal that
appears or goes away is a difference too.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import sys
from pathlib import Path

# (name, model, mesh, extra CLI flags)
CASES: list[tuple[str, str, str, list[str]]] = [
    ("llama_tp2", "llama3-tiny", "tp=2", []),
    ("llama_tp2_sp", "llama3-tiny", "tp=2", ["--sp"]),
    ("llama_dp2", "llama3-tiny", "dp=2", []),
    ("llama_dp2_zero3", "llama3-tiny", "dp=2", ["--zero", "3"]),
    ("llama_pp2_1f1b", "llama3-tiny", "pp=2", ["--schedule", "1f1b", "--microbatches", "2"]),
    ("llama_pp2_gpipe", "llama3-tiny", "pp=2", ["--schedule", "gpipe", "--microbatches", "2"]),
    ("llama_pp2_interleaved", "llama3-tiny", "pp=2", ["--schedule", "interleaved", "--virtual", "2",
                                                      "--microbatches", "2"]),
    ("llama_pp2_zbh1", "llama3-tiny", "pp=2", ["--schedule", "zbh1", "--microbatches", "2"]),
    ("llama_cp2", "llama3-tiny", "cp=2", []),
    ("llama_tp2_fuse", "llama3-tiny", "tp=2", ["--fuse"]),
    ("llama_tp2_fp8", "llama3-tiny", "tp=2", ["--fp8", "current"]),
    ("llama_tp2_recompute_full", "llama3-tiny", "tp=2", ["--recompute", "full"]),
    ("mixtral_ep2", "mixtral-tiny", "ep=2", []),
    ("mixtral_tp2", "mixtral-tiny", "tp=2", []),
    ("bert_tp2", "bert-tiny", "tp=2", []),
]
SEQ, BATCH = "32", "2"


def ranks_of(mesh: str) -> int:
    n = 1
    for part in mesh.split(","):
        n *= int(part.split("=")[1])
    return n


def show(model: str, mesh: str, flags: list[str], rank: int) -> str:
    """``mcompile show`` in this process; its stdout, or the error it raised."""
    from mcompile.apps.cli import main

    out = io.StringIO()
    argv = ["show", model, "--mesh", mesh, "--rank", str(rank), "--after", "codegen", "--seq", SEQ, "--batch",
            BATCH, *flags]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(argv)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a refusal is part of the record)
        return f"# refused: {type(e).__name__}: {e}\n"
    return out.getvalue() + ("" if not rc else f"# exit status {rc}\n")


def write(out: Path, only: set[str] | None) -> None:
    import warnings

    warnings.simplefilter("ignore")
    out.mkdir(parents=True, exist_ok=True)
    for name, model, mesh, flags in CASES:
        if only and name not in only:
            continue
        for rank in range(ranks_of(mesh)):
            text = show(model, mesh, flags, rank)
            (out / f"{name}.rank{rank}.py").write_text(text)
            print(f"{name} rank {rank}: {len(text.splitlines())} lines", flush=True)


def compare(old: Path, new: Path) -> int:
    names = sorted({p.name for p in old.glob("*.py")} | {p.name for p in new.glob("*.py")})
    bad = 0
    for n in names:
        a, b = old / n, new / n
        if not a.exists() or not b.exists():
            print(f"{n}: only in {'new' if not a.exists() else 'old'}")
            bad += 1
            continue
        x, y = a.read_text().splitlines(), b.read_text().splitlines()
        if x != y:
            bad += 1
            diff = list(difflib.unified_diff(x, y, str(a), str(b), lineterm="", n=1))
            print(f"{n}: differs ({len(diff)} diff lines)")
            print("\n".join(diff[:20]))
    print(f"{len(names) - bad} of {len(names)} programs identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the programs into this folder")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out DIR or --compare OLD NEW")
    write(args.out, set(args.only.split(",")) if args.only else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
