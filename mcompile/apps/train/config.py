"""The training config: a typed schema read from TOML, with ``--set a.b=value`` overrides.

One TOML file describes a run; every table is a frozen dataclass below and every key is checked
against it when the file is read, before any process starts:

- an unknown key is an error naming the key, the file and the nearest valid key (``difflib``);
- a value of the wrong type is an error naming the key, the type expected and the value given;
- ``--set a.b=value`` parses ``value`` with TOML's value syntax (``3e-4``, ``true``, ``"x"``,
  ``[0.9, 0.95]``); a value that is not valid TOML is taken as a bare string (``--set
  model.preset=llama3-tiny``), which the type check then accepts or refuses.

Nothing here imports torch (``mcompile train --help`` and config errors answer at once); the
one check that needs the model package (a preset's field overrides) imports it lazily.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "TrainConfig", "ModelConfig", "DataConfig", "ParallelConfig", "OptimizerConfig",
           "ScheduleConfig", "TrainingConfig", "EvalConfig", "CheckpointConfig", "LoggingConfig", "LaunchConfig",
           "DebugConfig", "load_config", "parse_config", "valid_keys"]


class ConfigError(ValueError):
    """A config a user wrote is wrong; the message names the key and what to do."""


# ---------------------------------------------------------------------------------------------- schema
# Every field's type is one of: bool, int, float, str, "floats" (a list of numbers), "table" (a free-form TOML
# table, checked where it is used), "sources" (a prefix, a list of prefixes, or a blend). ``_TYPES`` gives it.


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    preset: str = ""  # a name from mcompile.models (`mcompile plan --list`)
    factory: str = ""  # "package.module:function" returning the model, or (model, example_inputs)
    hf: str = ""  # a Hugging Face config.json, or a folder holding one (built from the config by the Auto class
    #               of its objective: AutoModelForCausalLM, AutoModelForMaskedLM or AutoModelForSeq2SeqLM)
    objective: str = "auto"  # what a step predicts: auto | next-token | causal-lm | masked-lm | seq2seq
    #                          (mcompile.apps.train.objective; auto: the model's own convention)
    mask_token_id: int = -1  # masked-lm: the mask token (-1: read from the tokenizer files beside model.hf)
    overrides: dict = field(default_factory=dict)  # fields of the preset's / HF config (vocab_size, n_layers, ...)
    kwargs: dict = field(default_factory=dict)  # keyword arguments of `factory`
    init_from: str = ""  # weights: a HF folder / .safetensors file / mcompile checkpoint (parallelize weights=)
    init: str = "meta"  # "meta": built on the meta device, initialised per tensor from train.seed on every rank;
    #                     "eager": built with values (torch.manual_seed(train.seed)), rank 0's broadcast


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    sources: Any = ""  # an indexed-dataset prefix, a list of prefixes (equal weights), or [[prefix, weight], ...]
    valid_fraction: float = 0.05  # documents held out for eval (split by whole documents)
    tokenize: list = field(default_factory=list)  # text / JSONL files tokenized into `sources` when it is missing
    #                                              ("tiny": the corpus mcompile ships)
    tokenizer: str = ""  # for `tokenize`: tokenizer.json, *.tiktoken or *.model ("tiny": the shipped one)
    text_key: str = "text"  # JSONL field holding the text
    factory: str = ""  # "package.module:function"(seq_len=, seed=, split=) -> an object with .batch(start, n)
    #                    (samples start .. start+n-1, row by row: row k is sample start+k)
    read: str = "local"  # "local": each rank reads only its data-parallel rows of each batch (1/(dp x ep); the
    #                      tp, cp and pp ranks of those rows read them too, a cp rank only the positions of each
    #                      sequence its program reads, about 1/cp, and pipeline ranks whose stages take no input
    #                      nothing); "global": every rank reads the whole batch (for a factory whose batch(start, n)
    #                      is not row by row)


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    mesh: str = "auto"  # "dp=2,tp=2" (axes dp, pp, tp, ...) or "auto": mcompile.search picks the layout
    sequence_parallel: bool = False  # Megatron's sequence parallelism: norms and dropout sharded over tp by tokens
    zero: int = 0  # 0 | 1 | 2 | 3 (1 and 2: the optimizer is mcompile's DistributedOptimizer)
    microbatches: int = 1  # per step and dp rank: gradient accumulation, and the pipeline's microbatches
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved | zbh1
    virtual_stages: int = 1  # pipeline stages per pp rank (the interleaved schedule)
    recompute: str = "none"  # none | full | selective
    fp8: str = "none"  # none | current | delayed
    fuse: bool = False  # RMSNorm / SwiGLU through mcompile's fused kernels (mcompile.passes.fuse)
    hardware: str = "auto"  # the profile for plan "auto" and for MFU: "auto" = cpu-gloo on CPU, h100 on GPU


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-4  # the peak learning rate
    betas: list = field(default_factory=lambda: [0.9, 0.95])  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 0.1  # decoupled (adamw) or L2 (sgd); 1-D parameters excluded unless decay_1d
    decay_1d: bool = False  # also decay 1-D parameters (norm weights, biases); off, as in GPT-3 / Megatron
    momentum: float = 0.9  # sgd only


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    kind: str = "cosine"  # cosine | wsd | constant
    warmup: int = 0  # steps of linear warmup from 0 to optimizer.lr
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps decays linearly to min_lr
    min_lr: float = 0.0  # the learning rate the decay ends at


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    steps: int = 100  # optimizer steps of the whole run (a resumed run goes on to this step)
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks and microbatches
    seq_len: int = 64  # tokens per sample (the data cuts windows of seq_len + 1)
    clip: float = 1.0  # global gradient-norm clipping; 0: off (the norm is still logged)
    seed: int = 0  # model initialisation and data order
    dtype: str = "bf16"  # compute dtype: bf16 (the default) | fp16 | fp32; master weights, gradients and their
    # reduction stay fp32 (Megatron's --bf16). fp16 turns on dynamic loss scaling (the four keys below). fp32 matmuls
    # run as torch is set: exact fp32 unless torch.set_float32_matmul_precision("high") enables TF32; the cost model
    # and the MFU price what is set (mcompile.cost.hardware.fp32_matmul_precision)
    initial_loss_scale: float = 65536.0  # fp16: the first loss scale (2^16)
    loss_scale_window: int = 1000  # fp16: clean steps in a row before the scale doubles
    min_loss_scale: float = 1.0  # fp16: the scale never halves below this
    loss_scale_hysteresis: int = 1  # fp16: overflows in a row (since the last growth) before the scale halves
    stop_at: int = 0  # end this run after this step (a checkpoint is saved) and resume later; 0: run to `steps`


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    interval: int = 0  # every N steps (and after the last); 0: never
    batches: int = 4  # the fixed set: the valid split's first batches x batch_size samples
    batch_size: int = 0  # 0: train.global_batch


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    dir: str = ""  # checkpoints go to dir/step-XXXXXXX; the run resumes from the newest complete one
    interval: int = 0  # every N steps (and after the last, when dir is set); 0: only after the last
    keep: int = 3  # the newest K complete checkpoints are kept; 0: all
    async_save: bool = False  # save in the background when the checkpoint module offers it
    final_state_dict: str = ""  # after the last step rank 0 torch.saves pm.full_state_dict() here
    export_hf: Any = ""  # after the last step: a Hugging Face from_pretrained folder (with the run's tokenizer):
    #                      a path, or true for checkpoint.dir/hf (mcompile export does it for any checkpoint)

    @property
    def export_hf_dir(self) -> str:
        """The folder ``export_hf`` names ("" when off)."""
        if self.export_hf is True:
            return str(Path(self.dir) / "hf")
        return self.export_hf or ""


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    interval: int = 10  # a metrics line every N steps (and the last)
    jsonl: str = ""  # append one JSON object per line: step, loss, lr, grad_norm, tokens_per_s, mfu, ...
    tensorboard: str = ""  # a SummaryWriter log dir
    progress: str = "auto"  # "auto" (a rich bar on a terminal), "on", "off" (plain lines)


@dataclass(kw_only=True, frozen=True)
class LaunchConfig:
    nproc: int = 0  # processes to start on this machine without torchrun; 0: the mesh's size
    max_restarts: int = 0  # the elastic agent restarts every process this many times after a failure
    nnodes: str = ""  # nodes, "N" or "MIN:MAX" (elastic: goes on with MIN..MAX nodes, dp re-planned); "": Slurm's
    #                   SLURM_NNODES under Slurm, else 1 (mcompile.apps.train.elastic)
    node_rank: int = -1  # this node's rank; node 0 hosts the rendezvous store; -1: SLURM_NODEID, else torch guesses
    rdzv_endpoint: str = ""  # HOST:PORT of the c10d rendezvous (node 0's address); "": MASTER_ADDR or the first
    #                          host of SLURM_JOB_NODELIST (port 29500) under Slurm
    rdzv_id: str = ""  # the run's rendezvous id, the same on every node; "": SLURM_JOB_ID, else "mcompile"
    rdzv_timeout: int = 600  # seconds for every node to join (and for this node to reach the endpoint)
    rdzv_last_call: int = 30  # seconds a rendezvous that has MIN of MIN:MAX nodes waits for more


@dataclass(kw_only=True, frozen=True)
class DebugConfig:
    # fault injection for restart tests: on the first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset),
    # rank `kill_rank` SIGKILLs itself at the start of step `kill_step`; 0: never
    kill_step: int = 0  # the step rank kill_rank kills itself at (first attempt only); 0: never
    kill_rank: int = 0  # the rank that kill_step kills
    kill_node: int = -1  # >= 0: kill_step takes down the node of this launch.node_rank instead: its agent and every
    #                      process it started (a node lost); -1: off
    hang_timeout_s: float = 300.0  # a collective unfinished this long: every rank reports what it waits in, the
    #                                waiting ones name the ranks that have not arrived (docs/guide.md, "When a run
    #                                hangs"); 0: off; not set: $MCOMPILE_HANG_TIMEOUT, else 300
    hang_abort: bool = False  # after its report a waiting rank exits (code 75): the launcher stops the run, or
    #                           restarts it (launch.max_restarts)
    hang_dir: str = ""  # the reports' folder; "": checkpoint.dir/hangs when checkpoint.dir is set, else
    #                     $MCOMPILE_HANG_DIR, else mcompile-hangs in the temporary folder


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    source: str = ""  # the file it was read from ("" for a dict)
    explicit: frozenset = frozenset()  # dotted keys the user set (file or --set): plan "auto" keeps them fixed

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name in _SECTIONS}


_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)
                              if f.name not in ("source", "explicit")}
_TYPES: dict[str, Any] = {"betas": "floats", "overrides": "table", "kwargs": "table", "sources": "sources",
                          "tokenize": "strings", "export_hf": "path_or_bool"}
_CHOICES = {
    "model.init": ("meta", "eager"),
    "data.read": ("local", "global"),
    "model.objective": ("auto", "next-token", "causal-lm", "masked-lm", "seq2seq"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved", "zbh1"),
    "parallel.recompute": ("none", "full", "selective"),
    "parallel.fp8": ("none", "current", "delayed"),
    "optimizer.name": ("adamw", "sgd"),
    "schedule.kind": ("cosine", "wsd", "constant"),
    "train.dtype": ("fp32", "bf16", "fp16"),
    "logging.progress": ("auto", "on", "off"),
}


def valid_keys() -> list[str]:
    """Every dotted key the schema accepts."""
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _type_of(section: str, f: dataclasses.Field):
    if f.name in _TYPES:
        return _TYPES[f.name]
    return {"bool": bool, "int": int, "float": float, "str": str}[f.type]


def _type_name(t) -> str:
    return {"floats": "a list of numbers", "table": "a table ({ key = value, ... })", "strings": "a list of strings",
            "sources": "a prefix string, a list of prefixes, or a list of [prefix, weight] pairs",
            "path_or_bool": "a folder path, or true / false",
            bool: "a boolean (true / false)", int: "an integer", float: "a number", str: "a string"}[t]


def _convert(key: str, value, t, where: str):
    def bad():
        return ConfigError(f"{key} = {value!r} in {where}: expected {_type_name(t)}, got {type(value).__name__}")

    if t is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if t is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad()
        return float(value)
    if t is str:
        if not isinstance(value, str):
            raise bad()
        return value
    if t == "floats":
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
            raise bad()
        return [float(v) for v in value]
    if t == "strings":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad()
        return list(value)
    if t == "table":
        if not isinstance(value, dict):
            raise bad()
        return dict(value)
    if t == "sources":
        return _sources(key, value, where, bad)
    if t == "path_or_bool":
        if value is False:
            return ""
        if value is True or isinstance(value, str):
            return value
        raise bad()
    raise AssertionError(t)


def _sources(key, value, where, bad):
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise bad()
    out = []
    for item in value:
        if isinstance(item, str):
            out.append([item, 1.0])
        elif isinstance(item, dict) and set(item) <= {"prefix", "weight"} and isinstance(item.get("prefix"), str):
            out.append([item["prefix"], float(item.get("weight", 1.0))])
        elif (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], int | float) and not isinstance(item[1], bool)):
            out.append([item[0], float(item[1])])
        else:
            raise ConfigError(f"{key} in {where}: the item {item!r} is not a prefix, [prefix, weight] or "
                              "{ prefix = ..., weight = ... }")
        if out[-1][1] <= 0:
            raise ConfigError(f"{key} in {where}: the weight of {out[-1][0]!r} must be positive, got {out[-1][1]}")
    return out


def _nearest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown(key: str, where: str, section: str | None = None) -> ConfigError:
    keys = valid_keys()
    if section is None:  # a top-level name: a misspelt table, or a key put outside its table
        hint = _nearest(key, list(_SECTIONS))
        if not hint:
            bare = {k.split(".", 1)[1]: k for k in reversed(keys)}
            close = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.6)
            hint = f"; did you mean {bare[close[0]]!r} (key {close[0]!r} inside [{bare[close[0]].split('.')[0]}])?" \
                if close else ""
        return ConfigError(f"unknown table or key {key!r} in {where}{hint} (tables: {', '.join(_SECTIONS)})")
    name = key.split(".", 1)[1]
    own = [f.name for f in dataclasses.fields(_SECTIONS[section])]
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.5)
    if close:
        hint = f"; did you mean '{section}.{close[0]}'?"
    else:  # the key of another table (train.lr -> optimizer.lr)?
        other = [k for k in keys if k.split(".", 1)[1] == name] or \
            difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f"; did you mean {other[0]!r}?" if other else ""
    return ConfigError(f"unknown key {key!r} in {where}{hint} (keys of [{section}]: {', '.join(own)})")


# ---------------------------------------------------------------------------------------------- reading
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> (["a", "b"], value parsed as TOML, or the bare string when it is not TOML)."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not eq or not key or any(not p or not p.replace("_", "").replace("-", "").isalnum() for p in parts):
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set optimizer.lr=3e-4 "
                          "or --set parallel.mesh='\"dp=2,tp=2\"'")
    if len(parts) < 2:
        raise ConfigError(f"--set {text!r}: the key names a table and a key, e.g. train.steps "
                          f"(tables: {', '.join(_SECTIONS)})")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if not raw:
            raise ConfigError(f"--set {text!r}: no value after '='") from None
        value = raw
    return parts, value


def _merge(tree: dict, parts: list[str], value, where: str) -> None:
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(parts)}: {p!r} is a value in {where}, not a table")
        node = nxt
    node[parts[-1]] = value


def parse_config(tree: dict, where: str = "the config", explicit: set | None = None,
                 from_set: frozenset = frozenset()) -> TrainConfig:
    """A TrainConfig from a dict of tables (TOML's shape); every key and type checked. ``from_set``: the
    dotted keys given by ``--set`` (their errors say so)."""
    sections = {}
    explicit = set(explicit or ())

    def at(key: str) -> str:
        hit = next((k for k in from_set if k == key or k.startswith(key + ".")), None)
        return f"--set {hit}=... (over {where})" if hit else where

    for name, table in tree.items():
        if name not in _SECTIONS:
            raise _unknown(name, at(name))
        if not isinstance(table, dict):
            raise ConfigError(f"{name} in {where} must be a table ([{name}] followed by its keys), got {table!r}")
        cls = _SECTIONS[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for k, v in table.items():
            key = f"{name}.{k}"
            if k not in fields:
                raise _unknown(key, at(key), name)
            t = _type_of(name, fields[k])
            values[k] = _convert(key, v, t, at(key))
            if key in _CHOICES and values[k] not in _CHOICES[key]:
                raise ConfigError(f"{key} = {v!r} in {at(key)}: use one of {', '.join(map(repr, _CHOICES[key]))}"
                                  f"{_nearest(str(v), _CHOICES[key])}")
            explicit.add(key)
        sections[name] = cls(**values)
    cfg = TrainConfig(**sections, source=where, explicit=frozenset(explicit))
    _check(cfg, where)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a TOML config and apply ``--set`` overrides (``"a.b=value"``, in order)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist: pass the path of a TOML file "
                          "(examples/train/llama3-tiny.toml is one)")
    try:
        tree = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    given = set()
    for text in overrides:
        parts, value = parse_override(text)
        _merge(tree, parts, value, str(path))
        given.add(".".join(parts))
    return parse_config(tree, str(path), from_set=frozenset(given))


def _check(cfg: TrainConfig, where: str) -> None:
    """Cross-field checks: what the types cannot say."""
    m = cfg.model
    given = [k for k in ("preset", "factory", "hf") if getattr(m, k)]
    if len(given) != 1:
        raise ConfigError(f"[model] in {where}: set exactly one of model.preset, model.factory, model.hf "
                          f"(got {', '.join('model.' + k for k in given) or 'none'}); e.g. preset = \"llama3-tiny\"")
    if m.factory and ":" not in m.factory:
        raise ConfigError(f"model.factory = {m.factory!r} in {where}: use 'package.module:function'")
    if m.preset:
        _check_preset(m, where)
    d = cfg.data
    if not d.sources and not d.factory:
        raise ConfigError(f"[data] in {where}: set data.sources (a dataset prefix written by `mcompile preprocess`) "
                          "or data.factory")
    if d.sources and d.factory:
        raise ConfigError(f"[data] in {where}: set data.sources or data.factory, not both")
    if d.tokenize and (not isinstance(d.sources, str) or not d.tokenizer):
        raise ConfigError(f"data.tokenize in {where} writes one dataset: give data.sources as one prefix and "
                          "data.tokenizer")
    if not 0.0 <= d.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction = {d.valid_fraction} in {where}: use a fraction in [0, 1)")
    if d.factory and ":" not in d.factory:
        raise ConfigError(f"data.factory = {d.factory!r} in {where}: use 'package.module:function'")
    t = cfg.train
    for key, value, low in (("train.steps", t.steps, 1), ("train.global_batch", t.global_batch, 1),
                            ("train.seq_len", t.seq_len, 2), ("parallel.microbatches", cfg.parallel.microbatches, 1),
                            ("parallel.virtual_stages", cfg.parallel.virtual_stages, 1),
                            ("eval.batches", cfg.eval.batches, 1), ("logging.interval", cfg.logging.interval, 1)):
        if value < low:
            raise ConfigError(f"{key} = {value} in {where} must be >= {low}")
    for key, value in (("train.clip", t.clip), ("train.seed", t.seed), ("train.stop_at", t.stop_at),
                       ("eval.interval", cfg.eval.interval),
                       ("eval.batch_size", cfg.eval.batch_size), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("checkpoint.keep", cfg.checkpoint.keep), ("launch.nproc", cfg.launch.nproc),
                       ("launch.max_restarts", cfg.launch.max_restarts), ("schedule.warmup", cfg.schedule.warmup),
                       ("schedule.min_lr", cfg.schedule.min_lr), ("optimizer.weight_decay", cfg.optimizer.weight_decay),
                       ("debug.kill_step", cfg.debug.kill_step), ("debug.kill_rank", cfg.debug.kill_rank),
                       ("debug.hang_timeout_s", cfg.debug.hang_timeout_s)):
        if value < 0:
            raise ConfigError(f"{key} = {value} in {where} must be >= 0")
    if cfg.parallel.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {cfg.parallel.zero} in {where}: use 0, 1, 2 or 3")
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr = {o.lr} in {where} must be positive")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas = {o.betas} in {where}: use two numbers in [0, 1), e.g. [0.9, 0.95]")
    s = cfg.schedule
    if s.min_lr > o.lr:
        raise ConfigError(f"schedule.min_lr = {s.min_lr} in {where} exceeds optimizer.lr = {o.lr}")
    if not 0.0 <= s.decay_fraction <= 1.0:
        raise ConfigError(f"schedule.decay_fraction = {s.decay_fraction} in {where}: use a fraction in [0, 1]")
    if s.warmup > t.steps:
        raise ConfigError(f"schedule.warmup = {s.warmup} in {where} exceeds train.steps = {t.steps}")
    mesh = cfg.parallel.mesh.strip()
    if mesh != "auto":
        _check_mesh(mesh, where)
    for key, value in (("launch.node_rank", cfg.launch.node_rank), ("debug.kill_node", cfg.debug.kill_node)):
        if value < -1:
            raise ConfigError(f"{key} = {value} in {where}: give a rank >= 0, or -1 (unset)")
    for key, value in (("launch.rdzv_timeout", cfg.launch.rdzv_timeout),
                       ("launch.rdzv_last_call", cfg.launch.rdzv_last_call)):
        if value < 1:
            raise ConfigError(f"{key} = {value} in {where}: give a number of seconds >= 1")
    if cfg.launch.nnodes:
        parse_nnodes(cfg.launch.nnodes, "launch.nnodes", where)
    if cfg.checkpoint.interval and not cfg.checkpoint.dir:
        raise ConfigError(f"checkpoint.interval = {cfg.checkpoint.interval} in {where} needs checkpoint.dir")
    if cfg.checkpoint.export_hf is True and not cfg.checkpoint.dir:
        raise ConfigError(f"checkpoint.export_hf = true in {where} writes to checkpoint.dir/hf: set checkpoint.dir, "
                          "or give export_hf a folder")
    if m.objective not in ("auto", "next-token") and not m.hf:
        raise ConfigError(f"model.objective = {m.objective!r} in {where} is for Hugging Face models (model.hf); "
                          "presets and factories take (tokens, targets) as they are: use \"next-token\" or \"auto\"")


def parse_nnodes(text: str, key: str = "--nnodes", where: str = "") -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4). ``key`` and ``where`` (a file) name it in errors."""
    where = f"{key} = {text!r}" + (f" in {where}" if where else "")
    low, colon, high = str(text).strip().partition(":")
    try:
        lo = int(low)
        hi = int(high) if colon else lo
    except ValueError:
        raise ConfigError(f"{where}: give the number of nodes N, or MIN:MAX for an elastic run "
                          "(e.g. 2, or 1:2)") from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"{where}: the node counts must satisfy 1 <= MIN <= MAX (e.g. 2, or 1:2)")
    return lo, hi


