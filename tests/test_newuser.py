"""Issue 18, "found trying it as a new user would": each item as a test.

1. ``mc.estimate`` prices a Plan with the module it was made from (the plan records its example
   inputs), a compiled plan at its example inputs' sequence, and refuses another model's numbers.
2. ``mc.search`` results are ``(layout, estimate)`` pairs: unpacked, indexed, iterated.
3. ``plan="auto"`` picks only ZeRO levels the guide's plain loop trains with (ZeRO-1/2 need the
   DistributedOptimizer: opt in with ``distributed_optimizer=True``).
4. ``mcompile plan``'s memory table and ``--gpu``'s peak count the same model state, labelled.
5. The CLI: ``module:factory`` from the current folder, duplicate mesh axes, "did you mean", stage
   cuts in layers, a fast ``--help``.
6. Bench scripts write their committed JSON only when asked (bench/_results.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mcompile as mc
from mcompile.models import get_preset

from conftest import build, pool

ROOT = Path(__file__).resolve().parents[1]


def _tiny():
    pre = get_preset("llama3-tiny")
    torch.manual_seed(0)
    return pre.build(), pre.example_inputs(batch=2, seq=16)


# --------------------------------------------------------------------------- 1. estimate a plan
@pytest.mark.timeout(240)
def test_estimate_prices_a_plan_with_its_module_and_refuses_another_models():
    """The plan records its example inputs: ``estimate(plan, module)`` prices it (seq = the inputs'
    16) with the numbers the preset's name gives; ``estimate(plan)`` says what to pass; another
    preset (other names, or the same names with other shapes) is an error, never a silent price."""
    model, inputs = _tiny()
    plan = mc.plan(model, mc.Mesh(dp=2, tp=2), inputs, sequence_parallel=True)
    assert [(i.name, i.shape, i.dtype) for i in plan.inputs] == [("idx", (2, 16), "int64"),
                                                                 ("targets", (2, 16), "int64")]
    with pytest.raises(ValueError, match=r"estimate\(plan, model\)"):
        mc.estimate(plan, hardware="h100", global_batch=8)
    by_module = mc.estimate(plan, model, hardware="h100", global_batch=8)
    by_name = mc.estimate(plan, "llama3-tiny", hardware="h100", global_batch=8)
    assert by_module.seq == by_name.seq == 16  # the example inputs', not the preset's maximum (128)
    assert by_module.step_time_s == pytest.approx(by_name.step_time_s, rel=1e-12)
    assert by_module.memory_bytes == pytest.approx(by_name.memory_bytes, rel=1e-12)
    with pytest.raises(ValueError, match="different parameters"):
        mc.estimate(plan, "gpt2-tiny", hardware="h100", global_batch=8)
    with pytest.raises(ValueError, match="differ in shape: layers.#.attention.wk.weight"):
        mc.estimate(plan, "llama3-8b", hardware="h100", global_batch=8)


@pytest.mark.timeout(120)
def test_estimate_of_the_guides_compiled_plan_takes_its_inputs_sequence():
    model, inputs = _tiny()
    compiled = mc.compile_plan(model, mc.Mesh(tp=2), inputs, sequence_parallel=True)
    est = mc.estimate(compiled, hardware="h100", global_batch=8)
    assert est.seq == 16 and est.step_time_s > 0
    assert mc.estimate(compiled, hardware="h100", global_batch=8, seq=32).seq == 32  # given: it wins


def test_plan_json_carries_the_inputs_and_loads_plans_saved_before():
    from mcompile.ir.plan import InputSpec, Plan, input_specs

    model, inputs = _tiny()
    compiled = mc.compile_plan(model, mc.Mesh(tp=2), inputs)
    plan = compiled.plan
    plan.inputs = input_specs(["idx", "targets"], inputs)  # what compile_plan records
    again = Plan.from_json(plan.to_json())
    assert again.inputs == [InputSpec("idx", (2, 16), "int64"), InputSpec("targets", (2, 16), "int64")]
    assert again.to_json() == plan.to_json() and again.example_batch_seq == (2, 16)
    old = json.loads(plan.to_json())
    del old["inputs"]  # a plan saved before the field existed
    assert Plan.from_json(json.dumps(old)).inputs == []
    assert input_specs(["x", "mask"], (torch.ones(3, 5),), {"mask": torch.ones(3, 5, dtype=torch.bool)}) == [
        InputSpec("x", (3, 5), "float32"), InputSpec("mask", (3, 5), "bool")]


# --------------------------------------------------------------------------- 2. search results are pairs
@pytest.mark.timeout(120)
def test_search_results_are_layout_estimate_pairs():
    from mcompile.cost.model import Estimate, Layout

    res = mc.search("gpt2-small", world=8, hardware="a100", global_batch=64, seq=1024, top_k=3)
    layout, est = res[0]
    assert (res[0][0], res[0][1]) == (layout, est) and len(res[0]) == 2 and tuple(res[0]) == (layout, est)
    assert isinstance(layout, Layout) and isinstance(est, Estimate)
    pairs = [(lay, e) for lay, e in res]
    assert [e.step_time_s for _, e in pairs] == sorted(e.step_time_s for _, e in pairs)
    assert len(repr(res[0])) < 300 and repr(res[0]).startswith("Candidate(")  # not the whole hardware profile


# --------------------------------------------------------------------------- 3. plan="auto" and the plain loop
def _plain_loop(rank, world, steps, lr):
    """The guide's loop after ``plan="auto"``: a torch optimizer over pm.parameters()."""
    model, inputs = build("llama3-tiny", batch=4)
    pm = mc.parallelize(model, example_inputs=inputs, plan="auto")
    return _train(pm, torch.optim.AdamW(pm.parameters(), lr=lr), inputs, steps)


