"""The cost model: what is priced and how (model: layouts, efficiencies, the profile's types, collective,
pipeline, memory and cp formulas, step terms), hardware profiles (hardware), and a model's profile and
estimate (workload: it plans the model through the compiler's model passes).

Layers (tests/test_layers.py): model and hardware are the cost layer, below the passes that price a choice;
workload is the estimate layer, above the compiler.

The public names (the __all__ of model and workload) load from their module on first use:
``from mcompile.cost import estimate, Layout`` keeps working.
"""

from mcompile import lazy_exports

_WHERE = {
    "Schedule": "mcompile.cost.model",
    "Recompute": "mcompile.cost.model",
    "Layout": "mcompile.cost.model",
    "Efficiency": "mcompile.cost.model",
    "DEFAULT_EFFICIENCY": "mcompile.cost.model",
    "ModelProfile": "mcompile.cost.model",
    "Estimate": "mcompile.cost.model",
    "recompute_envelope": "mcompile.cost.model",
    "auto_mix": "mcompile.cost.model",
    "activations_left": "mcompile.cost.model",
    "stage_auto": "mcompile.cost.model",
    "collective_time": "mcompile.cost.model",
    "axis_link": "mcompile.cost.model",
    "overlapped": "mcompile.cost.model",
    "dp_comm": "mcompile.cost.model",
    "resolve_precision": "mcompile.cost.model",
    "CP_VARIANTS": "mcompile.cost.model",
    "cp_comm": "mcompile.cost.model",
    "choose_cp_attention": "mcompile.cost.model",
    "Workload": "mcompile.cost.workload",
    "analyse": "mcompile.cost.workload",
    "estimate": "mcompile.cost.workload",
    "step_time_expr": "mcompile.cost.workload",
    "check_plan_matches": "mcompile.cost.workload",
    "example_seq": "mcompile.cost.workload",
}
lazy_exports(globals(), _WHERE)
