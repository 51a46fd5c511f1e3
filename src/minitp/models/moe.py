"""A mixture-of-experts variant of the plain model: no parallel code anywhere in it.

Each block's SwiGLU MLP becomes E experts (each a SwiGLU MLP of ``expert_hidden`` units) and a
router (a linear map D -> E). Every token goes to the k experts its router scores highest and comes
back as their outputs weighted by the router's probabilities (Switch/GShard style, the gates not
renormalised).

Capacity. An expert takes at most C = ceil(capacity_factor · S · k / E) assignments from one
sequence of S tokens; the ones past C are **dropped** (they contribute nothing; the residual carries
the token on). Each sequence is its own routing group (GShard's groups), and within it first choices
come before second choices, token order breaking ties. Why per sequence: which tokens drop then
depends on the sequence alone, never on how a batch is split over ranks, so expert parallel
(``minitp.ep``) drops exactly the tokens one process drops and the two stay equal, drops or not.

The auxiliary load-balancing loss (Switch Transformer): per sequence E · Σ_e f_e · P_e, with f_e the
share of the sequence's k·S assignments that chose expert e (before capacity) and P_e the mean
router probability of e; averaged over sequences (again so it splits over ranks as the language loss
does). It is 1 when routing is uniform and grows as it piles onto few experts. ``moe_loss`` adds it.

Shapes: B batch, S sequence, D dim, E experts, k experts per token, Fe an expert's hidden units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitp.models.llama import TINY, FeedForward, ModelConfig, Transformer, loss_fn


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    capacity_factor: float | None = 1.25  # None: no limit, no token is ever dropped
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be from 1 to n_experts={self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be > 0 (or None: no limit)")

    def expert_params(self) -> int:
        """Parameters of one expert: w1, w3 (D·Fe each) and w2 (Fe·D)."""
        return 3 * self.dim * self.expert_hidden

    def num_params(self) -> int:
        """The dense model's count with each block's MLP replaced by a router (E·D) and E
        experts."""
        dense_mlp = 3 * self.dim * self.ffn_hidden
        moe = self.n_experts * self.dim + self.n_experts * self.expert_params()
        return super().num_params() + self.n_layers * (moe - dense_mlp)

    def capacity(self, seq_len: int) -> int:
        """C: the most assignments one expert takes from one sequence of ``seq_len`` tokens (an
        expert gets a token at most once, so C >= seq_len never drops anything)."""
        if self.capacity_factor is None:
            return seq_len
        return min(seq_len, math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts))


def moe_config(base: ModelConfig = TINY, **changes) -> MoEConfig:
    """The MoE variant of ``base``: its attention and sizes, the MoE fields from ``changes``."""
    own = {f.name: getattr(base, f.name) for f in fields(ModelConfig)}
    return MoEConfig(**{**own, **changes})


TINY_MOE = moe_config(TINY)
# Mixtral 8x7B (Jiang et al. 2024, and its published config): LLaMA-like attention (32 query heads,
# 8 key/value heads) and 8 SwiGLU experts of 14,336 per layer, 2 per token, no token dropped; about
# 46.7 B parameters, 12.9 B of them used per token. For cost arithmetic (``minitp plan``): never
# materialised. ffn_hidden (the dense MLP it replaces, absent from num_params) is the experts'
# width, so that tensor parallel's checks of the MLP read the experts'.
MIXTRAL_8X7B = MoEConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_hidden=14336, max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2,
                         expert_hidden=14336, capacity_factor=None, aux_loss_coef=0.02)
MOE_PRESETS = {"mixtral-8x7b": MIXTRAL_8X7B}


# -- routing ---------------------------------------------------------------------------------------
@dataclass
class Routing:
    """Where one layer sent each token: the router's choice, its weights, and what capacity kept."""

    probs: torch.Tensor  # (B, S, E) fp32 softmax of the router's logits
    expert: torch.Tensor  # (B, S, k) the chosen experts, best first
    gate: torch.Tensor  # (B, S, k) their probabilities: the weights of the combine
    keep: torch.Tensor  # (B, S, k) bool: False where the expert was already full (dropped)

    @property
    def n_experts(self) -> int:
        return self.probs.shape[-1]

    def routed_per_expert(self) -> torch.Tensor:
        """(E,) assignments each expert was chosen for, before capacity."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.n_experts)

    def kept_per_expert(self) -> torch.Tensor:
        """(E,) assignments each expert computed (after capacity)."""
        return torch.bincount(self.expert[self.keep], minlength=self.n_experts)

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())


def capacity_mask(expert: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """(B, S, k) bool: which assignments fit in their expert's capacity, per sequence, first choices
    of every token before second choices, earlier tokens first."""
    B, S, k = expert.shape
    # (B, k·S, E), slot-major
    queue = F.one_hot(expert.transpose(1, 2).reshape(B, k * S), n_experts)
    place = ((queue.cumsum(1) - 1) * queue).sum(-1)  # (B, k·S): place in its expert's queue
    return (place < capacity).view(B, k, S).transpose(1, 2)  # (B, S, k)


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Top-k routing of router ``logits`` (B, S, E) with at most ``capacity`` per expert and
    sequence."""
    probs = logits.float().softmax(dim=-1)  # (B, S, E)
    gate, expert = probs.topk(top_k, dim=-1)  # (B, S, k)
    return Routing(probs, expert, gate, capacity_mask(expert, probs.shape[-1], capacity))


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch's auxiliary loss, per sequence E · Σ_e f_e · P_e, averaged over sequences."""
    B, S, k = routing.expert.shape
    E = routing.n_experts
    chosen = F.one_hot(routing.expert, E).sum(2).float()  # (B, S, E): 1 where e was among the k
    share = chosen.mean(1) / k  # (B, E) f_e: share of the sequence's assignments
    mean_prob = routing.probs.mean(1)  # (B, E) P_e
    return (E * (share * mean_prob).sum(-1)).mean()


