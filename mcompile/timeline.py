"""Pipeline timelines: Chrome-trace JSON from the runtime's events, the measured bubble, a PNG.

The runtime records, per rank, the start and end (wall clock) of every forward (F), backward (B),
weight-gradient (W) action and every wait for a message (``pm.start_timeline()``; all ranks'
events are gathered by ``pm.save_timeline(path)``). The trace opens in ``chrome://tracing`` or
Perfetto: one process per rank, compute on thread 0, waits on thread 1. ``mcompile timeline``
draws it with matplotlib.

The measured bubble of a rank is the part of the step (first action start to last action end
over all ranks) in which it computes nothing: ``1 - busy / span``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["chrome_trace", "save_trace", "load_trace", "bubble", "draw"]

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#C0C0C0"}


def chrome_trace(events: list[dict], meta: dict | None = None) -> dict:
    """Events (dicts with rank, name, cat, start, end in seconds) -> a Chrome trace."""
    compute = [e for e in events if e["cat"] in ("F", "B", "W", "wait")]
    t0 = min((e["start"] for e in compute), default=0.0)
    trace = []
    for e in compute:
        trace.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": e["rank"],
                      "tid": 1 if e["cat"] == "wait" else 0, "ts": (e["start"] - t0) * 1e6,
                      "dur": max(0.0, e["end"] - e["start"]) * 1e6,
                      "args": {"stage": e.get("stage", -1), "microbatch": e.get("mb", -1)}})
    for r in sorted({e["rank"] for e in compute}):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta or {}}


def save_trace(path, events: list[dict], meta: dict | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events, meta)))
    return path


def load_trace(path) -> dict:
    return json.loads(Path(path).read_text())


def bubble(trace: dict) -> dict[int, float]:
    """Idle fraction of each rank over the step's span (compute events only)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "B", "W")]
    if not ev:
        return {}
    start = min(e["ts"] for e in ev)
    end = max(e["ts"] + e["dur"] for e in ev)
    busy: dict[int, float] = {}
    for e in ev:
        busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"]
    return {r: 1.0 - b / (end - start) for r, b in sorted(busy.items())}


def draw(trace: dict, out, title: str | None = None) -> Path:
    """A Gantt chart of the trace: one row per rank, F/B/W coloured, labelled stage.microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in ev})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in ev:
        y = ranks.index(e["pid"])
        h, dy = (0.8, 0.0) if e["cat"] != "wait" else (0.2, -0.45)
        ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + dy - h / 2 + (0.45 if e["cat"] == "wait" else 0), h),
                       facecolors=_COLORS.get(e["cat"], "#999999"), edgecolor="white", linewidth=0.5)
        if e["cat"] != "wait" and e["dur"] > 0:
            a = e.get("args", {})
            ax.text((e["ts"] + e["dur"] / 2) / 1e3, y, f"{e['cat']}{a.get('stage', '')}.{a.get('microbatch', '')}",
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    b = bubble(trace)
    meta = trace.get("otherData", {})
    mean = sum(b.values()) / len(b) if b else 0.0
    ax.set_title(title or f"{meta.get('schedule', 'pipeline')}: measured bubble {mean:.1%}"
                 + (f" (formula {meta['bubble_formula']:.1%})" if "bubble_formula" in meta else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward (input)", "backward (weight)", "waiting"], loc="upper right",
              fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
