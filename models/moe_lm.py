"""Mixture-of-experts decoder-only transformers (plain, single device): Mixtral- and DeepSeek-V3-style.

Attention, RMSNorm, RoPE and the dense SwiGLU MLP are models/llama.py's, imported. What is new is
the MoE feed-forward:

* **Mixtral** (Jiang et al. 2024, "Mixtral of Experts"): a linear router, softmax over the experts,
  top-k, the k probabilities renormalised to sum to 1, SwiGLU experts. Two auxiliary losses:
  the load-balancing loss of Switch Transformer (Fedus et al. 2021, eq. 4) generalised to top-k,
  ``aux = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the T*k routed slots that chose expert
  e and ``P_e`` the mean router probability of e (1.0 when perfectly balanced), and the router
  z-loss of ST-MoE (Zoph et al. 2022, eq. 5), ``z = mean_t logsumexp(logits_t)^2``.
* **DeepSeek-V3** (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1.2): shared expert(s)
  that see every token plus fine-grained routed experts; sigmoid affinities; an optional
  node-limited (grouped) routing; top-k chosen on ``affinity + bias`` but weighted by the
  affinities alone, normalised over the k and scaled; auxiliary-loss-free balancing: the per-expert
  ``bias`` buffer is moved by ``update_bias`` (outside autograd, after the optimizer step) toward
  balance, ``bias_e += rate * sign(mean load - load_e)``. The first ``first_dense_layers`` layers
  use a dense MLP. Attention is standard (GQA) attention, not MLA.

Dispatch (both): the T*k (token, choice) slots are sorted by expert (stable argsort), the token
rows gathered in that order, all experts computed by one grouped GEMM over the contiguous groups
(:func:`grouped_mm`), the outputs weighted and scatter-added back to their tokens. Experts are
fused 3-D parameters ``w1``/``w3`` (gate/up) ``[E, hidden, dim]`` and ``w2`` (down)
``[E, dim, hidden]``, llama's w1/w2/w3 with a leading expert dim. Every shape is static in the
number of tokens: no Python loop over experts, no data-dependent size, so
``torch.export.export(strict=False)`` captures it with symbolic batch and sequence.

Losses: ``forward(idx, targets)`` returns ``CE + aux_loss_coef * aux + z_loss_coef * z`` where aux
and z are the means over the MoE layers (so a coefficient does not depend on depth);
:meth:`MoETransformer.loss_terms` returns the three terms apart. Without targets it returns the
logits, as models/llama.py does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Attention, FeedForward, LlamaConfig, RMSNorm, init_block_module, rope_inv_freq

__all__ = [
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekMoE",
    "GroupedExperts",
    "MixtralMoE",
    "Mixtral",
    "MixtralConfig",
    "MoELosses",
    "MoETransformer",
    "grouped_mm",
    "grouped_mm_reference",
    "tokens_per_expert",
]


# --------------------------------------------------------------------------- configs


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(kw_only=True)
class MixtralConfig(LlamaConfig):
    """A Llama config (``ffn_hidden`` is each expert's hidden size) plus the MoE fields."""

    n_experts: int = 8
    top_k: int = 2
    aux_loss_coef: float = 0.02  # transformers' Mixtral default (router_aux_loss_coef)
    z_loss_coef: float = 1e-3  # ST-MoE's recommended coefficient

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}: lower top_k or add experts"
            )
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError("aux_loss_coef and z_loss_coef must be >= 0 (0 turns a loss off)")


