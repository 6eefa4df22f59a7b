"""The router's anomaly monitor: feeds ``anomaly``'s rolling baselines once per engine step, and reports and acts.

Signals, one observation per step (the serving engine calls ``begin_step`` before a step's forward and
``end_step`` after it; the per-sequence fallback's several forwards make one step):

- ``gate_confidence`` {layer}: the mean top-1 gate score of the step's tokens at that MoE layer, from a forward
  hook on every gate (the scores as the tokens were routed, as ``gate_confidence``'s histograms read them): a
  sum and a count per layer per step, moved to the host once at the step's end
- ``kv_fragmentation``: the KV pool's fragmentation when the step was scheduled (``KVUsage.fragmentation``)

A breach that starts an anomaly logs a warning (signal, value, mean, std, sigma), one that ends it an info line.
Metrics (Prometheus names): ``expertmesh_anomaly_active`` {signal, layer} 1 while the signal's anomaly lasts, else
0 (layer absent for kv_fragmentation), and ``expertmesh_anomalies_total`` {signal, layer}, anomalies started.

Action (``ServingConfig.anomaly_action``): ``exact_routing`` makes ``exact_routing`` true while any layer's
gate-confidence anomaly lasts; the engine then builds every step's routing exact (``step_routing(exact=True)``),
whatever policy its requests asked for, and back when the last one ends. ``none``: report only.
"""

from __future__ import annotations

import logging
from typing import get_args

import torch
from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.config.settings import AnomalyAction
from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import gate_scores
from expertmesh.router.reporting.anomaly import AnomalyDetector, BaselineConfig, Verdict

__all__ = ["ACTIONS", "GATE_CONFIDENCE", "KV_FRAGMENTATION", "AnomalyAction", "AnomalyMonitor"]

log = logging.getLogger(__name__)

#: the actions, as the setting's type spells them (``ServingConfig.anomaly_action``)
ACTIONS: tuple[str, ...] = get_args(AnomalyAction)
GATE_CONFIDENCE = "gate_confidence"
KV_FRAGMENTATION = "kv_fragmentation"


def _key(signal: str, layer: int | None) -> str:
    return signal if layer is None else f"{signal}/{layer}"


def _labels(key: str) -> dict[str, object]:
    signal, _, layer = key.partition("/")
    return {"signal": signal, "layer": int(layer)} if layer else {"signal": signal}


class AnomalyMonitor:
    """See the module. The engine's thread calls ``begin_step`` / ``end_step`` and runs the hooked gates; an
    exporter's thread reads only the snapshot ``_active`` (replaced whole)."""

    def __init__(
        self,
        gate_bias: GateBias | None,
        config: BaselineConfig = BaselineConfig(),
        action: AnomalyAction = "none",
        metrics_meter=None,
    ):
        if action not in ACTIONS:
            raise ValueError(f"anomaly action {action!r}: expected one of {', '.join(ACTIONS)}")
        self.detector = AnomalyDetector(config)
        self.action = action
        #: layer -> (sum of the step's top-1 scores, tokens), on the gate's device
        self._step: dict[int, tuple[torch.Tensor, int]] = {}
        #: signal key -> anomaly on, after the latest step
        self._active: dict[str, bool] = {}
        m = metrics_meter or meter()
        self._started = m.create_counter("expertmesh.anomalies", description="anomalies started, by signal")
        m.create_observable_gauge(
            "expertmesh.anomaly.active",
            [self._observe_active],
            description="1 while the signal is more than anomaly_sigma standard deviations off its rolling baseline",
        )
        if gate_bias is not None:
            for layer, gate in gate_bias.gates.items():
                sigmoid = hasattr(gate, "e_score_correction_bias")
                gate.register_forward_hook(
                    lambda _m, _args, out, layer=layer, sigmoid=sigmoid: self._gate(layer, out, sigmoid)
                )

    # -- the engine's side --------------------------------------------------------------------

    @property
    def exact_routing(self) -> bool:
        """Whether the next step must route every token exactly (the action is on and a gate-confidence anomaly
        lasts)."""
        return self.action == "exact_routing" and self.gate_anomalies() != []

    def gate_anomalies(self) -> list[int]:
        """The MoE layers whose gate confidence is anomalous now."""
        return sorted(
            int(k.partition("/")[2]) for k, on in self._active.items() if on and k.startswith(GATE_CONFIDENCE)
        )

    def begin_step(self) -> None:
        """A step's forward begins: what the gates saw before (a warm-up, a forward outside any step) is dropped."""
        self._step = {}

    def end_step(self, kv_fragmentation: float | None = None) -> list[Verdict]:
        """The step is over: its observations judged, reported; the verdicts (for tests and callers)."""
        layers = sorted(self._step)
        values: dict[str, float] = {}
        if layers:
            sums = torch.stack([self._step[layer][0].float().cpu() for layer in layers]).tolist()
            for layer, total in zip(layers, sums):
                values[_key(GATE_CONFIDENCE, layer)] = total / self._step[layer][1]
        if kv_fragmentation is not None:
            values[KV_FRAGMENTATION] = float(kv_fragmentation)
        self._step = {}
        was_exact = self.exact_routing
        verdicts = self.detector.observe(values)
        for v in verdicts:
            if v.signal not in self._active:  # the counter's series from 0 at a signal's first step, for increase()
                self._started.add(0, _labels(v.signal))
            if v.started:
                self._started.add(1, _labels(v.signal))
                log.warning(
                    "anomaly: %s = %.4f left its baseline %.4f ± %g × %.4f",
                    v.signal,
                    v.value,
                    v.mean,
                    self.detector.config.sigma,
                    v.std,
                )
            elif v.ended:
                log.info("anomaly over: %s back within its baseline (%.4f, mean %.4f)", v.signal, v.value, v.mean)
        self._active = {**self._active, **{v.signal: v.active for v in verdicts}}
        if self.exact_routing != was_exact:
            if self.exact_routing:
                log.warning(
                    "every request is routed exactly while the gate confidence of layers %s is anomalous",
                    self.gate_anomalies(),
                )
            else:
                log.info("gate confidence back within its baseline: requests get their own routing policies again")
        return verdicts

    # -- hooks and metrics ------------------------------------------------------------------------

    def _gate(self, layer: int, out, sigmoid: bool) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] < 2 or logits.numel() == 0:
            return
        scores = gate_scores(logits.detach().reshape(-1, logits.shape[-1]), sigmoid)  # [T, E]
        top1 = scores.float().max(dim=-1).values.sum()
        total, tokens = self._step.get(layer, (0.0, 0))
        self._step[layer] = (top1 + total, tokens + scores.shape[0])

    def _observe_active(self, options: CallbackOptions):
        return [Observation(1 if on else 0, _labels(key)) for key, on in sorted(self._active.items())]
