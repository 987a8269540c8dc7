"""Peak memory per rank of ``parallelize(model_on_meta, mesh, ..., weights=HF checkpoint)`` (issue 11,
acceptance 2: a model that never exists whole on any rank).

    python bench/load_rss.py [--layers 16] [--layouts tp=4 pp=2,tp=2] [--out bench/results/load_rss.json]

Model: Hugging Face ``LlamaForCausalLM``, hidden 1024, 16 layers, 16 heads (16 KV heads), intermediate
size 2400, vocabulary 32000, untied embedding and head: 250.6 M parameters (1.00 GB in fp32), saved
with ``save_pretrained`` in bf16 (0.50 GB, one file) to a temporary folder. Per layout, 4 gloo CPU
processes (``mcompile.runtime.launch.spawn``) each build the model on the meta device and call
``parallelize`` twice in separate runs: with ``weights=`` the checkpoint, and without (the meta model
initialised by its own initialisers) for comparison.

Measured per rank, from ``/proc/self/status`` (VmRSS, VmHWM; RssAnon / RssFile sampled):

- ``before``: VmRSS with the model built on meta, just before ``parallelize``. The high-water mark is
  reset there (Linux ``/proc/self/clear_refs`` "5"; where refused, VmHWM before and after are both
  recorded and the sampled maximum is the fallback), and a thread samples VmRSS every 2 ms.
- ``overhead``: planning and runtime set-up, everything ``parallelize`` allocates before it reads any
  value — VmRSS when ``mcompile.runtime.weights.load`` is entered (the bench wraps it), minus
  ``before`` — and ``overhead_peak``, the high-water mark reached by then, minus ``before``.
- ``load_rise``: the peak while the weights are read (the high-water mark is reset again on entering
  ``weights.load``) minus VmRSS on entering it; ``load_kept``: what is still held when it returns (the
  pieces).
- ``post_load``: what ``parallelize`` allocates after the weights are read (the runtime's flat fp32
  gradient buffers, one fp32 copy of the local parameters' size, runtime/leaves.py: the same with or
  without ``weights=``); ``overhead_total`` =
  ``overhead`` + ``post_load``: the stated overhead, measured in the same run, independent of how the
  values arrive. The run without ``weights=`` gives the other yardstick: its whole rise.
- ``bound``: this rank's local shard bytes (its parameters' pieces in fp32 and its buffers) plus the
  bytes of the largest full tensor it reads (fp32). The claim: ``load_rise <= bound`` and
  ``peak_rise <= max(overhead_peak, overhead_total + bound)`` (``peak_rise``: VmHWM after ``parallelize``
  minus ``before``). RSS counts the pages of the mapped safetensors file a rank touches (RssFile):
  they are part of the figure, released when the tensor's view is.

After the measurement, ``full_state_dict()`` is compared on rank 0, tensor by tensor, with the saved
weights (bf16 -> fp32 exactly). Writes the figures (MiB), the machine, torch / transformers /
safetensors versions, the git commit, the date and the run time to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)
import torch

MiB = 1 << 20
HF = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2400, num_hidden_layers=16, num_attention_heads=16,
          num_key_value_heads=16, tie_word_embeddings=False)


def _status() -> dict[str, int]:
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith(keys)}


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    """The largest VmRSS / RssAnon / RssFile seen (every 2 ms); ``mark()`` restarts the maxima."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.max = threading.Event(), {}

    def mark(self) -> dict[str, int]:
        seen, self.max = self.max, {}
        return seen

    def run(self):
        while not self.stop.is_set():
            s = _status()
            for k in ("VmRSS", "RssAnon", "RssFile"):
                self.max[k] = max(self.max.get(k, 0), s[k])
            time.sleep(0.002)


