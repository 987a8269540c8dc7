"""`mcompile plan` / `mcompile show`: figures checked against hand calculations, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mcompile.apps.cli import main


def run_cli(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "mcompile.apps.cli", *args], capture_output=True, text=True,
                          timeout=170)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow  # the CI tier keeps the cheaper checks of this capability (README: -m slow)
@pytest.mark.timeout(180)
def test_plan_llama3_70b_on_512_fake_ranks_is_cheap_and_its_memory_matches_a_hand_calculation(tmp_path):
    """Llama-3-70B on Mesh.fake(dp=64, tp=8): no real memory (<= 2 GB RSS), <= 60 s, and the
    per-rank memory figures equal a hand count of each rank's parameter shards."""
    script = tmp_path / "measure.py"
    script.write_text(textwrap.dedent("""
        import json, resource, sys, time, io, contextlib
        from mcompile.apps.cli import main
        t = time.perf_counter()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["plan", "llama3-70b", "--mesh", "dp=64,tp=8", "--seq", "4096", "--json"])
        out = json.loads(buf.getvalue())
        out["_seconds"] = time.perf_counter() - t
        out["_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["_rss_mb"] <= 2048, d["_rss_mb"]
    assert d["_seconds"] <= 60, d["_seconds"]
    # hand calculation: Llama-3-70B, tp = 8
    h, L, ffn, vocab, kv = 8192, 80, 28672, 128256, 8 * 128
    tp = 8
    per_layer = (h * h + 2 * kv * h + h * h + 3 * ffn * h) // tp + 2 * h  # sharded linears + 2 norms
    local_params = L * per_layer + 2 * vocab * h // tp + h  # embedding, output (untied), final norm
    mem = d["memory_per_rank"]
    assert mem["params"] == 4 * local_params  # fp32 parameters as built
    assert mem["grads"] == 4 * local_params  # fp32 gradients
    n_tensors = L * 9 + 3
    assert mem["optimizer"] == 8 * local_params + 4 * n_tensors  # AdamW: two fp32 moments, a step each
    # and in bf16 (Megatron's 2 + 4 + 4 + 8 = 18 bytes per parameter)
    assert d["mesh"] == {"dp": 64, "tp": 8}
    n_ar = sum(1 for c in d["collectives"] if c["op"] == "all_reduce" and c["layer"] == 0)
    assert n_ar == 2
    ar = next(c for c in d["collectives"] if c["op"] == "all_reduce" and c["layer"] == 0)
    assert ar["bytes_at_sizes"] == 4 * 1 * 4096 * h  # fp32 [batch=1, seq, hidden]


def test_plan_bf16_memory_is_megatron_18_bytes_per_parameter(capsys):
    assert main(["plan", "llama3-tiny", "--mesh", "tp=2", "--dtype", "bfloat16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    local = sum(p["local_shape"][0] * (p["local_shape"][1] if len(p["local_shape"]) > 1 else 1)
                for p in d["params"].values())
    mem = d["memory_per_rank"]
    n_tensors = len(d["params"])
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (2 * local, 4 * local, 12 * local + 4 * n_tensors)


def test_plan_prints_tables(capsys):
    assert main(["plan", "gpt2-tiny", "--mesh", "tp=2", "--sp", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: on (save_gathered)" in out
    assert "transformer.h.*.attn.c_attn.weight" in out and "B(0,3)" in out
    assert "reduce_scatter" in out and "Memory per rank" in out


def test_show_prints_the_program_of_a_rank(capsys):
    assert main(["show", "llama3-tiny", "--mesh", "tp=2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "def forward" in out
    assert out.count("torch.ops.mcompile.all_reduce.default") >= 4


@pytest.mark.parametrize(
    "args,needle",
    [
        (["plan", "llama3-7b", "--mesh", "tp=2"], "unknown model 'llama3-7b'"),
        (["plan", "llama3-tiny", "--mesh", "xp=2"], "unknown mesh axis 'xp'"),
        (["plan", "llama3-tiny", "--mesh", "tp=two"], "axis=size pairs"),
        (["plan", "llama3-tiny", "--mesh", "tp=3"], "tp=3 does not divide num_heads=8; valid tp sizes: 1, 2, 4"),
        (["show", "llama3-tiny", "--mesh", "tp=2", "--rank", "5"], "outside the mesh"),
        (["plan", "no_such_module:factory"], "cannot load"),
    ],
)
def test_bad_input_is_a_clear_error(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err


def test_unknown_preset_lists_the_presets(capsys):
    assert main(["plan", "nope", "--mesh", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert "llama3-70b" in err and "gpt2-tiny" in err


def test_plan_measure_equals_prediction_to_the_byte(capsys):
    """`--measure` runs one step of every rank's program (threads) under the memory tracker: the
    parameters, gradients and AdamW state each rank holds equal the plan's prediction exactly."""
    assert main(["plan", "gpt2-tiny", "--mesh", "tp=2", "--sp", "--measure", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pred = d["memory_per_rank"]
    for rank in d["measured_per_rank"]:
        assert rank["parameters"] == pred["params"]
        assert rank["gradients"] == pred["grads"]
        assert rank["optimizer"] == pred["optimizer"]
        assert rank["peak_activations"] > 0


def test_plan_says_whether_a_layout_fits_the_device(capsys):
    from mcompile.apps.cli import main

    assert main(["plan", "llama3-tiny", "--mesh", "tp=2", "--seq", "16", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "predicted on h100-sxm" in out and "— fits" in out
    assert main(["plan", "llama3-8b", "--mesh", "dp=2", "--gpu", "a100"]) == 0
    assert "does NOT fit" in capsys.readouterr().out  # 8B unsharded: > 100 GiB of weights, grads and AdamW
    assert main(["plan", "llama3-tiny", "--mesh", "tp=2", "--gpu", "v100"]) == 2
    assert "known profiles: a100-80gb, b200" in capsys.readouterr().err
