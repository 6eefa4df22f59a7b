"""The engine's step totals and histograms by kind (``serving.step_tally``), which ``bench serve`` reads
for the step time per decode token: each step counted once under its kind, with the tokens it fed.

The tiny Qwen3-MoE checkpoint with a local experts implementation stands in for the router's model (as
in ``test_engine_kv``)."""

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from expertmesh.serving import step_tally
from expertmesh.serving.request import GenerationRequest
from expertmesh.serving.step_tally import StepKind, StepTally, StepTotals, step_kind
from test_engine_kv import _engine, _run, model  # noqa: F401  (model: the module's fixture)


@pytest.mark.parametrize(
    "decoding, kind",
    [
        ([True], StepKind.DECODE),
        ([True, True, True], StepKind.DECODE),
        ([False], StepKind.PREFILL),
        ([False, False], StepKind.PREFILL),
        ([True, False], StepKind.MIXED),
        ([], StepKind.PREFILL),
    ],
)
def test_a_step_is_decode_only_when_every_sequence_feeds_its_newest_token(decoding, kind):
    assert step_kind(decoding) is kind


def test_totals_add_up_and_subtract_to_a_run():
    tally = StepTally()
    tally.record(StepKind.DECODE, 4, 0.5)
    before = tally.totals()
    tally.record(StepKind.DECODE, 4, 0.25)
    tally.record(StepKind.DECODE, 2, 0.25)
    tally.record(StepKind.PREFILL, 30, 1.0)
    run = tally.totals()[StepKind.DECODE].since(before[StepKind.DECODE])
    assert run == StepTotals(steps=2, tokens=6, seconds=0.5) and run.ms_per_token == pytest.approx(1e3 * 0.5 / 6)
    assert StepTotals().ms_per_token is None
    assert tally.totals()[StepKind.MIXED] == StepTotals()


def test_the_engine_counts_each_step_under_its_kind(model, monkeypatch):  # noqa: F811
    """Two 6-token prompts admitted together, 18 new tokens each, steps of at most 16 tokens: one prefill
    step of 12 tokens (it streams each first token), then 17 decode steps of 2 (tokens 2..18 each need
    their previous token fed). A third request joining mid-way makes mixed steps. The histograms hold
    one sample per step, by kind."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(step_tally, "meter", lambda: provider.get_meter("expertmesh"))
    pair = [
        GenerationRequest(f"r{i}", tuple(range(3 + i, 9 + i)), max_new_tokens=18, stop_at_eos=False) for i in (0, 1)
    ]
    engine = _engine(model, 64)
    _run(engine, pair)
    totals = engine.step_tally.totals()
    assert totals[StepKind.PREFILL].steps == 1 and totals[StepKind.PREFILL].tokens == 12
    assert totals[StepKind.DECODE].steps == 17 and totals[StepKind.DECODE].tokens == 34
    assert totals[StepKind.MIXED] == StepTotals()
    assert all(t.seconds > 0 for t in (totals[StepKind.PREFILL], totals[StepKind.DECODE]))

    points = {
        (metric.name, point.attributes["kind"]): point
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        for point in metric.data.data_points
    }
    for kind in (StepKind.PREFILL, StepKind.DECODE):
        duration = points[("expertmesh.engine.step.duration", kind.value)]
        tokens = points[("expertmesh.engine.step.tokens", kind.value)]
        assert duration.count == tokens.count == totals[kind].steps
        assert tokens.sum == totals[kind].tokens and duration.sum == pytest.approx(totals[kind].seconds)


def test_a_request_joining_mid_generation_makes_mixed_steps(model):  # noqa: F811
    from test_engine_batching import _serve

    first = GenerationRequest("a", tuple(range(3, 9)), max_new_tokens=8, stop_at_eos=False)
    late = GenerationRequest("b", tuple(range(20, 40)), max_new_tokens=4, stop_at_eos=False)
    engine = _engine(model, 64)
    try:
        _serve(engine, [first], late=[late])
        assert engine.drain(timeout=30)
    finally:
        engine.stop()
    totals = engine.step_tally.totals()
    assert totals[StepKind.MIXED].steps >= 1, "b's prompt rode along with a's decode"
    fed = sum(t.tokens for t in totals.values())
    assert fed == (6 + 7) + (20 + 3), "every prompt token once, every generated token but the last once"