@dataclass(kw_only=True)
class DeepSeekV3Config(LlamaConfig):
    """A Llama config (``ffn_hidden`` is the dense layers' hidden size) plus the DeepSeekMoE fields."""

    moe_ffn_hidden: int  # hidden size of one routed (and one shared) expert: fine-grained, << ffn_hidden
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    top_k: int = 8
    n_groups: int = 1  # node-limited routing: experts in n_groups groups (1: off)
    topk_groups: int = 1  # the groups a token may route to
    routed_scaling_factor: float = 2.5
    first_dense_layers: int = 0  # layers 0..first_dense_layers-1 use the dense MLP
    bias_update_rate: float = 1e-3  # gamma of update_bias (DeepSeek-V3 §4.2: 0.001, then 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        E = self.n_routed_experts
        if E < 1 or self.n_shared_experts < 0 or self.first_dense_layers < 0 or self.moe_ffn_hidden < 1:
            raise ValueError("n_routed_experts and moe_ffn_hidden must be >= 1, n_shared_experts and "
                             "first_dense_layers >= 0")
        if self.n_groups < 1 or E % self.n_groups != 0:
            raise ValueError(f"n_groups={self.n_groups} must divide n_routed_experts={E}; "
                             f"valid n_groups: {_divisors(E)}")
        per_group = E // self.n_groups
        if self.n_groups > 1 and per_group < 2:
            raise ValueError(f"grouped routing scores a group by its 2 best experts, but n_groups={self.n_groups} "
                             f"leaves {per_group} expert per group: use fewer groups (valid: divisors of {E} up to "
                             f"{E // 2}) or n_groups=1")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be between 1 and n_groups={self.n_groups}")
        if not 1 <= self.top_k <= self.topk_groups * per_group:
            raise ValueError(f"top_k={self.top_k} must be between 1 and the {self.topk_groups * per_group} experts "
                             f"a token can reach (topk_groups * n_routed_experts / n_groups): lower top_k")
        if self.bias_update_rate < 0:
            raise ValueError("bias_update_rate must be >= 0 (0 turns balancing off)")
        if self.first_dense_layers >= self.n_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} leaves no MoE layer of the "
                             f"n_layers={self.n_layers}: lower first_dense_layers (or use a dense Llama)")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense_layers


# --------------------------------------------------------------------------- grouped GEMM and dispatch


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[g]`` for the rows r of group g, groups contiguous: rows ``offs[g-1]:offs[g]``.

    x (N, a), w (G, a, b), offs (G,) int cumulative ends (``offs[-1] == N``) -> (N, b). Static
    shapes: each row's group is found by ``searchsorted`` and its weight gathered (one (1, a) x (a, b)
    product per row, N*a*b memory): a reference, exact against a loop over the groups."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # (N,) index of the group row r lies in
    return torch.bmm(x.unsqueeze(1), w[group]).squeeze(1)


def _native_grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CPU in fp32/bf16/fp16, but its meta kernel (what torch.export traces
    with) accepts bf16 only, and it needs 16-byte aligned strides; CUDA needs sm90+."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if (x.shape[-1] * x.element_size()) % 16 or (w.shape[-1] * w.element_size()) % 16:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type in ("cpu", "meta")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM over contiguous row groups (see :func:`grouped_mm_reference`):
    ``torch._grouped_mm`` where it can be captured and runs (bf16, aligned), else the reference."""
    if _native_grouped_mm_ok(x, w):
        return torch._grouped_mm(x, w, offs=offs.to(torch.int32))
    return grouped_mm_reference(x, w, offs)


def tokens_per_expert(expert_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_experts,) int64 count of the routed slots of ``expert_idx`` (any shape) per expert."""
    flat = expert_idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add(0, flat, torch.ones_like(flat))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as fused 3-D parameters, computed together by grouped GEMMs."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); expert_idx (T, k) long; weights (T, k)
        -> (T, d): ``y[t] = sum_j weights[t, j] * expert_{expert_idx[t, j]}(x[t])``."""
        k = expert_idx.shape[1]
        flat = expert_idx.reshape(-1)  # (T*k,) slot -> expert
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept within a group
        token = torch.div(order, k, rounding_mode="floor")  # (T*k,) the token of each sorted slot
        offs = torch.cumsum(tokens_per_expert(flat, self.n_experts), 0)  # (E,) group ends
        xs = x[token]  # (T*k, d)
        h = F.silu(grouped_mm(xs, self.w1.transpose(1, 2), offs)) * grouped_mm(xs, self.w3.transpose(1, 2), offs)
        ys = grouped_mm(h, self.w2.transpose(1, 2), offs)  # (T*k, d)
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        return torch.zeros_like(x).index_add(0, token, ys)


# --------------------------------------------------------------------------- MoE feed-forward layers


class MixtralMoE(nn.Module):
    """Softmax router, top-k renormalised, grouped SwiGLU experts; returns (y, aux, z)."""

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = GroupedExperts(config.n_experts, config.dim, config.ffn_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # (T, d)
        logits = self.router(xt).float()  # (T, E) router math in fp32
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (T, k)
        weights = top_p / top_p.sum(-1, keepdim=True)
        y = self.experts(xt, top_i, weights).reshape(shape)
        E = probs.shape[-1]
        frac = tokens_per_expert(top_i, E).to(probs.dtype) / top_i.numel()  # f_e: no gradient, a count
        aux = E * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return y, aux, z


class DeepSeekMoE(nn.Module):
    """Shared expert(s) + routed fine-grained experts, sigmoid affinities, bias-steered top-k."""

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.n_groups, self.topk_groups = config.top_k, config.n_groups, config.topk_groups
        self.routed_scaling_factor = config.routed_scaling_factor
        self.router = nn.Linear(config.dim, E, bias=False)
        # steers the choice only (DeepSeek-V3 eq. 16); state, not a parameter: saved with the model
        self.register_buffer("bias", torch.zeros(E, dtype=torch.float32))
        self.experts = GroupedExperts(E, config.dim, config.moe_ffn_hidden)
        self.shared = None
        if config.n_shared_experts > 0:  # n shared experts of one hidden each == one MLP of n hidden
            shared_cfg = dataclasses.replace(config, ffn_hidden=config.n_shared_experts * config.moe_ffn_hidden)
            self.shared = FeedForward(shared_cfg)

    def route(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert_idx (T, k), weights (T, k) fp32) of the tokens xt (T, d)."""
        scores = torch.sigmoid(self.router(xt).float())  # (T, E) affinities
        choice = scores + self.bias
        if self.n_groups > 1:  # node-limited routing: keep the topk_groups groups with the best 2-expert sums
            T, E = choice.shape
            grouped = choice.view(T, self.n_groups, E // self.n_groups)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
            keep = torch.zeros_like(group_score).scatter(1, group_score.topk(self.topk_groups, dim=-1).indices, 1.0)
            choice = grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(T, E)
        top_i = choice.topk(self.top_k, dim=-1).indices  # (T, k)
        top_s = scores.gather(1, top_i)  # weights from the affinities: the bias does not enter them
        weights = top_s / top_s.sum(-1, keepdim=True) * self.routed_scaling_factor
        return top_i, weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, tokens_per_expert (E,)) of x (b, s, d)."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        top_i, weights = self.route(xt)
        y = self.experts(xt, top_i, weights)
        if self.shared is not None:
            y = y + self.shared(xt)
        return y.reshape(shape), tokens_per_expert(top_i, self.bias.shape[0])


