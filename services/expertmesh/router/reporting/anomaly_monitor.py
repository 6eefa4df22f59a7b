"""The router's anomaly monitor: feeds ``anomaly``'s rolling baselines once per engine step, and reports and acts.

Signals (the serving engine calls ``begin_step`` before a step's forward and ``end_step`` after it; the
per-sequence fallback's several forwards make one step):

- ``gate_confidence`` {layer}: the mean top-1 gate score of the step's tokens at that MoE layer, from a forward
  hook on every gate (the scores as the tokens were routed, as ``gate_confidence``'s histograms read them): a
  sum and a count per layer per step, moved to the host once at the step's end
- ``gate_margin`` {layer}: likewise the mean top-1 minus top-2 gate score (``gate_confidence``'s
  ``top2_margin``): a gate that still picks one expert but no longer by much is unsure too
- ``kv_fragmentation``: the KV pool's fragmentation when the step was scheduled (``KVUsage.fragmentation``)
- ``load_share`` {layer, expert}: every ``load_share_every`` steps, each expert's share of its layer's tokens
  since the last observation, from the counts the router's load window already keeps (``LoadWindow.since_start``:
  one [L, E] copy and a few array operations, judged by one ``VectorBaseline``); a layer with fewer than
  ``load_share_min_tokens`` new tokens waits for the next one (its counts carry over)

A breach that starts an anomaly logs a warning (signal, value, mean, std, sigma), one that ends it an info line.
Metrics (Prometheus names): ``expertmesh_anomaly_active`` {signal, layer} 1 while the signal's anomaly lasts (for
load_share: any expert of the layer's), else 0 (layer absent for kv_fragmentation), and
``expertmesh_anomalies_total`` {signal, layer}, anomalies started (for load_share: one per expert).

Actions (``ServingConfig.anomaly_action``): ``exact_routing`` makes ``exact_routing`` true while any layer's
gate-confidence or gate-margin anomaly lasts; the engine then builds every step's routing exact
(``step_routing(exact=True)``), whatever policy its requests asked for, and back when the last one ends.
``health_round``: a load-share, gate-confidence or gate-margin anomaly that starts is handed to ``publish`` as an
``AnomalyRecord`` naming the implicated (layer, expert) pairs (the experts whose share moved; for the gate's
signals the layer's most loaded experts, at most ``max_pairs``), which the health monitor answers with an early
round on them (``AnomalyPublisher`` writes it to the store). ``exact_routing+health_round``: both. ``none``: report
only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, get_args

import numpy as np
import torch
from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.config.settings import AnomalyAction
from expertmesh.contracts.load_window import LoadWindow
from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import gate_scores
from expertmesh.router.reporting.anomaly import AnomalyDetector, BaselineConfig, VectorBaseline, Verdict
from expertmesh.store import AnomalyRecord

__all__ = [
    "ACTIONS",
    "GATE_CONFIDENCE",
    "GATE_MARGIN",
    "KV_FRAGMENTATION",
    "LOAD_SHARE",
    "AnomalyAction",
    "AnomalyMonitor",
]

log = logging.getLogger(__name__)

#: the actions, as the setting's type spells them (``ServingConfig.anomaly_action``)
ACTIONS: tuple[str, ...] = get_args(AnomalyAction)
GATE_CONFIDENCE = "gate_confidence"
GATE_MARGIN = "gate_margin"
#: the signals of how sure a layer's gate is: an anomaly of either is a gate anomaly (exact routing, health rounds)
GATE_SIGNALS = (GATE_CONFIDENCE, GATE_MARGIN)
KV_FRAGMENTATION = "kv_fragmentation"
LOAD_SHARE = "load_share"


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
        *,
        load: LoadWindow | None = None,
        load_share_every: int = 16,
        load_share_min_tokens: int = 64,
        publish: Callable[[AnomalyRecord], None] | None = None,
        max_pairs: int = 64,
        clock: Callable[[], float] = time.time,
    ):
        if action not in ACTIONS:
            raise ValueError(f"anomaly action {action!r}: expected one of {', '.join(ACTIONS)}")
        if load_share_every < 1 or load_share_min_tokens < 1 or max_pairs < 1:
            raise ValueError("need load_share_every >= 1, load_share_min_tokens >= 1 and max_pairs >= 1")
        self.detector = AnomalyDetector(config)
        self.action = action
        self._publish = publish if "health_round" in action else None
        self._max_pairs = max_pairs
        self._clock = clock
        self._steps = 0
        #: the load window read every ``load_share_every`` steps, its counts at the last observation, the baseline
        self._load = load
        self._load_every = load_share_every
        self._load_min_tokens = load_share_min_tokens
        self._load_seen: np.ndarray | None = None  # [L, E] float64
        self._shares: VectorBaseline | None = None
        if load is not None:
            self._load_seen = load.since_start()
            self._shares = VectorBaseline(len(load.moe_layers) * load.num_experts, config)
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
        self._num_experts = dict(gate_bias.num_experts) if gate_bias is not None else {}
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
        return "exact_routing" in self.action and self.gate_anomalies() != []

    def gate_anomalies(self) -> list[int]:
        """The MoE layers whose gate confidence or margin is anomalous now."""
        return sorted(
            {int(k.partition("/")[2]) for k, on in self._active.items() if on and k.partition("/")[0] in GATE_SIGNALS}
        )

    def begin_step(self) -> None:
        """A step's forward begins: what the gates saw before (a warm-up, a forward outside any step) is dropped."""
        self._step = {}

    def end_step(self, kv_fragmentation: float | None = None) -> list[Verdict]:
        """The step is over: its observations judged, reported; the verdicts (for tests and callers)."""
        layers = sorted(self._step)
        values: dict[str, float] = {}
        if layers:
            sums = torch.stack([self._step[layer][0].float().cpu() for layer in layers]).tolist()  # [layers, 2]
            for layer, (top1, margin) in zip(layers, sums):
                tokens = self._step[layer][1]
                values[_key(GATE_CONFIDENCE, layer)] = top1 / tokens
                values[_key(GATE_MARGIN, layer)] = margin / tokens
        if kv_fragmentation is not None:
            values[KV_FRAGMENTATION] = float(kv_fragmentation)
        self._step = {}
        was_exact = self.exact_routing
        gate_before = set(self.gate_anomalies())  # a layer's gate anomaly is one, whichever signal starts it
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
        for v in verdicts:
            signal, _, layer = v.signal.partition("/")
            if v.started and signal in GATE_SIGNALS and int(layer) not in gate_before:
                gate_before.add(int(layer))  # one record a layer, when its first gate signal starts
                self._record(signal, int(layer), self._busiest(int(layer)), v.value, v.mean, v.std)
        self._steps += 1
        if self._load is not None and self._steps % self._load_every == 0:
            self._observe_load()
        if self.exact_routing != was_exact:
            if self.exact_routing:
                log.warning(
                    "every request is routed exactly while the gate confidence of layers %s is anomalous",
                    self.gate_anomalies(),
                )
            else:
                log.info("gate confidence back within its baseline: requests get their own routing policies again")
        return verdicts

    # -- load share -------------------------------------------------------------------------------

    def _observe_load(self) -> None:
        """Each expert's share of its layer's tokens since the last observation, judged (see the module)."""
        window, baseline = self._load, self._shares
        counts = window.since_start()  # [L, E]
        new = counts - self._load_seen  # [L, E]
        tokens = new.sum(axis=1)  # [L]
        ready = tokens >= self._load_min_tokens  # [L]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(ready[:, None], new / tokens[:, None], np.nan)  # [L, E]
        self._load_seen[ready] = counts[ready]
        v = baseline.observe(share.ravel())
        E = window.num_experts
        first = _key(LOAD_SHARE, window.moe_layers[0]) not in self._active if window.moe_layers else False
        active = {}
        for row, layer in enumerate(window.moe_layers):
            key = _key(LOAD_SHARE, layer)
            active[key] = bool(v.active[row * E : (row + 1) * E].any())
            if first:  # the counter's series from 0, for increase()
                self._started.add(0, _labels(key))
        started = np.flatnonzero(v.started)
        ended = np.flatnonzero(v.ended)
        by_layer: dict[int, list[int]] = {}
        for i in started.tolist():
            by_layer.setdefault(window.moe_layers[i // E], []).append(i)
        for layer, idx in sorted(by_layer.items()):
            self._started.add(len(idx), _labels(_key(LOAD_SHARE, layer)))
            worst = max(idx, key=lambda i: abs(v.value[i] - v.mean[i]) / max(v.std[i], self.detector.config.min_std))
            log.warning(
                "anomaly: load_share of layer %d experts %s left their baselines (expert %d: %.4f against %.4f ± %g × "
                "%.4f)",
                layer,
                [i % E for i in idx],
                worst % E,
                v.value[worst],
                v.mean[worst],
                self.detector.config.sigma,
                v.std[worst],
            )
            pairs = [(layer, i % E) for i in idx][: self._max_pairs]
            self._record(LOAD_SHARE, layer, pairs, v.value[worst], v.mean[worst], v.std[worst])
        if ended.size:
            log.info(
                "anomaly over: load_share back within its baseline for (layer, expert) %s",
                [(window.moe_layers[i // E], i % E) for i in ended.tolist()],
            )
        self._active = {**self._active, **active}

    def load_share_anomalies(self) -> list[tuple[int, int]]:
        """The (layer, expert) pairs whose load share is anomalous now."""
        if self._shares is None:
            return []
        E = self._load.num_experts
        return [(self._load.moe_layers[i // E], i % E) for i in np.flatnonzero(self._shares.active).tolist()]

    # -- the health_round action ----------------------------------------------------------------

    def _busiest(self, layer: int) -> list[tuple[int, int]]:
        """Up to ``max_pairs`` experts of ``layer``, the most loaded first (the load window's counts; without one,
        the first experts)."""
        if self._publish is None:
            return []
        if self._load is not None and layer in self._load.moe_layers:
            counts = self._load.since_start()[self._load.moe_layers.index(layer)]  # [E]
            order = np.argsort(-counts, kind="stable")[: self._max_pairs]
            return [(layer, int(e)) for e in order]
        experts = self._num_experts.get(layer, 0)
        return [(layer, e) for e in range(min(experts, self._max_pairs))]

    def _record(self, signal: str, layer: int, pairs, value: float, mean: float, std: float) -> None:
        if self._publish is None or not pairs:
            return
        record = AnomalyRecord(
            "",
            0,
            signal,
            layer,
            tuple(pairs),
            self._clock(),
            float(value),
            float(mean),
            float(std),
            self.detector.config.sigma,
        )
        try:
            self._publish(record)
        except Exception:  # the engine's step must not fail for a report
            log.warning("could not hand over the anomaly record of %s layer %d", signal, layer, exc_info=True)

    # -- hooks and metrics ------------------------------------------------------------------------

    def _gate(self, layer: int, out, sigmoid: bool) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] < 2 or logits.numel() == 0:
            return
        scores = gate_scores(logits.detach().reshape(-1, logits.shape[-1]), sigmoid)  # [T, E]
        top2 = scores.float().topk(2, dim=-1).values  # [T, 2]
        sums = torch.stack((top2[:, 0].sum(), (top2[:, 0] - top2[:, 1]).sum()))  # [2]: top-1, margin
        total, tokens = self._step.get(layer, (0.0, 0))
        self._step[layer] = (sums + total, tokens + scores.shape[0])

    def _observe_active(self, options: CallbackOptions):
        return [Observation(1 if on else 0, _labels(key)) for key, on in sorted(self._active.items())]
