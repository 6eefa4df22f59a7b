"""Canaries of the server's default routing policy: which requests try a candidate, and when it must stop. Pure.

Glossary
- *candidate*: a named policy with its parameters that would replace the server's default (the *baseline*).
- *arm*: ``baseline`` or ``candidate``. A request's arm is ``arm_of(key, share)``: the first 8 bytes of
  sha256(key) as a point in [0, 1), candidate below ``share``. Sticky: one key, one arm, on every router, and a
  key in the candidate arm stays there when the share grows.
- *key*: the client's canary key (``x-expertmesh-canary-key`` metadata or header, else the OpenAI ``user``),
  else the request id. A request that names its own policy is in no arm (``arm_for``).
- *sample*: every ``sample_every``-th new token (0, n, 2n, ...) of a request whose arm's policy is not exact: its
  position is computed again with the stock gate (a shadow recompute; then once more with the arm's policy, so
  the answer and its KV stay the arm's); it *agrees* when both logits rows have the same most likely next token
  (the top-1 agreement ``expertmesh policy eval`` measures).
- *state*: RUNNING, then PROMOTED (the candidate became the server's default), STOPPED, or AUTO_STOPPED: the
  candidate's agreement fell below ``min_agreement`` once it had ``min_samples`` samples (``judge``).
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass

from expertmesh.router.policy.routing_policy import RoutingPolicy

__all__ = [
    "BASELINE",
    "CANDIDATE",
    "ArmTally",
    "CanaryError",
    "CanarySpec",
    "CanaryState",
    "arm_for",
    "arm_of",
    "canary_spec",
    "judge",
    "sampled",
]

BASELINE, CANDIDATE = "baseline", "candidate"
ARMS = (BASELINE, CANDIDATE)
#: the largest share of traffic a candidate may take: a canary is the smaller arm
MAX_SHARE = 0.5
MIN_AGREEMENT = 0.9
MIN_SAMPLES = 200
SAMPLE_EVERY = 16
#: bounds of min_samples and sample_every
MAX_MIN_SAMPLES = 1_000_000
MAX_SAMPLE_EVERY = 4096


class CanaryState(enum.Enum):
    RUNNING = "running"
    PROMOTED = "promoted"
    STOPPED = "stopped"
    AUTO_STOPPED = "auto_stopped"

    @property
    def ended(self) -> bool:
        return self is not CanaryState.RUNNING


class CanaryError(ValueError):
    """A canary that cannot be started; ``field`` names the setting as the request spells it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class CanarySpec:
    """A canary: the candidate policy (validated, ``parse_policy``), its share of the requests that take the
    server's default, and the automatic stop's bound.

    Example: ``CanarySpec(parse_policy("delta_gap", {}, 2, 8), share=0.1)``: one key in ten tries delta_gap;
    stopped when fewer than 90% of its first 200 (and later) samples agree with exact."""

    candidate: RoutingPolicy
    share: float
    min_agreement: float = MIN_AGREEMENT
    min_samples: int = MIN_SAMPLES
    sample_every: int = SAMPLE_EVERY


def canary_spec(
    candidate: RoutingPolicy,
    share: float,
    min_agreement: float | None = None,
    min_samples: int | None = None,
    sample_every: int | None = None,
) -> CanarySpec:
    """A CanarySpec (None: the default), or CanaryError naming the first setting out of its range."""
    if candidate.is_exact:
        raise CanaryError("candidate.name", "the candidate must be a policy other than exact (exact is the stock gate)")
    if not (math.isfinite(share) and 0 < share <= MAX_SHARE):
        raise CanaryError("share", f"must be in (0, {MAX_SHARE:g}], got {share:g}")
    agreement = MIN_AGREEMENT if min_agreement is None else min_agreement
    if not (math.isfinite(agreement) and 0 <= agreement <= 1):
        raise CanaryError("min_agreement", f"must be in [0, 1], got {agreement:g}")
    samples = MIN_SAMPLES if min_samples is None else min_samples
    if not 1 <= samples <= MAX_MIN_SAMPLES:
        raise CanaryError("min_samples", f"must be in [1, {MAX_MIN_SAMPLES}], got {samples}")
    every = SAMPLE_EVERY if sample_every is None else sample_every
    if not 1 <= every <= MAX_SAMPLE_EVERY:
        raise CanaryError("sample_every", f"must be in [1, {MAX_SAMPLE_EVERY}], got {every}")
    return CanarySpec(candidate, float(share), float(agreement), int(samples), int(every))


def arm_of(key: str, share: float) -> str:
    """``key``'s arm at ``share``: candidate when sha256(key)'s first 8 bytes, over 2**64, are below it."""
    point = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2.0**64
    return CANDIDATE if point < share else BASELINE


def arm_for(key: str, share: float, explicit: bool) -> str | None:
    """The arm of a request with canary ``key`` that takes the server's default policy; None when it names its
    own (``explicit``): never moved into an arm, never counted."""
    return None if explicit else arm_of(key, share)


def sampled(index: int, sample_every: int) -> bool:
    """Whether new token ``index`` (0 the first) of a request is a sample (0 < ``sample_every``; 0: none is)."""
    return sample_every > 0 and index % sample_every == 0


@dataclass(frozen=True)
class ArmTally:
    """One arm's figures: requests routed into it, those finished and their seconds (submit to last token),
    sampled tokens and those that agreed with exact."""

    requests: int = 0
    finished: int = 0
    seconds: float = 0.0
    samples: int = 0
    agreeing: int = 0

    @property
    def mean_seconds(self) -> float | None:
        return self.seconds / self.finished if self.finished else None

    @property
    def agreement(self) -> float | None:
        """Agreeing / samples, None before the first sample."""
        return self.agreeing / self.samples if self.samples else None


def judge(spec: CanarySpec, candidate: ArmTally) -> str | None:
    """Why the canary must stop now (its candidate's agreement below the bound once it has ``min_samples``
    samples), or None."""
    agreement = candidate.agreement
    if candidate.samples < spec.min_samples or agreement is None or agreement >= spec.min_agreement:
        return None
    return (
        f"candidate {spec.candidate.spec} agreed with exact routing on {candidate.agreeing} of {candidate.samples} "
        f"sampled tokens ({agreement:.1%}), below the bound of {spec.min_agreement:.1%}"
    )