def _train(pm, opt, inputs, steps):
    """``steps`` steps of the guide's loop: the losses, the ZeRO level and the mesh that ran them."""
    losses = []
    for _ in range(steps):
        losses.append(pm.train_step(*inputs).item())
        opt.step()
        opt.zero_grad()
    return losses, pm.config.zero, dict(pm.mesh.axes)


def _distributed_loop(rank, world, steps, lr):
    """ZeRO allowed (``auto_layout(distributed_optimizer=True)``, what parallelize runs on rank 0 with
    the option), then the guide's ZeRO-1 loop: a DistributedOptimizer."""
    from mcompile.runtime.zero import DistributedOptimizer
    from mcompile.search import auto_layout

    model, inputs = build("llama3-tiny", batch=4)
    axes, options, _ = auto_layout(model, world, inputs, None, {}, distributed_optimizer=True)
    pm = mc.parallelize(model, mc.Mesh(**axes), inputs, **options)
    return _train(pm, DistributedOptimizer(pm, torch.optim.AdamW, lr=lr), inputs, steps)


def _reference(steps, lr):
    model, inputs = build("llama3-tiny", batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.timeout(300)
def test_auto_chooses_zero_levels_the_users_optimizer_supports():
    """On cpu-gloo the search's best layout for the tiny Llama on 4 ranks is ZeRO-1 when it may choose it;
    by default it may not (the plain loop would stop at train_step), and with distributed_optimizer=True
    it does."""
    from mcompile.search import auto_layout

    model, inputs = build("llama3-tiny", batch=4)
    _, plain, _ = auto_layout(model, 4, inputs, None, {})
    _, sharded, _ = auto_layout(model, 4, inputs, None, {}, distributed_optimizer=True)
    assert plain["zero"] == 0 and sharded["zero"] == 1


@pytest.mark.slow  # 4 processes, a search and a pipeline compile (minutes on 2 cores); the choice is checked above
@pytest.mark.timeout(600)
def test_plan_auto_trains_with_the_guides_plain_loop():
    """parallelize(plan="auto") on 4 gloo processes, then ``torch.optim.AdamW(pm.parameters())``: it
    trains, with the single-device losses (fp32, lr 1e-4: 1e-5 as tests/test_search.py)."""
    lr, steps = 1e-4, 3
    ref = _reference(steps, lr)
    for losses, zero, _ in pool(4).run(_plain_loop, steps, lr):
        assert zero == 0
        assert losses == pytest.approx(ref, rel=1e-5, abs=0)


@pytest.mark.slow  # the ZeRO-1 side of the same choice; tests/test_zero.py covers ZeRO-1's numbers
@pytest.mark.timeout(600)
def test_plan_auto_with_zero_trains_with_the_distributed_optimizer():
    lr, steps = 1e-4, 3
    ref = _reference(steps, lr)
    for losses, zero, axes in pool(4).run(_distributed_loop, steps, lr):
        assert zero == 1 and axes == {"dp": 4}
        assert losses == pytest.approx(ref, rel=1e-5, abs=0)


# --------------------------------------------------------------------------- 4. memory: table and --gpu agree
@pytest.mark.timeout(180)
def test_plan_memory_table_and_gpu_peak_count_the_same_model_state(capsys):
    from mcompile.apps.cli import main
    from mcompile.ir.plan import MODEL_STATE_TITLE

    assert main(["plan", "gpt2-small", "--mesh", "tp=2", "--seq", "1024", "--gpu", "h100", "--json"]) == 0
    out = capsys.readouterr()
    table_gib = json.loads(out.out)["memory_per_rank"]["total"] / 2**30
    m = re.search(r"= model state ([\d.]+) GiB \(float32 parameters, fp32 gradients, AdamW: the memory table\) "
                  r"\+ activations ([\d.]+)", out.err)
    assert m, out.err
    assert float(m.group(1)) == pytest.approx(table_gib, abs=0.006)  # printed to 2 decimals
    peak = float(re.search(r"peak memory of the largest rank ([\d.]+) GiB", out.err).group(1))
    assert peak >= float(m.group(1)) + float(m.group(2)) - 0.02
    assert "no activations" in MODEL_STATE_TITLE
    assert main(["plan", "llama3-tiny", "--mesh", "tp=2"]) == 0
    assert "model state only" in capsys.readouterr().out


# --------------------------------------------------------------------------- 5. the command line
@pytest.mark.timeout(60)
def test_a_factory_in_the_current_folder_is_found_in_process(tmp_path, monkeypatch, capsys):
    """The rule the console script needs, in this process: with neither '' nor the current folder on
    sys.path (a console script's sys.path[0] is its bin/ folder), `plan pkg.models:make_model` run from
    the folder holding pkg/ finds it."""
    from mcompile.apps.cli import main

    pkg = tmp_path / "mypkg_in_cwd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("from mcompile.models import get_preset\n\n\ndef make_model():\n"
                                   "    return get_preset('llama3-tiny').build()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["plan", "mypkg_in_cwd.models:make_model", "--mesh", "tp=2", "--seq", "16"]) == 0
    assert "layers.*.attention.wq.weight" in capsys.readouterr().out


@pytest.mark.slow  # a subprocess importing torch; the rule itself is checked in-process above
@pytest.mark.timeout(120)
def test_console_script_finds_a_factory_in_the_current_folder(tmp_path):
    script = Path(sys.executable).with_name("mcompile")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (mcompile not installed in this environment)")
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(textwrap.dedent("""
        from mcompile.models import get_preset

        def make_model():
            return get_preset("llama3-tiny").build()
    """))
    proc = subprocess.run([str(script), "plan", "mypkg.models:make_model", "--mesh", "tp=2", "--seq", "16"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layers.*.attention.wq.weight" in proc.stdout


def test_duplicate_mesh_axes_are_refused(capsys):
    from mcompile.apps.cli import main

    with pytest.raises(ValueError, match="gives axis 'tp' twice"):
        mc.Mesh.parse("tp=2,tp=4")
    assert main(["plan", "llama3-tiny", "--mesh", "tp=2,tp=4"]) == 2
    assert "gives axis 'tp' twice (tp=2 and tp=4)" in capsys.readouterr().err


def test_near_miss_model_names_get_a_suggestion(capsys):
    from mcompile.apps.cli import main

    with pytest.raises(ValueError, match=r"unknown model preset 'llama3-8B' \(did you mean 'llama3-8b'\?\)"):
        get_preset("llama3-8B")
    with pytest.raises(ValueError) as e:
        get_preset("resnet50")
    assert "did you mean" not in str(e.value)
    assert main(["plan", "llama3-tiyn", "--mesh", "tp=2"]) == 2
    assert "did you mean 'llama3-tiny'?" in capsys.readouterr().err
    assert main(["search", "gpt2-smal", "--gpus", "8", "--global-batch", "8"]) == 2
    assert "did you mean 'gpt2-small'?" in capsys.readouterr().err


def test_stage_cuts_print_as_layer_positions(capsys):
    from mcompile.apps.cli import main
    from mcompile.apps.report import stage_span
    from mcompile.ir.plan import cut_position

    assert main(["plan", "llama3-tiny", "--mesh", "pp=2", "--microbatches", "2", "--seq", "16",
                 "--granularity", "layer"]) == 0
    out = capsys.readouterr().out
    assert "cut 1: stage 1 starts after layer 0 (captured node " in out
    assert "embedding, layer 0" in out and "layer 1, head" in out and "1.0" not in out.split("Pipeline:")[1]
    assert [cut_position(x, 4) for x in (0.0, 2.0, 4.0, 2.5)] == [
        "before layer 0 (after the embedding)", "after layer 1", "before the head (after the last layer)",
        "inside layer 2 (50% of its ops before the cut)"]
    assert stage_span(-1.0, 2.0, 8) == "embedding, layers 0-1"
    assert stage_span(2.0, 5.5, 8) == "layers 2-4, start of layer 5"
    assert stage_span(5.5, 8.0, 8) == "end of layer 5, layers 6-7, head"


def test_cli_help_imports_no_torch():
    """``--help`` and argument errors answer before anything heavy is imported: mcompile/apps/cli.py imports
    torch and the compiler inside its subcommands only (the package's __init__ is left out here)."""
    probe = textwrap.dedent(f"""
        import sys, types, importlib.util
        pkg = types.ModuleType("mcompile"); pkg.__path__ = [{str(ROOT / "mcompile")!r}]
        sys.modules["mcompile"] = pkg   # not mcompile/__init__.py: this checks cli.py alone
        spec = importlib.util.spec_from_file_location("mcompile.apps.cli", {str(ROOT / "mcompile/apps/cli.py")!r})
        cli = importlib.util.module_from_spec(spec); spec.loader.exec_module(cli)
        for argv in (["--help"], ["plan", "--mesh"]):
            try:
                cli.main(argv)
            except SystemExit:
                pass
        print("torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr


def test_mcompile_help_through_the_package_imports_no_torch():
    """The same through ``import mcompile.apps.cli`` (the console script): mcompile/__init__.py must import its
    names lazily."""
    probe = ("import sys\nfrom mcompile.apps.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    "
             "pass\n"
             "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout[-500:] + proc.stderr[-500:]


# --------------------------------------------------------------------------- 6. bench results
def test_bench_results_are_written_only_when_asked(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _results
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setattr(_results, "RESULTS", tmp_path / "results")
    assert _results.save("x", {"a": 1}, write=False) is None
    assert json.loads(capsys.readouterr().out)["a"] == 1 and not (tmp_path / "results").exists()
    path = _results.save("x", {"a": 1}, write=True)
    assert path == tmp_path / "results" / "x.json"
    d = json.loads(path.read_text())
    assert d["a"] == 1 and d["machine"]["cpus"] and d["commit"]
    assert _results.save("x", {"a": 2}, write=False, out=tmp_path / "o.json") == tmp_path / "o.json"
    # every script that writes bench/results/*.json goes through the helper (plan_time and op_coverage:
    # their owners adopt it); none writes a results path of its own
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name in ("plan_time.py", "op_coverage.py", "_results.py"):
            continue
        text = script.read_text()
        if "results" in text and ".json" in text and ("write_text" in text or "_results." in text):
            # imported, or loaded from its file (bench/compat.py: bench/ on sys.path would shadow packages)
            assert "import _results" in text or '_bench_module("_results")' in text, script.name
            assert not re.search(r'"results" / "[^"]+\.json"', text), script.name
