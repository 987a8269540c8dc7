"""Op coverage: aten ops with a sharding rule of ours (hand-written, or DTensor's through the bridge
in mcompile/sharding/rules/dtensor.py) against the ops torch's DTensor has a strategy for.

    python bench/op_coverage.py [--write] [--list]

Prints the counts; with ``--write`` writes bench/results/op_coverage.json; ``--list`` prints every op
DTensor covers that we do not, with the reason. Counts are of this torch's registries (read at run
time), not hard-coded.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
from pathlib import Path

import torch

from mcompile.sharding.rules import bridged_ops, registered_ops
from mcompile.sharding.rules.dtensor import dtensor_ops, refusal


def _kind(why: str) -> str:
    """The reason without the op-specific detail: "denied: untested", "mutates an argument ..."."""
    if why.startswith("denied: "):
        detail = why.split(": ", 1)[1]
        return "denied: " + ("untested" if "untested" in detail else "wrong against single-device execution")
    return why.split(" (")[0].split(":")[0]


def coverage() -> dict:
    ours = set(registered_ops())
    bridged = set(bridged_ops())
    dt = dtensor_ops()
    functional = {op for op in dt if not op._schema.is_mutable}
    not_covered = {op: refusal(op) for op in dt if op not in ours and op not in bridged}
    kinds = collections.Counter(_kind(why) for why in not_covered.values())
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ops_with_rule": len(ours | bridged),
        "hand_written": len(ours),
        "bridged_from_dtensor": len(bridged),
        "dtensor_ops": len(dt),
        "dtensor_functional_ops": len(functional),
        "dtensor_ops_we_cover": len(dt & (ours | bridged)),
        "dtensor_functional_ops_we_cover": len(functional & (ours | bridged)),
        "hand_written_not_in_dtensor": len(ours - dt),
        "dtensor_ops_not_covered": len(not_covered),
        "not_covered_by_reason": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "not_covered_functional": {str(op): why for op, why in sorted(not_covered.items(), key=lambda kv: str(kv[0]))
                                   if not op._schema.is_mutable},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write bench/results/op_coverage.json (else print only)")
    ap.add_argument("--list", action="store_true", help="print every functional DTensor op we do not cover")
    args = ap.parse_args()
    result = coverage()
    for k, v in result.items():
        if k != "not_covered_functional" and not isinstance(v, dict):
            print(f"{k:34s} {v}")
    print("not covered, by reason:")
    for why, count in result["not_covered_by_reason"].items():
        print(f"  {count:4d}  {why}")
    if args.list:
        for op, why in result["not_covered_functional"].items():
            print(f"  {op}: {why}")
    if args.write:
        path = Path(__file__).parent / "results" / "op_coverage.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
