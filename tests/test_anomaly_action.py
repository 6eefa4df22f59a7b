"""Anomalies that act (router/reporting/anomaly_monitor.py): the monitor fed by an in-process engine's steps. After a
warm-up on a tiny model, one gate's weights are scaled up (its top-1 score jumps toward 1): the monitor raises a
gate-confidence anomaly, the gauge reads 1, and a request asking for dynamic_k is served with exact routing (its
tokens are stock greedy's on the changed model, not dynamic_k's), its step spans saying so; with the weights put
back the anomaly ends after ``recovery`` steps and dynamic_k is dynamic_k again."""

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.models.checkpoint import experts_modules
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import STOCK, RequestRouting, parse_policy, step_routing
from expertmesh.router.reporting.anomaly import BaselineConfig
from expertmesh.router.reporting.anomaly_monitor import ACTIONS, AnomalyMonitor
from expertmesh.serving import model_runner
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import FinishEvent, TokenEvent
from expertmesh.serving.request import GenerationRequest
from helpers import stock_greedy
from test_routing_policy import _LocalDispatcher, _model

CONFIG = BaselineConfig(window=128, warm_up=32, sigma=3.0, persistence=2, recovery=3)


def test_the_actions_are_the_settings_literal():
    from typing import get_args

    from expertmesh.config.settings import AnomalyAction, ServingConfig

    assert ACTIONS == get_args(AnomalyAction) == ("none", "exact_routing", "health_round", "exact_routing+health_round")
    assert ServingConfig().anomaly_action == "none" and ServingConfig().anomaly_sigma == 3.0
    with pytest.raises(ValueError):
        AnomalyMonitor(None, CONFIG, "circuit_break", MeterProvider().get_meter("x"))


def test_exact_step_routing_sets_every_policy_aside_and_keeps_the_domains():
    delta = RequestRouting(parse_policy("delta_gap", {}, 2, 8))
    assert step_routing([(delta, 3), (None, 2)], exact=True) is None, "all stock: the stock forward"
    counted = RequestRouting(parse_policy("dynamic_k", {}, 2, 8), domain="code")
    step = step_routing([(counted, 2), (delta, 1)], exact=True)
    assert step.k_rules is None and not step.biases and step.temperature is None and step.noise is None
    assert step.domains == ("code",) and step.domain_ids.tolist() == [0, 0, -1]
    assert step_routing([(counted, 2)], widen=[STOCK]).domains == step.domains  # as the guard's stock recompute


def _tokens(events):
    assert isinstance(events[-1], FinishEvent), events[-1]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def _active(reader) -> dict[tuple[str, int | None], int]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "expertmesh.anomaly.active":
                    for p in metric.data.data_points:
                        out[(p.attributes["signal"], p.attributes.get("layer"))] = p.value
    return out


