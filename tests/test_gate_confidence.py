"""Gate-confidence histograms (router/reporting/gate_confidence.py): the values from known scores, and the
metric families with the right counts and sums after a forward through a tiny model's stock gates."""

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from transformers import AutoModelForCausalLM

from expertmesh.models.tiny import CONFIG_BUILDERS
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import gate_scores
from expertmesh.router.reporting.gate_confidence import (
    BOUNDARIES,
    MAX_TOKENS_RECORDED,
    RECORD_EVERY,
    confidence,
    record_gate_confidence,
)


def test_confidence_is_the_top1_score_and_its_lead_over_the_top2():
    scores = torch.tensor([[0.7, 0.2, 0.1], [0.34, 0.33, 0.33], [0.0, 1.0, 0.0], [0.5, 0.1, 0.5]])
    top1, margin = confidence(scores)
    assert torch.allclose(top1, torch.tensor([0.7, 0.34, 1.0, 0.5]))
    assert torch.allclose(margin, torch.tensor([0.5, 0.01, 1.0, 0.0]))  # a tie has margin 0
    sigmoid = confidence(gate_scores(torch.tensor([[0.0, 2.0, -1.0]]), sigmoid=True))
    assert torch.allclose(sigmoid[0], torch.sigmoid(torch.tensor([2.0])))
    assert torch.allclose(sigmoid[1], torch.sigmoid(torch.tensor([2.0])) - 0.5)


def _points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out[(metric.name, point.attributes["layer"])] = point
    return out


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])  # a softmax gate and a sigmoid one
def test_a_forward_records_each_layers_histograms(arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_BUILDERS[arch]()).eval()
    gate_bias = GateBias(model)
    reader = InMemoryMetricReader()
    record_gate_confidence(gate_bias, MeterProvider(metric_readers=[reader]).get_meter("test"))
    record_gate_confidence(gate_bias, MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("x"))  # no-op
    seen = {}
    for layer, gate in gate_bias.gates.items():
        gate.register_forward_hook(lambda _m, _a, out, layer=layer: seen.__setitem__(layer, out[0].detach()))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + MAX_TOKENS_RECORDED)[None])  # every token of the forward recorded
    points = _points(reader)
    assert {name for name, _ in points} == {
        "expertmesh.gate.top1_probability",
        "expertmesh.gate.top2_margin",
        "expertmesh.gate.duration",
    }
    assert {layer for _, layer in points} == set(gate_bias.gates)
    for layer in gate_bias.gates:  # one gate forward each, timed (how long: never asserted)
        assert (
            points[("expertmesh.gate.duration", layer)].count == 1
            and points[("expertmesh.gate.duration", layer)].sum > 0
        )
    for layer, logits in seen.items():
        top1, margin = confidence(gate_scores(logits, sigmoid=arch == "deepseek_v3"))
        for name, values in (("expertmesh.gate.top1_probability", top1), ("expertmesh.gate.top2_margin", margin)):
            point = points[(name, layer)]
            assert point.count == MAX_TOKENS_RECORDED and point.sum == pytest.approx(float(values.sum()), rel=1e-5)
            assert tuple(point.explicit_bounds) == BOUNDARIES
            assert point.max == pytest.approx(float(values.max())) and point.min == pytest.approx(float(values.min()))


def test_a_long_prefill_records_a_bounded_sample():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_BUILDERS["mixtral"]()).eval()
    gate_bias = GateBias(model)
    reader = InMemoryMetricReader()
    record_gate_confidence(gate_bias, MeterProvider(metric_readers=[reader]).get_meter("test"))
    seen = {}
    for layer, gate in gate_bias.gates.items():
        gate.register_forward_hook(lambda _m, _a, out, layer=layer: seen.__setitem__(layer, out[0].detach()))
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 200)))
    points = _points(reader)
    assert all(p.count == MAX_TOKENS_RECORDED for (name, _), p in points.items() if name != "expertmesh.gate.duration")
    # the recorded tokens are evenly spaced over the 200, the first and the last among them
    recorded = torch.linspace(0, 199, MAX_TOKENS_RECORDED).round().long()
    assert recorded[0] == 0 and recorded[-1] == 199
    for layer, logits in seen.items():
        top1, margin = confidence(gate_scores(logits, sigmoid=False))
        for name, values in (("expertmesh.gate.top1_probability", top1), ("expertmesh.gate.top2_margin", margin)):
            assert points[(name, layer)].sum == pytest.approx(float(values[recorded].sum()), rel=1e-5)
    assert all(p.count == 1 for (name, _), p in points.items() if name == "expertmesh.gate.duration")  # one forward


def test_each_gate_records_its_first_forward_and_every_record_every_th_after():
    """The sample over forwards: of 2 * RECORD_EVERY + 1 forwards, each layer records 3 (the first, and every
    RECORD_EVERY-th after it), their durations and their tokens' scores; the others record nothing."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_BUILDERS["mixtral"]()).eval()
    gate_bias = GateBias(model)
    reader = InMemoryMetricReader()
    record_gate_confidence(gate_bias, MeterProvider(metric_readers=[reader]).get_meter("test"))
    seen = {layer: [] for layer in gate_bias.gates}
    for layer, gate in gate_bias.gates.items():
        gate.register_forward_hook(lambda _m, _a, out, layer=layer: seen[layer].append(out[0].detach()))
    with torch.no_grad():
        for i in range(2 * RECORD_EVERY + 1):
            model(input_ids=torch.tensor([[3 + i, 4 + i]]))  # 2 tokens a forward
    points = _points(reader)
    for layer, logits in seen.items():
        assert points[("expertmesh.gate.duration", layer)].count == 3
        recorded = torch.cat([logits[i] for i in (0, RECORD_EVERY, 2 * RECORD_EVERY)])  # [6, E]
        top1, _ = confidence(gate_scores(recorded, sigmoid=False))
        point = points[("expertmesh.gate.top1_probability", layer)]
        assert point.count == 6 and point.sum == pytest.approx(float(top1.sum()), rel=1e-5)
