"""The composition matrix: every pair of features on a dense decoder, an MoE decoder and an encoder (4 layers each,
block repetition on), trained at parity or refused at plan time (tests/compositions_cases.py says what a feature,
a pair and a verdict are).

    python bench/compositions.py [--models dense,moe,encoder] [--subset] [--only a:b,...] [--write] [--out PATH]
    python bench/compositions.py --table [PATH]   # the markdown table of a recorded run, nothing run

Runs each cell serially on a gloo worker pool of 2 or 4 CPU processes (tests/conftest.py ``pool``: the pools stay
up between cells), 3 AdamW steps each against the single-device model. ``--subset``: the dense decoder runs every
pair; the MoE decoder and the encoder the pairs with one of :data:`PARTNERS` (ep for the MoE decoder, pp (1F1B) and
cp (allgather) for the encoder). Per cell the JSON keeps the verdict ("parity", "refused", "failed"), the mesh and
options, the largest relative errors (loss, clip norm, gradient: which one) or the refusal / failure text, and the
seconds the cell took (planning on every rank included). A long run rewrites its JSON after every cell (a temporary
file unless --write / --out) and prints the markdown table at the end; ``--update PATH`` reruns some cells of a record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _results  # noqa: E402

# the test helpers (tests/conftest.py pool, tests/compositions_cases.py): conftest drops the repository root and
# bench/ from sys.path (their kernels/ and kernels.py shadow the Hub's `kernels` package, which transformers imports)
sys.path.insert(0, str(HERE.parent / "tests"))
# conftest first: it sets sys.path, TRITON_INTERPRET and the capture cache folder
import conftest  # noqa: E402, F401, I001
import compositions_cases as C  # noqa: E402, I001

# under --subset, the pairs run for the MoE decoder and the encoder: those with one of these features. The MoE
# decoder's own feature is ep (ep against every other feature); the encoder's risks are the bidirectional attention
# with a padding mask under cp (allgather: the variant that takes an arbitrary mask) and its four inputs through the
# pipeline stages. Every other pair of theirs runs the same passes as the dense decoder's (tp, dp, ZeRO, recompute,
# fuse are per-op or per-parameter, not per-family).
PARTNERS = {"moe": ("ep",), "encoder": ("pp-1f1b", "cp-allgather")}


def subset(model: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in C.pairs(model) if a in PARTNERS[model] or b in PARTNERS[model]]


def cell_text(rec: dict) -> str:
    if rec["verdict"] == "parity":
        worst = max(rec["loss_rel_err"], rec["norm_rel_err"], rec["grad_rel_err"])
        return f"ok {worst:.0e}"
    if rec["verdict"] == "refused":
        return "refused"
    return "**FAIL**"


def table(records: list[dict]) -> str:
    """Markdown: per model, one row per pair (verdict, mesh, errors or the refusal's first sentence, seconds)."""
    lines = []
    for model in C.MODELS:
        recs = [r for r in records if r["model"] == model]
        if not recs:
            continue
        n = {v: sum(r["verdict"] == v for r in recs) for v in ("parity", "refused", "failed")}
        lines += [f"### {model} ({len(recs)} of its {len(C.pairs(model))} pairs run: {n['parity']} at parity, "
                  f"{n['refused']} refused, {n['failed']} failing)", "",
                  "| pair | mesh | options | verdict | worst rel. error / message | s |",
                  "|---|---|---|---|---|---|"]
        for r in recs:
            opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
            if r["verdict"] == "parity":
                msg = f"{max(r['loss_rel_err'], r['norm_rel_err'], r['grad_rel_err']):.1e}"
            else:
                msg = (r.get("refusal") or r.get("error") or "").replace("|", "\\|").replace("\n", " ")
                msg = msg[:220] + ("..." if len(msg) > 220 else "")
            lines.append(f"| {r['pair'][0]} × {r['pair'][1]} | {r['mesh']} | {opts} | {r['verdict']} | {msg} "
                         f"| {r['seconds']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(C.MODELS))
    ap.add_argument("--subset", action="store_true", help="every pair on the dense decoder, SUBSET on the others")
    ap.add_argument("--only", default=None, help="comma-separated a:b pairs (all models given)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a cell may take before it counts as a hang")
    ap.add_argument("--table", nargs="?", const=str(_results.RESULTS / "compositions.json"), default=None,
                    help="print the markdown table of a recorded JSON and exit")
    ap.add_argument("--update", default=None, metavar="PATH",
                    help="start from the cells recorded in PATH: the cells run now replace theirs, the others stay")
    _results.add_arguments(ap, "compositions")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["cells"]))
        return
    models = args.models.split(",")
    cells = []
    for model in models:
        todo = C.pairs(model)
        if args.subset and model != "dense":
            todo = subset(model)
        if args.only:
            want = {tuple(p.split(":")) for p in args.only.split(",")}
            todo = [p for p in todo if p in want or p[::-1] in want]
        cells += [(model, a, b) for a, b in todo]
    path = _results.destination("compositions", args.write, args.out, temporary=True)
    result = {"what": "pairs of features, 3 AdamW steps (lr 1e-4) against one device, fp32, rel <= 1e-5",
              "models": models, "subset": args.subset, "partners": PARTNERS if args.subset else None,
              "cells": []}
    kept = []
    if args.update:  # the recorded cells not run now, in their order, then the ones run now
        old = json.loads(Path(args.update).read_text())
        now = {(m, a, b) for m, a, b in cells}
        kept = [c for c in old["cells"] if (c["model"], *c["pair"]) not in now]
        result["models"] = sorted(set(old.get("models", [])) | set(models), key=C.MODELS.index)
        result["subset"] = old.get("subset", args.subset)
        result["partners"] = old.get("partners", result["partners"])
    result["cells"] = list(kept)
    t0 = time.perf_counter()
    try:
        for i, (model, a, b) in enumerate(cells):
            rec = C.run_pair(model, a, b, timeout=args.timeout)
            result["cells"].append(rec)
            print(f"[{i + 1}/{len(cells)} {time.perf_counter() - t0:.0f}s] {model} {a} x {b} ({rec['mesh']}): "
                  f"{cell_text(rec)} {rec['seconds']}s" + (f"\n    {(rec.get('refusal') or rec.get('error'))[:400]}"
                                                           if rec["verdict"] != "parity" else ""), flush=True)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            _results.save("compositions", result, True, path)
    finally:
        conftest.pytest_sessionfinish(None, 0)  # close the worker pools
    order = {(m, a, b): i for i, (m, (a, b)) in enumerate((m, p) for m in C.MODELS for p in C.pairs(m))}
    result["cells"].sort(key=lambda c: order.get((c["model"], *c["pair"]), len(order)))
    _results.save("compositions", result, True, path)
    print(table(result["cells"]))


if __name__ == "__main__":
    main()