def test_a_gate_confidence_anomaly_routes_every_request_exactly_while_it_lasts(monkeypatch):
    model = _model("mixtral")
    gate_bias = GateBias(model)
    k, e = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    widths: list[int] = []  # experts each token of each forward was sent to, per MoE layer
    for _, experts in experts_modules(model).values():
        experts.register_forward_pre_hook(lambda _m, a: widths.extend((a[1] < e).sum(dim=1).tolist()))
    reader = InMemoryMetricReader()
    monitor = AnomalyMonitor(
        gate_bias, CONFIG, "exact_routing", MeterProvider(metric_readers=[reader]).get_meter("test")
    )
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(model_runner, "tracer", lambda: provider.get_tracer("test"))
    dynamic = RequestRouting(parse_policy("dynamic_k", {"threshold": 1.0}, k, e))  # k + 1 experts for every token
    prompt = (9, 10, 11)
    engine = Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64, anomalies=monitor)
    engine.start()

    def serve(rid, prompt, n, routing=None) -> tuple[list[int], set[int]]:
        """The request's tokens, and the experts per token its steps used (served alone: one request a step)."""
        widths.clear()
        request = GenerationRequest(rid, tuple(prompt), max_new_tokens=n, stop_at_eos=False, routing=routing)
        return _tokens(list(engine.submit(request))), set(widths)

    gate = gate_bias.gates[0]
    random = torch.Generator().manual_seed(1)
    try:
        for i in range(6):  # warm-up: 6 varied prompts, 10 steps each
            serve(f"warm{i}", torch.randint(3, 128, (2 + i,), generator=random).tolist(), 10)
        assert monitor.detector.baselines["gate_confidence/0"].warm
        assert not monitor.exact_routing and _active(reader)[("gate_confidence", 0)] == 0
        assert serve("own", prompt, 8, dynamic)[1] == {k + 1}, "dynamic_k is served as asked"

        with torch.no_grad():
            gate.weight.mul_(50.0)  # layer 0's gate turns near one-hot: its top-1 score jumps toward 1
        serve("probe", (5, 6), CONFIG.persistence)  # a step per new token: the anomaly starts at the last
        assert monitor.exact_routing and 0 in monitor.gate_anomalies()
        assert _active(reader)[("gate_confidence", 0)] == 1
        spans.clear()
        tokens, used = serve("fallback", prompt, 8, dynamic)
        assert used == {k}, "served with exact routing, not its own policy"
        assert tokens == stock_greedy(model, list(prompt), 8)
        steps = [s for s in spans.get_finished_spans() if s.name == "expertmesh.step"]
        assert len(steps) == 8 and all(s.attributes.get("expertmesh.routing.exact_fallback") is True for s in steps)
        assert monitor.exact_routing, "the anomaly lasts while the gate stays changed"

        with torch.no_grad():
            gate.weight.div_(50.0)
        serve("recover", (5, 6, 7, 8), CONFIG.recovery)  # back in band: the anomaly ends after recovery steps
        assert not monitor.exact_routing and _active(reader)[("gate_confidence", 0)] == 0
        spans.clear()
        assert serve("own again", prompt, 8, dynamic)[1] == {k + 1}
        assert not any("expertmesh.routing.exact_fallback" in s.attributes for s in spans.get_finished_spans())
    finally:
        engine.stop()


def test_a_gate_whose_margin_narrows_at_the_same_top_1_score_is_an_anomaly_that_acts():
    """The gate's second signal: the top-1 score stays at 0.5 while the runner-up closes in (top-1 minus top-2 from
    ~0.3 to 0.05): gate confidence stays in band, the margin leaves its baseline, and exact routing follows it."""
    monitor = AnomalyMonitor(None, CONFIG, "exact_routing", MeterProvider().get_meter("test"))
    random = torch.Generator().manual_seed(0)

    def step(second: float) -> None:
        p = torch.tensor([0.5, second] + [(0.5 - second) / 6] * 6).repeat(4, 1)  # [T=4, E=8], softmax of log p is p
        p[:, 2:] *= 1 + 0.05 * torch.rand(4, 6, generator=random)  # a little noise below the top two
        monitor.begin_step()
        monitor._gate(0, torch.log(p / p.sum(-1, keepdim=True) * 1.0), sigmoid=False)
        monitor.end_step()

    for i in range(CONFIG.warm_up + 4):
        step(0.2 + 0.01 * (i % 3))
    assert monitor.detector.baselines["gate_margin/0"].warm and not monitor.exact_routing
    for _ in range(CONFIG.persistence):
        step(0.45)
    assert monitor._active["gate_margin/0"] and not monitor._active["gate_confidence/0"]
    assert monitor.exact_routing and monitor.gate_anomalies() == [0]
    for _ in range(CONFIG.recovery):
        step(0.21)
    assert not monitor.exact_routing


def test_with_action_none_the_anomaly_is_reported_and_nothing_else():
    model = _model("mixtral")
    gate_bias = GateBias(model)
    config = BaselineConfig(window=8, warm_up=4, persistence=2)
    monitor = AnomalyMonitor(gate_bias, config, "none", MeterProvider().get_meter("test"))
    for _ in range(config.warm_up):  # the same prompt every step: a narrow band
        monitor.begin_step()
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]))
        monitor.end_step(0.25)
    with torch.no_grad():
        gate_bias.gates[0].weight.mul_(50.0)
        monitor.begin_step()
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    verdicts = {v.signal: v for v in monitor.end_step(0.25)}
    assert verdicts["gate_confidence/0"].breach and not verdicts["gate_confidence/0"].active  # persistence 2
    with torch.no_grad():
        monitor.begin_step()
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    verdicts = {v.signal: v for v in monitor.end_step(0.25)}
    assert (
        verdicts["gate_confidence/0"].started
        and verdicts["gate_confidence/0"].value > verdicts["gate_confidence/0"].mean
    )
    assert not verdicts["kv_fragmentation"].breach
    assert monitor.gate_anomalies() and not monitor.exact_routing