def _check_mesh(mesh: str, where: str) -> None:
    axes = ("dp", "pp", "tp", "cp", "ep")
    seen = set()
    for part in mesh.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in axes or not size.strip().isdigit() or int(size) < 1 or name in seen:
            raise ConfigError(f"parallel.mesh = {mesh!r} in {where}: write axis=size pairs such as \"dp=2,tp=2\" "
                              f"(axes {', '.join(axes)}, each once), or \"auto\"{_nearest(name, axes)}")
        seen.add(name)


def _check_preset(m: ModelConfig, where: str) -> None:
    from mcompile.models import PRESETS

    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset = {m.preset!r} in {where} is not a preset{_nearest(m.preset, PRESETS)} "
                          f"(presets: {', '.join(sorted(PRESETS))})")
    if m.overrides:
        from mcompile.models import get_preset

        names = [f.name for f in dataclasses.fields(get_preset(m.preset).config)]
        for k in m.overrides:
            if k not in names:
                raise ConfigError(f"unknown key 'model.overrides.{k}' in {where}: not a field of {m.preset}'s "
                                  f"config{_nearest(k, names)} (fields: {', '.join(names)})")


def mesh_size(mesh: str) -> int:
    """Processes a mesh string needs ("dp=2,tp=2" -> 4)."""
    n = 1
    for part in mesh.split(","):
        n *= int(part.split("=")[1])
    return n


