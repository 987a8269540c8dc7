"""Shared fixtures: tiny models (ours and unmodified Hugging Face ones) and a cache of compiled plans."""

from __future__ import annotations

import os
import sys

# `python -m pytest` (the README's command) puts the working directory first on sys.path. There, the repository's
# top-level folders shadow installed packages of the same names: transformers (>= 5.2x) depends on the Hub's
# `kernels` package and imports it once it finds one, getting our kernels/ folder instead (ImportError in every
# Hugging Face model's construction). mcompile itself is imported through its install (pyproject's package-dir
# mapping), never through the root, and the worker pools inherit this sys.path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _importable(paths: list[str]) -> list[str]:
    """``paths`` without the repository root and bench/ (its kernels.py shadows the Hub's package too)."""
    return [p for p in paths if os.path.abspath(p) not in (_ROOT, os.path.join(_ROOT, "bench"))]


sys.path[:] = _importable(sys.path)

# Triton reads TRITON_INTERPRET once, at its first import (torch.utils.flop_counter imports it):
# the kernel tests run the Triton kernels on CPU tensors through the interpreter (DESIGN §8).
os.environ.setdefault("TRITON_INTERPRET", "1")
# parallelize's capture cache (mcompile.capture.cache) in a folder of this session's own, inherited by
# the worker processes: tests never read captures a previous run left, nor fill the user's cache
if "MCOMPILE_CACHE" not in os.environ:
    import tempfile

    os.environ["MCOMPILE_CACHE"] = tempfile.mkdtemp(prefix="mcompile-cache-")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

MODELS = ["gpt2-tiny", "llama3-tiny", "hf-llama", "hf-gpt2"]


from mcompile.models.hf import CausalLMLoss as HFLoss  # noqa: E402


