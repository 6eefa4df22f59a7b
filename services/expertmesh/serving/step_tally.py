"""How long the engine's steps take, by kind: a histogram for dashboards and totals for benchmarks.

Glossary
- *step*: one forward of the packed batch (or, under the per-sequence fallback, one round of
  per-sequence forwards), from building the batch to the last sequence's next token.
- *kind* (``StepKind``): ``decode`` when every sequence of the step feeds exactly its newest token (the
  steady state of generation, whose time per token is issue 22's "step time per decode token");
  ``prefill`` when none does (prompt chunks, or a preempted sequence computing its tokens again);
  ``mixed`` otherwise (chunked prefill riding along with decodes).

Metrics (OpenTelemetry; in Prometheus ``expertmesh_engine_step_duration_seconds`` and
``expertmesh_engine_step_tokens``, both by ``kind``; vLLM's nearest is ``vllm:iteration_tokens_total``,
tokens per engine step):
- ``expertmesh.engine.step.duration`` (s): one sample per step;
- ``expertmesh.engine.step.tokens``: the tokens one step fed through the model.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Sequence

from expertmesh.infra.telemetry.setup import meter

__all__ = ["StepKind", "StepTally", "StepTotals", "step_kind"]


class StepKind(str, enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"


def step_kind(decoding: Sequence[bool]) -> StepKind:
    """The kind of a step whose sequences are ``decoding`` (each: it feeds only its newest token)."""
    if decoding and all(decoding):
        return StepKind.DECODE
    return StepKind.MIXED if any(decoding) else StepKind.PREFILL


@dataclass(frozen=True)
class StepTotals:
    """Steps of one kind since the engine started: how many, the tokens they fed, their wall time."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def since(self, earlier: "StepTotals") -> "StepTotals":
        return StepTotals(self.steps - earlier.steps, self.tokens - earlier.tokens, self.seconds - earlier.seconds)

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 * self.seconds / self.tokens if self.tokens else None


#: bucket bounds: seconds (a decode step of a small model on CPU to a long prefill on a big one), and tokens
#: (vLLM's ``iteration_tokens_total`` buckets)
DURATION_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTally:
    """Records each step in the histograms and in running totals (read by a benchmark in this process)."""

    def __init__(self) -> None:
        m = meter()
        self._duration = m.create_histogram(
            "expertmesh.engine.step.duration",
            unit="s",
            description="wall time of one engine step, by kind",
            explicit_bucket_boundaries_advisory=DURATION_BOUNDS,
        )
        self._tokens = m.create_histogram(
            "expertmesh.engine.step.tokens",
            unit="{token}",
            description="tokens one engine step fed, by kind",
            explicit_bucket_boundaries_advisory=TOKEN_BOUNDS,
        )
        self._lock = threading.Lock()
        self._totals = {kind: StepTotals() for kind in StepKind}

    def record(self, kind: StepKind, tokens: int, seconds: float) -> None:
        attributes = {"kind": kind.value}
        self._duration.record(seconds, attributes)
        self._tokens.record(tokens, attributes)
        with self._lock:
            old = self._totals[kind]
            self._totals[kind] = StepTotals(old.steps + 1, old.tokens + tokens, old.seconds + seconds)

    def totals(self) -> dict[StepKind, StepTotals]:
        with self._lock:
            return dict(self._totals)
