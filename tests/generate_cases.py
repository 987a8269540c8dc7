"""Functions the gloo worker processes run for tests/test_generate.py: fn(rank, world, *args).

Each builds a :class:`mcompile.apps.generate.Generator` on its rank (the same model, seeded the same, on
every rank) and returns what the test compares against the single-device model: generated tokens,
the decode logits of every step next to the no-cache logits of the same prefix, the collectives of
one decode step, and the errors raised.
"""

from __future__ import annotations

import torch

import mcompile as mc
from mcompile.apps.generate import Generator


def tiny(name: str):
    """A tiny model in eval mode, the same on every rank: our presets, or the HF Llama of conftest."""
    from conftest import build

    model, _ = build(name)
    return model


def _mesh(spec):
    return None if spec is None else mc.Mesh.parse(spec)


_GENS: dict = {}  # (model, mesh) -> Generator: built once per worker process (a build captures twice)


def generator(name: str, mesh):
    key = (name, mesh)
    if key not in _GENS:
        _GENS[key] = Generator(tiny(name), _mesh(mesh))
    return _GENS[key]


def greedy_hf(rank, world, mesh, prompt, n, weights):
    """Greedy tokens of the tiny HF Llama built on the meta device, its weights read from the Hugging Face
    folder ``weights`` under ``mesh``; the local cache shapes after the prompt; the decode collectives."""
    with torch.device("meta"):
        model = tiny("hf-llama")
    gen = Generator(model, _mesh(mesh), weights=weights)
    _, cache = gen.prefill(prompt)
    return {"tokens": gen.generate(prompt, n), "cache_shapes": [tuple(c.shape) for c in cache],
            "collectives": gen.collectives("decode")}


def decode_parity(rank, world, name, mesh, prompt, n):
    """Per decode step: the cached program's last-position logits and the full forward's (no cache) of
    the same prefix, the single-device model's logits too (rank 0), and the local cache shapes."""
    model = tiny(name)
    gen = generator(name, mesh)
    logits, cache = gen.prefill(prompt)
    seq = gen._local_rows(prompt)
    steps = []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        logits, cache = gen.decode(nxt, cache)
        full = gen._call(gen.prefill_program, seq, [])[0]  # the parallel forward without cache
        with torch.no_grad():
            single = model(seq)  # the single-device model, this rank's rows
        steps.append((logits[:, -1].clone(), full[:, -1].clone(), single[:, -1].clone()))
    return {"steps": steps, "cache_shapes": [tuple(c.shape) for c in cache],
            "collectives": gen.collectives("decode"), "tokens": gen.generate(prompt, n)}


def sampling(rank, world, name, mesh, prompt, n):
    """Sampled continuations: the same seed twice, another seed, top_p -> 0, and greedy."""
    gen = generator(name, mesh)
    return {
        "a": gen.generate(prompt, n, temperature=1.0, top_p=0.9, seed=7),
        "b": gen.generate(prompt, n, temperature=1.0, top_p=0.9, seed=7),
        "c": gen.generate(prompt, n, temperature=1.0, top_p=0.9, seed=8),
        "narrow": gen.generate(prompt, n, temperature=1.0, top_p=1e-9, seed=3),
        "greedy": gen.generate(prompt, n),
        "eos": gen.generate(prompt, n, eos_id=int(gen.generate(prompt, 2)[0, -1])),
    }


def from_trained(rank, world, name, mesh, prompt, n, path):
    """One training step under ``mesh`` (parallelize), then a Generator from the trained module, and one
    from the checkpoint saved at ``path`` into a model built on the meta device: their greedy tokens, and
    the trained full state dict (rank 0) for the single-device reference."""
    from conftest import build

    model, (tokens, targets) = build(name)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens, targets))
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    pm.train_step(tokens, targets)
    opt.step()
    pm.save_checkpoint(path)
    gen = Generator.from_module(pm, model)
    state = pm.full_state_dict()
    with torch.device("meta"):
        meta_model = tiny(name)
    from_ckpt = Generator(meta_model, mc.Mesh(tp=world), weights=path)
    return {"tokens": gen.generate(prompt, n), "ckpt_tokens": from_ckpt.generate(prompt, n),
            "state": state if rank == 0 else None}


class _CountComm:
    """Counts what one rank communicates while active: the torch.distributed point-to-point and
    broadcast calls (patched on the module, as mcompile.apps.generate calls them), and the mcompile
    collectives the programs run (a dispatch mode, as runtime/pipeline.py records them)."""

    def __enter__(self):
        import torch.distributed as dist

        from mcompile.runtime.pipeline import _RecordCollectives

        self.p2p: list[str] = []
        self._saved = {}
        for name in ("send", "recv", "broadcast", "isend", "irecv"):
            fn = getattr(dist, name)
            self._saved[name] = fn

            def wrapped(*a, _fn=fn, _name=name, **k):
                self.p2p.append(f"{_name}/pp")
                return _fn(*a, **k)

            setattr(dist, name, wrapped)
        self._rec = _RecordCollectives()
        self._rec.__enter__()
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        self._rec.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self.collectives = [f"{op}/{axis}" for op, axis, _, _ in self._rec.ops]


def pp_parity(rank, world, name, mesh, prompt, n):
    """Under a mesh with pp: per decode step (fed the single-device model's greedy token), the last stage's
    decode logits next to the single-device model's full forward of the same prefix (None on other stages);
    this rank's cache shapes after prefill and after the steps; the generated greedy tokens; what one more
    generated token communicates (generate(n + 1) minus generate(n): one decode step and one token broadcast)."""
    model = tiny(name)
    gen = generator(name, mesh)
    logits, cache = gen.prefill(prompt)
    after_prefill = [tuple(c.shape) for c in cache]
    seq = gen._local_rows(prompt)
    steps = []
    with torch.no_grad():
        for _ in range(n):
            single = model(seq)[:, -1]
            if logits is not None:
                steps.append((logits[:, -1].clone(), single.clone()))
            nxt = single.argmax(-1, keepdim=True)  # the single-device model's greedy token, on every rank
            seq = torch.cat([seq, nxt], 1)
            logits, cache = gen.decode(nxt, cache)
    tokens = gen.generate(prompt, n)
    with _CountComm() as short:
        gen.generate(prompt, 2)
    with _CountComm() as long:
        gen.generate(prompt, 3)
    step = {"p2p": sorted(long.p2p), "collectives": sorted(long.collectives)}
    for k, v in (("p2p", short.p2p), ("collectives", short.collectives)):
        for x in v:
            step[k].remove(x)
    return {"stage": gen.mesh.coords(rank)["pp"], "steps": steps, "after_prefill": after_prefill,
            "cache_shapes": [tuple(c.shape) for c in cache], "caches": gen.decode_program.caches,
            "tokens": tokens, "step": step, "declared": gen.collectives("decode"),
            "logits": gen.logits(prompt)}