def build(name: str, seed: int = 0, device=None, batch: int = 2):
    """(model, (tokens, targets)) for a tiny model; some targets are -100 (ignored): five in the first
    row only, so data-parallel ranks count different numbers of tokens."""
    torch.manual_seed(seed)
    if name.startswith("hf-"):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        if name == "hf-roberta":  # an encoder: masked-LM head, learned positions, token types, padding_idx=1
            from transformers import RobertaConfig, RobertaForMaskedLM

            cfg = RobertaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=40, type_vocab_size=2,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            model = HFLoss(RobertaForMaskedLM(cfg))
        elif name in ("hf-llama", "hf-llama-deep"):  # deep: 4 layers, planned from 2 captured
                                                     # (mcompile.sharding.repeat)
            cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=4 if name == "hf-llama-deep" else 2,
                              num_attention_heads=8, num_key_value_heads=4)
            model = HFLoss(LlamaForCausalLM(cfg))
        elif name.startswith(("hf-llama-4l", "hf-qwen3-4l", "hf-mistral-4l")):
            # RoPE + GQA causal LMs of 4 layers (planned from 2 captured, mcompile.sharding.repeat), 4 heads over 2 K/V
            # heads:
            # under cp their causal mask and repeat_kv are rewritten (passes/attention). "-nocache": use_cache=False;
            # else the default call, whose DynamicCache lifts empty tensors inside each layer
            import transformers

            family = name.split("-")[1]
            kind = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
            extra = {"head_dim": 16} if family == "qwen3" else {}
            if name.endswith("-nocache"):
                extra["use_cache"] = False
            cfg = getattr(transformers, f"{kind}Config")(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, **extra)
            model = HFLoss(getattr(transformers, f"{kind}ForCausalLM")(cfg))
        elif name == "hf-llama-gqa-deep":  # 4 layers (block repetition on), 4 heads over 2 kv heads
            cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2)
            model = HFLoss(LlamaForCausalLM(cfg))
        elif name == "hf-neox-deep":  # GPT-NeoX: fused QKV split by chunk, partial rotary, untied head; 4 layers
            from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

            cfg = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)
            model = HFLoss(GPTNeoXForCausalLM(cfg))
        else:  # odd vocabulary: padded under tp, as GPT-2's 50257
            cfg = GPT2Config(vocab_size=129, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            model = HFLoss(GPT2LMHeadModel(cfg))
        vocab = cfg.vocab_size
    elif name == "llama3-tiny-deep":  # 4 layers: planned from 2 captured blocks, repeated (mcompile.sharding.repeat)
        import dataclasses

        from mcompile.models import get_preset
        from mcompile.models.llama import Llama

        cfg = dataclasses.replace(get_preset("llama3-tiny").config, n_layers=4)
        model, vocab = Llama(cfg), cfg.vocab_size
    else:
        from mcompile.models import get_preset

        pre = get_preset(name)
        model = pre.build()
        if pre.inputs is not None:  # a family with its own inputs (models/<family>.py): seq 16, seeded
            model.eval()
            return model, pre.example_inputs(batch=batch, seq=16, seed=seed + 1)
        vocab = pre.config.vocab_size
    model.eval()  # dropout off: parity runs at p = 0 (DESIGN §11)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, 16), generator=g)
    targets = torch.randint(0, vocab, (batch, 16), generator=g)
    targets[0, :5] = -100
    if name == "hf-roberta":
        tokens[tokens == 1] = 2
        tokens[0, -3:] = 1  # padding: the word and position rows 1 must get no gradient
    return model, (tokens, targets)


_CACHE: dict = {}


def compiled(name: str, mesh_spec: str, sp: bool):
    """compile_plan of a tiny model, cached across tests (planning costs ~1 s)."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    key = (name, mesh_spec, sp)
    if key not in _CACHE:
        model, inputs = build(name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.parse(mesh_spec), inputs, sequence_parallel=sp)
        _CACHE[key] = (model, inputs, c, [w for w in caught if "sharding rule" in str(w.message)])
    return _CACHE[key]


@pytest.fixture
def compiled_model():
    return compiled


_POOLS: dict = {}  # world size -> live WorkerPool, least recently used first
# live worker processes one test process keeps (a worker holds ~0.75 GB once it has built a few Hugging Face
# models): pools of 2 and 4 stay up together; an 8-rank pool closes the others first. Under pytest-xdist each of
# its processes keeps its own pools.
MAX_LIVE_WORKERS = 8
# the workers fork from a server process that imported these once (WorkerPool's forkserver): each new worker
# skips importing torch, transformers and mcompile (~4-8 s of CPU a worker on this machine)
# (and what a first parallelize + train_step imports besides: networkx, dynamo and inductor, the HF model code)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.export", "torch._dynamo",
           "torch._inductor.compile_fx", "networkx", "sympy", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2", "mcompile",
           "mcompile.api", "mcompile.runtime.module", "mcompile.runtime.joint_runner", "mcompile.runtime.pipeline",
           "mcompile.passes.joint", "mcompile.passes.remat")
POOL_STARTS: list[int] = []


def pool(n: int):
    """A live pool of n gloo worker processes, kept for the whole session (started on first use)."""
    from mcompile.runtime.launch import WorkerPool

    group = _CURRENT[-1].get_closest_marker("xdist_group") if _CURRENT else None
    if _CURRENT and (group is None or group.args[0] != "processes"):
        raise RuntimeError(f"{_CURRENT[-1].nodeid} starts a worker pool, but conftest's reading of its source did "
                           "not find it (_STARTS_PROCESSES): it would run beside another multi-process test under "
                           "xdist. Call pool() where the test (or a tests/ function it calls by name) shows it.")
    p = _POOLS.pop(n, None)
    if p is None or not p.alive:
        if p is not None:
            p.close()
        while _POOLS and sum(q.nprocs for q in _POOLS.values()) + n > MAX_LIVE_WORKERS:
            _POOLS.pop(next(iter(_POOLS))).close()
        # the workers start with this sys.path: never the root or bench/ (a test may have put them there: the CLI
        # finds `pkg.module:factory` models from the working directory), see the top of this file
        saved = sys.path[:]
        sys.path[:] = _importable(sys.path)
        try:
            p = WorkerPool(n, start_method="forkserver", preload=PRELOAD)
        finally:
            sys.path[:] = saved
        POOL_STARTS.append(n)
    _POOLS[n] = p
    return p


def pytest_terminal_summary(terminalreporter):
    """How many worker pools this session started (each start costs its workers' first imports and first
    compilations): a number that grows when a test closes a pool (a failure on a rank, an 8-rank mesh)."""
    if POOL_STARTS:
        sizes = ", ".join(f"{n} x{POOL_STARTS.count(n)}" for n in sorted(set(POOL_STARTS)))
        terminalreporter.write_line(f"gloo worker pools started: {len(POOL_STARTS)} (ranks x times: {sizes})")


# the names by which a test starts processes: a worker pool, a CLI run, a spawned world
_STARTS_PROCESSES = frozenset({"pool", "subprocess", "WorkerPool", "spawn", "_run_cli"})
_FUNCS: dict[str, dict] = {}


def _module_functions(path: str) -> dict:
    """What a name of ``path``'s module refers to, for :func:`_starts_processes`: a module-level function
    (``(ast.FunctionDef, path)``), a function imported by name from another module of tests/
    (``("import", file, name)``: ``from runtime_cases import check``), or such a module itself
    (``("module", file)``: ``import compositions_cases as C``)."""
    if path not in _FUNCS:
        import ast

        _FUNCS[path] = {}
        try:
            tree = ast.parse(open(path).read())
        except (OSError, SyntaxError):
            return _FUNCS[path]
        here = os.path.dirname(path)
        found = {n.name: (n, path) for n in tree.body if isinstance(n, ast.FunctionDef)}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                other = os.path.join(here, n.module + ".py")
                if os.path.exists(other) and other != path:
                    for a in n.names:
                        found.setdefault(a.asname or a.name, ("import", other, a.name))
            elif isinstance(n, ast.Import):
                for a in n.names:
                    other = os.path.join(here, a.name + ".py")
                    if os.path.exists(other) and other != path:
                        found.setdefault(a.asname or a.name, ("module", other))
        _FUNCS[path] = found
    return _FUNCS[path]


def _starts_processes(path: str, name: str, seen: set) -> bool:
    """Whether function ``name`` of ``path`` (or a function of tests/ it calls, transitively: by its name, or as
    an attribute of a tests/ module) names a way to start processes (:data:`_STARTS_PROCESSES`): read from the
    source, never run."""
    import ast

    functions = _module_functions(path)
    entry = functions.get(name)
    if entry is None or entry[0] == "module" or (path, name) in seen:
        return False
    seen.add((path, name))
    if entry[0] == "import":
        return _starts_processes(entry[1], entry[2], seen)
    called: list[tuple[str, str]] = []  # (file, function name) this function refers to
    for n in ast.walk(entry[0]):
        if isinstance(n, ast.Name):
            called.append((path, n.id))
        elif isinstance(n, ast.ImportFrom):
            called += [(path, a.asname or a.name) for a in n.names]
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                and functions.get(n.value.id, ("",))[0] == "module":
            called.append((functions[n.value.id][1], n.attr))
    return any(name in _STARTS_PROCESSES for _, name in called) or \
        any(_starts_processes(file, name, seen) for file, name in called)


def _uses_processes(item) -> bool:
    path, func = str(item.path), getattr(item, "originalname", item.name)
    seen: set = set()
    if _starts_processes(path, func, seen):
        return True
    for fixture in getattr(item, "fixturenames", ()):  # a fixture of the file or of this conftest
        if _starts_processes(path, fixture, seen) or _starts_processes(__file__, fixture, seen):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns xdist_group marks into node id suffixes
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (pytest-xdist; the README's command, docs/testing.md): every test that
    starts processes (a gloo worker pool, a CLI run) is in one group, run serially by one xdist process, while the
    other runs the in-process tests: two multi-process tests never share the two cores (each world of 2-4 ranks
    spins on its collectives; two at once ran every test 1.7x slower). A file with a module- or class-scoped fixture
    runs whole in one process (the fixture is built once): in the processes' group if any of its tests starts
    processes, in a group of its own otherwise."""
    by_file: dict = {}
    for item in items:
        by_file.setdefault(str(item.path), []).append(item)
    for file_items in by_file.values():
        procs = [_uses_processes(item) for item in file_items]
        shares = [_shares_a_fixture(item) for item in file_items]
        for item, p, sh in zip(file_items, procs, shares):
            if p or (any(shares) and any(procs)):
                item.add_marker(pytest.mark.xdist_group("processes"))
            elif sh:
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _shares_a_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d[-1].scope in ("module", "class", "package") for d in defs if d)