# --------------------------------------------------------------------------- blocks and models


class MoELosses(NamedTuple):
    ce: torch.Tensor  # mean cross-entropy over the targets that are not -100
    aux: torch.Tensor  # load-balancing loss, mean over the MoE layers (0 for DeepSeek-V3: aux-loss-free)
    z: torch.Tensor  # router z-loss, mean over the MoE layers (0 for DeepSeek-V3)


class MoEBlock(nn.Module):
    """Pre-norm block: llama attention, then an MoE or a dense MLP."""

    def __init__(self, config: LlamaConfig, ffn: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = ffn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        out = self.feed_forward(self.ffn_norm(x))
        if isinstance(out, tuple):
            return (x + out[0], *out[1:])
        return (x + out,)


class MoETransformer(nn.Module):
    """What Mixtral and DeepSeekV3 share: embeddings, RoPE tables, blocks, norm, head, the CE loss."""

    config: LlamaConfig

    def __init__(self, config: LlamaConfig, ffns: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([MoEBlock(config, ffn) for ffn in ffns])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE ``inv_freq`` buffer in place, e.g. after ``to_empty()`` from meta."""
        self.inv_freq.copy_(rope_inv_freq(self.config.head_dim, self.config.rope_theta, device=self.inv_freq.device))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) everywhere (experts and routers too); output projections (attention wo,
        MLP/expert down) scaled by 1/sqrt(2*n_layers), as models/llama.py; routing biases 0."""
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The init of one module's own tensors (Hugging Face's per-module convention)."""
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layers)
        if init_block_module(module, self.config.n_layers):  # the dense parts: as models/llama.py
            pass
        elif isinstance(module, GroupedExperts):
            nn.init.normal_(module.w1, mean=0.0, std=0.02)
            nn.init.normal_(module.w3, mean=0.0, std=0.02)
            nn.init.normal_(module.w2, mean=0.0, std=std_proj)
        elif isinstance(module, DeepSeekMoE):
            module.bias.zero_()
        elif module is self:
            self.init_buffers()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _trunk(self, idx: torch.Tensor):
        """(logits, per-layer extra outputs of the MoE layers)."""
        b, s = idx.size()
        h = self.tok_embeddings(idx)
        t = torch.arange(s, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())  # (s, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (s, hd)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        extras = []
        for layer in self.layers:
            h, *extra = layer(h, cos, sin)
            if extra:
                extras.append(extra)
        return self.output(self.norm(h)), extras

    @staticmethod
    def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


class Mixtral(MoETransformer):
    """Mixtral-style MoE transformer: every layer's MLP is a :class:`MixtralMoE`."""

    config: MixtralConfig

    def __init__(self, config: MixtralConfig) -> None:
        if not isinstance(config, MixtralConfig):
            raise TypeError(f"Mixtral needs a MixtralConfig, got {type(config).__name__}")
        super().__init__(config, [MixtralMoE(config) for _ in range(config.n_layers)])

    def loss_terms(self, idx: torch.Tensor, targets: torch.Tensor) -> MoELosses:
        logits, extras = self._trunk(idx)
        aux = torch.stack([a for a, _ in extras]).mean()
        z = torch.stack([z for _, z in extras]).mean()
        return MoELosses(self._ce(logits, targets), aux, z)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return self._trunk(idx)[0]
        ce, aux, z = self.loss_terms(idx, targets)
        return ce + self.config.aux_loss_coef * aux + self.config.z_loss_coef * z


class DeepSeekV3(MoETransformer):
    """DeepSeek-V3-style MoE transformer (standard attention): dense first layers, then DeepSeekMoE.

    Auxiliary-loss-free balancing: in training mode forward adds each MoE layer's routed-token
    counts to its ``expert_load`` buffer (an in-place buffer update, which torch.export carries as a
    buffer mutation); after the optimizer step the training loop calls :meth:`update_bias`."""

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config) -> None:
        if not isinstance(config, DeepSeekV3Config):
            raise TypeError(f"DeepSeekV3 needs a DeepSeekV3Config, got {type(config).__name__}")
        ffns = [DeepSeekMoE(config) if config.is_moe_layer(i) else FeedForward(config) for i in range(config.n_layers)]
        super().__init__(config, ffns)
        n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
        # routed slots per expert since the last update_bias, one row per MoE layer
        self.register_buffer("expert_load", torch.zeros(n_moe, config.n_routed_experts), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """RoPE's ``inv_freq``, and ``expert_load`` zeroed (so a model built on meta gets both values)."""
        super().init_buffers()
        if "expert_load" in self._buffers:  # not yet registered while the base constructor runs init_weights
            self.expert_load.zero_()

    @property
    def moe_layers(self) -> list[DeepSeekMoE]:
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, DeepSeekMoE)]

    def loss_terms(self, idx: torch.Tensor, targets: torch.Tensor) -> MoELosses:
        logits, extras = self._trunk(idx)
        self._count(extras)
        zero = logits.new_zeros((), dtype=torch.float32)
        return MoELosses(self._ce(logits, targets), zero, zero)

    def _count(self, extras) -> None:
        if self.training and extras:  # counts are integers: nothing here is differentiated
            self.expert_load.add_(torch.stack([c for (c,) in extras]).to(self.expert_load.dtype))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits, extras = self._trunk(idx)
        self._count(extras)
        if targets is None:
            return logits
        return self._ce(logits, targets)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None, rate: float | None = None) -> torch.Tensor:
        """``bias_e += rate * sign(mean_e(load) - load_e)`` in every MoE layer (DeepSeek-V3 §2.1.2):
        an overloaded expert's bias falls, an underloaded one's rises. ``load`` (n_moe_layers, E):
        the routed-token counts to balance (e.g. summed over data-parallel ranks by the caller);
        default: the ``expert_load`` counted by forward since the last call, which is then reset.
        ``rate`` defaults to ``config.bias_update_rate``. Returns the load it used."""
        rate = self.config.bias_update_rate if rate is None else rate
        layers = self.moe_layers
        if load is None:
            load = self.expert_load.clone()
            self.expert_load.zero_()
        if tuple(load.shape) != (len(layers), self.config.n_routed_experts):
            raise ValueError(f"load has shape {tuple(load.shape)}; expected (n_moe_layers, n_routed_experts) = "
                             f"({len(layers)}, {self.config.n_routed_experts})")
        load = load.float()
        for moe, row in zip(layers, load):
            moe.bias.add_(rate * torch.sign(row.mean() - row).to(moe.bias.device))
        return load