# ---------------------------------------------------------------------------------------------- reference
def reference_markdown() -> str:
    """The config reference (docs/config.md): every table and key with its type, default, choices and the
    comment beside its field above. ``python scripts/config_reference.py`` writes it;
    tests/test_train.py checks the committed page equals it."""
    import inspect
    import re

    lines = ["# `mcompile train` config reference", "",
             "Generated from the config dataclasses (`mcompile/apps/train/config.py`) by",
             "`python scripts/config_reference.py`; `tests/test_train.py` keeps it in sync.",
             "Every key is checked when the file is read: an unknown key names the nearest valid one, a wrong type",
             "the type expected. `--set TABLE.KEY=VALUE` overrides a key (TOML value syntax).", ""]
    for section, cls in _SECTIONS.items():
        comments: dict[str, list[str]] = {}
        current = None
        for raw in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): [^=]+= .*?(?:#\s?(.*))?$", raw)
            if m and not raw.strip().startswith("#"):
                current = m.group(1)
                comments[current] = [m.group(2).strip()] if m.group(2) else []
            elif current and re.match(r"\s+#\s", raw):
                comments[current].append(raw.strip().lstrip("#").strip())
            elif raw.strip().startswith(("@property", "def ")):
                current = None
        lines += [f"## `[{section}]`", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            t = _type_of(section, f)
            kind = _type_name(t).replace("|", "\\|")
            choices = _CHOICES.get(f"{section}.{f.name}")
            if choices:
                kind = " \\| ".join(f"`{c}`" for c in choices)
            text = " ".join(comments.get(f.name, [])).replace("|", "\\|")
            lines.append(f"| `{f.name}` | {kind} | `{json.dumps(default)}` | {text} |")
        lines.append("")
    return "\n".join(lines)