_CURRENT: list = []  # the test running now (pool() checks that it was scheduled with the multi-process tests)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT.append(item)
    try:
        yield
    finally:
        _CURRENT.pop()


def pytest_sessionfinish(session, exitstatus):
    for p in _POOLS.values():
        p.close()
    if hasattr(session.config, "workeroutput"):  # an xdist process: its pool starts go to the controller's summary
        session.config.workeroutput["pool_starts"] = list(POOL_STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    POOL_STARTS.extend(getattr(node, "workeroutput", {}).get("pool_starts", ()))


def tiered(cases, ci) -> list:
    """``pytest.param``s of ``cases`` (tuples) with an id each; those not in ``ci`` are marked slow: the
    CI tier keeps a parity case of every capability, the full layout x model sweep runs with -m slow."""
    def ident(case):
        return "-".join(c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()) for c in case)

    return [pytest.param(*c, id=ident(c), marks=() if c in ci else pytest.mark.slow) for c in cases]


def examples(ci: int, slow: int) -> list:
    """``pytest.param``s of a property test's example count: ``ci`` in the CI tier, ``slow`` more with -m slow (the
    same property drawn further). For property tests whose examples each cost seconds (a Triton kernel through the
    interpreter, a model compiled per draw); the test builds its ``@given`` inside with ``settings(max_examples=n)``."""
    return [pytest.param(ci, id=f"{ci}-examples"), pytest.param(slow, id=f"{slow}-examples", marks=pytest.mark.slow)]