def _model(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from mcompile.models.hf import CausalLMLoss

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        return CausalLMLoss(LlamaForCausalLM(LlamaConfig(**cfg)))


def measure(rank, world, cfg, folder, mesh, with_weights):
    """One rank: build on meta, parallelize (with or without weights=), the memory figures; then the
    values compared with the file on rank 0."""
    import mcompile as mc
    from mcompile.runtime import weights as W

    torch.set_num_threads(1)
    model = _model(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    phase = {}
    original = W.load

    def load(pm, *args, **kwargs):  # the bench's probe around the weights' reading
        phase["enter"] = _status()
        phase["enter_sampled"] = sampler.mark()
        phase["reset"] = _reset_hwm()
        out = original(pm, *args, **kwargs)
        phase["exit"] = _status()
        phase["exit_sampled"] = sampler.mark()
        return out

    W.load = load
    gc.collect()
    sampler = _Sampler()
    before = _status()
    reset = _reset_hwm()
    hwm_before = _status()["VmHWM"]
    sampler.start()
    t0 = time.perf_counter()
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (ids, ids), weights=folder if with_weights else None)
    seconds = time.perf_counter() - t0
    after = _status()
    sampler.stop.set()
    sampler.join()
    W.load = original
    tail = sampler.mark()
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in pm._params.values())
    local += sum(t.numel() * t.element_size() for t in pm._extra.values())
    largest = max(pm.plan.params[f].numel * 4 for f in pm._params)
    out = {"rank": rank, "seconds": round(seconds, 1), "hwm_reset": reset, "local_bytes": local,
           "largest_full_tensor_bytes": largest, "before_rss": before["VmRSS"], "before_hwm": hwm_before,
           "after_rss": after["VmRSS"], "after_hwm": after["VmHWM"],
           "sampled_max_rss": max(phase.get("enter_sampled", {}).get("VmRSS", 0),
                                  phase.get("exit_sampled", {}).get("VmRSS", 0), tail.get("VmRSS", 0))}
    # without the reset, VmHWM may still be the import's peak: the sampled maximum is the fallback
    out["peak_rise"] = (after["VmHWM"] if reset else out["sampled_max_rss"]) - before["VmRSS"]
    if with_weights:
        enter, exit_ = phase["enter"], phase["exit"]
        out.update(overhead=enter["VmRSS"] - before["VmRSS"], overhead_peak=enter["VmHWM"] - before["VmRSS"],
                   load_rise=exit_["VmHWM"] - enter["VmRSS"], load_hwm_reset=phase["reset"],
                   load_kept=exit_["VmRSS"] - enter["VmRSS"], post_load=after["VmRSS"] - exit_["VmRSS"],
                   load_sampled_max_rss_file=phase["exit_sampled"].get("RssFile", 0) - enter["RssFile"],
                   load_sampled_max_rss_anon=phase["exit_sampled"].get("RssAnon", 0) - enter["RssAnon"])
        out["bound"] = local + largest
        out["overhead_total"] = out["overhead"] + max(out["post_load"], 0)
        out["load_within_bound"] = out["load_rise"] <= out["bound"]
        out["peak_within_bound"] = out["peak_rise"] <= max(out["overhead_peak"], out["overhead_total"] + out["bound"])
    # the values: every rank gathers (collective), rank 0 compares with the file, one tensor at a time
    sd = pm.full_state_dict() if with_weights else None
    if with_weights and rank == 0:
        from safetensors import safe_open

        mismatched, compared = [], 0
        with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                compared += 1
                if not torch.equal(sd[f"m.{k}"], f.get_tensor(k).float()):
                    mismatched.append(k)
        out.update(compared=compared, mismatched=mismatched, keys_in_state=len(sd))
    del sd
    return out


_BYTES = {"local_bytes", "largest_full_tensor_bytes", "before_rss", "before_hwm", "after_rss", "after_hwm", "peak_rise",
          "sampled_max_rss", "overhead", "overhead_peak", "load_rise", "load_sampled_max_rss_file",
          "load_sampled_max_rss_anon", "bound", "load_kept", "post_load", "overhead_total"}


def _mib(x: int) -> float:
    return round(x / MiB, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=HF["num_hidden_layers"])
    ap.add_argument("--layouts", nargs="+", default=["tp=4", "pp=2,tp=2"])
    _results.add_arguments(ap, "load_rss")
    args = ap.parse_args(argv)
    from mcompile.runtime.launch import spawn

    t_start = time.perf_counter()
    cfg = {**HF, "num_hidden_layers": args.layers}
    result = {"model": {"class": "transformers.LlamaForCausalLM", **cfg}, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="load_rss-") as tmp:
        from transformers import LlamaConfig, LlamaForCausalLM

        t = time.perf_counter()
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
        n_params = sum(p.numel() for p in hf.parameters())
        hf.save_pretrained(tmp)
        del hf
        gc.collect()
        result["model"].update(parameters=n_params, fp32_bytes_mib=_mib(n_params * 4),
                               saved_dtype="bfloat16", file_mib=_mib(os.path.getsize(Path(tmp) / "model.safetensors")),
                               save_seconds=round(time.perf_counter() - t, 1))
        print(f"saved {n_params / 1e6:.1f} M parameters in {time.perf_counter() - t:.0f} s", flush=True)
        for mesh in args.layouts:
            entry = {}
            for with_weights in (True, False):
                t = time.perf_counter()
                ranks = spawn(measure, 4, cfg, tmp, mesh, with_weights)
                key = "weights" if with_weights else "no_weights_meta_init"
                entry[key] = [{k: _mib(v) if k in _BYTES else v for k, v in r.items()} for r in ranks]
                entry[f"{key}_wall_seconds"] = round(time.perf_counter() - t, 1)
                print(mesh, key, json.dumps(entry[key]), flush=True)
            result["layouts"][mesh] = entry
    result["all_within_bound"] = all(r["load_within_bound"] and r["peak_within_bound"]
                                     for e in result["layouts"].values() for r in e["weights"])
    result["values_equal"] = all(not r.get("mismatched") for e in result["layouts"].values() for r in e["weights"])
    import safetensors
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result["units"] = "MiB unless the key says otherwise"
    result["machine"] = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                         "python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                         "load_average_at_end": os.getloadavg()}
    result["commit"] = commit
    result["tree_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                               cwd=Path(__file__).resolve().parents[1]).stdout.strip())
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["run_seconds"] = round(time.perf_counter() - t_start, 1)
    _results.save("load_rss", result, args.write, args.out)
    print(f"{result['run_seconds']} s: within bound {result['all_within_bound']}, "
          f"values equal {result['values_equal']}")


if __name__ == "__main__":
    main()
