"""What ``expertmesh policy eval`` records about a routing policy, and the server's guard on it.

Per domain of the evaluated queries, and over all of them:
- *kl*: mean over positions of KL(exact || policy) of the next-token distributions (nats);
- *top1_agreement*: fraction of positions whose most likely next token is the same under both;
- *greedy_agreement*: fraction of greedily generated tokens that match exact's, position by position;
- *saved_params_per_token*: mean routed-expert parameters per token that exact activates and the policy
  does not (negative when the policy activates more, as dynamic_k may).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class QualityFigures:
    kl: float
    top1_agreement: float
    greedy_agreement: float
    saved_params_per_token: float
    positions: int


@dataclass(frozen=True)
class PolicyQuality:
    policy: str  # RoutingPolicy.key
    overall: QualityFigures
    per_domain: dict[str, QualityFigures] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "PolicyQuality":
        d = json.loads(text)
        return cls(
            d["policy"],
            QualityFigures(**d["overall"]),
            {k: QualityFigures(**v) for k, v in d.get("per_domain", {}).items()},
        )


def guard_problem(record: PolicyQuality | None, bound: float) -> str | None:
    """Why the server refuses a policy with this record, or None when it may serve it (no record: no
    evidence against it)."""
    if record is None or record.overall.kl <= bound:
        return None
    return (
        f"policy {record.policy} was measured at KL(exact || policy) = {record.overall.kl:.4g} nats per token, "
        f"above this server's bound of {bound:g}; set routing_policy.force to use it anyway"
    )


def kl_and_top1(exact_logp, policy_logp) -> tuple[float, int]:
    """exact_logp, policy_logp [P, V] next-token log-probabilities at the same P positions ->
    (sum over positions of KL(exact || policy) in nats, positions whose most likely token agrees)."""
    kl = (exact_logp.exp() * (exact_logp - policy_logp)).sum(dim=-1)  # [P]
    agree = exact_logp.argmax(dim=-1) == policy_logp.argmax(dim=-1)  # [P]
    return float(kl.clamp(min=0).sum()), int(agree.sum())


def same_positions(a: list[int], b: list[int]) -> int:
    """Tokens equal position by position (over the shorter of two greedy continuations)."""
    return sum(x == y for x, y in zip(a, b))


@dataclass
class Tally:
    """Running sums of one domain's (or all queries') comparisons."""

    kl: float = 0.0
    top1: int = 0
    positions: int = 0
    greedy_same: int = 0
    greedy_positions: int = 0
    choices_exact: float = 0.0  # expert choices (over all MoE layers) of the scored tokens, under exact
    choices_policy: float = 0.0
    tokens: int = 0  # scored tokens

    def figures(self, parameters_per_expert: int) -> QualityFigures:
        saved = (self.choices_exact - self.choices_policy) / max(self.tokens, 1) * parameters_per_expert
        return QualityFigures(
            kl=self.kl / max(self.positions, 1),
            top1_agreement=self.top1 / max(self.positions, 1),
            greedy_agreement=self.greedy_same / max(self.greedy_positions, 1),
            saved_params_per_token=saved,
            positions=self.positions,
        )