def combine(expert_out: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's k expert outputs (B, S, k, D), zero where dropped, weighted by its gates -> (B,
    S, D)."""
    return (routing.gate.unsqueeze(-1).to(expert_out.dtype) * expert_out).sum(dim=2)


class RoutedFeedForward(nn.Module):
    """What every MoE feed-forward is, plain or expert parallel (``minitp.ep``): a router whose last
    routing (``routing``), auxiliary loss (``aux_loss``) and load per forward (``routed``,
    ``history``) it keeps. ``moe_layers`` finds the layers by this type."""

    config: MoEConfig
    top_k: int
    router: nn.Linear
    routing: Routing | None
    aux_loss: torch.Tensor | None
    history: list[torch.Tensor]
    routed: list[torch.Tensor]

    def route(self, x: torch.Tensor) -> Routing:
        """Route x (B, S, D); remember the routing and the auxiliary loss."""
        routing = route(self.router(x), self.top_k, self.config.capacity(x.shape[1]))
        self.routing, self.aux_loss = routing, load_balancing_loss(routing)
        self.history.append(routing.kept_per_expert())
        self.routed.append(routing.routed_per_expert())
        return routing


class MoEFeedForward(RoutedFeedForward):
    """Router + E SwiGLU experts, in place of a block's ``feed_forward``. Keeps the last forward's
    routing (``routing``), its auxiliary loss (``aux_loss``), and per forward the assignments each
    expert was chosen for (``routed``) and kept (``history``), (E,) each, for figures and
    formulas."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg.dim, cfg.expert_hidden)
                                     for _ in range(cfg.n_experts))
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []
        self.routed: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        routing = self.route(x)
        k = self.top_k
        tokens = x.reshape(B * S, D)
        # (B·S·k,) assignment a of token a // k
        expert, keep = routing.expert.reshape(-1), routing.keep.reshape(-1)
        out = x.new_zeros(B * S * k, D)
        for e, ffn in enumerate(self.experts):
            # its assignments, in (b, s, slot) order
            mine = ((expert == e) & keep).nonzero().squeeze(1)
            if mine.numel():
                out = out.index_copy(0, mine, ffn(tokens[mine // k]))
        return combine(out.view(B, S, k, D), routing)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE feed-forward layers (plain or expert-parallel), in block order (a pipeline
    stage's: the blocks it holds)."""
    blocks = [block for _, block in model.layers.named_children()]
    return [block.feed_forward for block in blocks if isinstance(block.feed_forward,
                                                                 RoutedFeedForward)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The auxiliary loss of the last forward, summed over the MoE layers."""
    return sum(layer.aux_loss for layer in moe_layers(model))


def moe_loss(model: nn.Module):
    """loss(logits, targets): next-token cross-entropy plus aux_loss_coef times the auxiliary
    loss."""
    coef = model.config.aux_loss_coef

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) + coef * aux_loss(model)

    return loss


def build_moe_model(cfg: MoEConfig = TINY_MOE, seed: int = 0) -> Transformer:
    """The plain model with every block's MLP replaced by ``MoEFeedForward``, weights from ``seed``:
    every rank that calls this gets the same model."""
    if not isinstance(cfg, MoEConfig):
        raise ValueError(
            f"build_moe_model needs a MoEConfig (see moe_config), got {type(cfg).__name__}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        for block in model.layers:
            block.feed_forward = MoEFeedForward(cfg)
        for p in model.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
    return model
