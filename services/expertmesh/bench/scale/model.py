"""Shapes, cost models and the drifting Zipf load of the scale simulation: pure functions, no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ModelShape",
    "Costs",
    "DEEPSEEK_V3",
    "QUICK_MODEL",
    "day_tokens",
    "diurnal",
    "zipf_popularity",
    "expert_load",
]


@dataclass(frozen=True)
class ModelShape:
    """A MoE model's routed experts. Example: ``DEEPSEEK_V3`` (58 MoE layers x 256 experts, top-8)."""

    name: str
    moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    #: one expert's intermediate size (DeepSeek-V3's moe_intermediate_size)
    intermediate_size: int
    dtype_bytes: int = 2  # bf16

    @property
    def expert_bytes(self) -> int:
        """gate, up and down projections: 3 x H x I parameters."""
        return 3 * self.hidden_size * self.intermediate_size * self.dtype_bytes

    @property
    def expert_flops_per_token(self) -> float:
        return 2.0 * 3 * self.hidden_size * self.intermediate_size

    @property
    def pairs(self) -> int:
        return self.moe_layers * self.num_experts


DEEPSEEK_V3 = ModelShape("deepseek-v3", 58, 256, 8, 7168, 2048)
#: small enough that a simulated hour takes well under a second (tests, --quick)
QUICK_MODEL = ModelShape("quick", 4, 16, 2, 256, 128)


@dataclass(frozen=True)
class Costs:
    """The simulated hardware. Defaults: H100-class GPUs, NVMe-fed weights, 200 Gb/s group NICs."""

    #: GPU memory a group gives expert weights (80 GB HBM, the rest for activations and buffers)
    budget_bytes: int = 64 * 10**9
    #: bytes/s an expert's weights load at (disk or host memory to the GPU)
    load_bytes_s: float = 2e9
    #: one unary RPC's round trip (Describe, Unload, a canary Dispatch)
    rpc_s: float = 0.002
    #: one state-store round trip, and the store's bytes/s to one client
    store_rtt_s: float = 0.0005
    store_bytes_s: float = 1.25e9
    #: a router's decode step: a new table is taken at the next step boundary
    step_s: float = 0.05
    #: a group's and the orchestrator's NIC, bytes/s
    group_net_bytes_s: float = 25e9
    orchestrator_net_bytes_s: float = 12.5e9
    #: sustained expert FLOP/s of one GPU at decode batch sizes
    gpu_flops: float = 2e14
    #: tokens one router feeds per second at the day's peak
    router_tokens_s: float = 1000.0

    def load_s(self, nbytes: int) -> float:
        return nbytes / self.load_bytes_s + self.rpc_s

    def fetch_s(self, nbytes: int) -> float:
        """A store GET of ``nbytes``."""
        return self.store_rtt_s + nbytes / self.store_bytes_s


def diurnal(hour: float) -> float:
    """Traffic at ``hour`` of the day over the peak (peak at 14:00, trough 0.1 at 02:00)."""
    return 0.55 + 0.45 * math.cos(2 * math.pi * (hour - 14.0) / 24.0)


def day_tokens(routers: int, router_tokens_s: float, hours: float) -> float:
    """Tokens ``routers`` routers feed from 00:00 over ``hours`` hours at ``diurnal`` traffic, each
    ``router_tokens_s`` a second at the peak: the integral of ``diurnal`` in closed form."""
    w = 2 * math.pi / 24.0
    peak_hours = 0.55 * hours + 0.45 / w * (math.sin(w * (hours - 14.0)) - math.sin(w * -14.0))
    return routers * router_tokens_s * 3600.0 * peak_hours


def zipf_popularity(
    layers: int,
    experts: int,
    hour: float,
    *,
    skew: float = 1.0,
    period_h: float = 4.0,
    churn: float = 0.25,
    seed: int = 0,
) -> np.ndarray:
    """[L, E] each expert's share of a layer's routed tokens at ``hour`` (rows sum to 1).

    Zipf(``skew``) over ranks; which expert holds which rank drifts: every ``period_h`` hours a
    ``churn`` fraction of each layer's ranks is reshuffled, and between two such epochs the shares
    move linearly from one ranking to the next. Deterministic in ``seed``.
    """
    zipf = 1.0 / np.arange(1, experts + 1) ** skew
    epoch, frac = divmod(hour / period_h, 1.0)
    ranks = _ranks(layers, experts, int(epoch) + 1, churn, seed)  # [epochs + 1, L, E]
    now = (1 - frac) * zipf[ranks[int(epoch)]] + frac * zipf[ranks[int(epoch) + 1]]
    return now / now.sum(axis=1, keepdims=True)


def _ranks(layers: int, experts: int, epochs: int, churn: float, seed: int) -> np.ndarray:
    """[epochs + 1, L, E] rank of each expert per epoch; each epoch reshuffles ``churn`` of the ranks."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(experts) for _ in range(layers)])
    out = [ranks.copy()]
    moved = max(2, round(churn * experts)) if churn > 0 else 0
    for _ in range(epochs):
        for layer in range(layers):
            chosen = rng.choice(experts, size=moved, replace=False)
            ranks[layer, chosen] = ranks[layer, rng.permutation(chosen)]
        out.append(ranks.copy())
    return np.stack(out)


def expert_load(popularity: np.ndarray, tokens: float, top_k: int) -> np.ndarray:
    """[L, E] tokens routed to each expert when ``tokens`` tokens pass every layer choosing ``top_k``."""
    return popularity * tokens * top_k
