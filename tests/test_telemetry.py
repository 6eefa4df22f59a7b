"""Traces and metrics end to end: `expertmesh up` (router, expert groups in Ray
workers) exports over OTLP/gRPC to a real receiver on loopback (``OtlpSink``: the
collector's trace and metrics services from opentelemetry-proto), and serves
Prometheus text.
Known requests go in; the test finds one trace per request with the documented
span tree, and metric values that match the routing the router did."""

import time
import urllib.request
from collections import defaultdict

import grpc
import pytest

from expertmesh.client import Client
from expertmesh.infra.telemetry import PROMETHEUS_METRICS
from expertmesh.infra.telemetry.sink import OtlpSink
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import Up

pytestmark = pytest.mark.slow


def _attrs(span):
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = list(x.int_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture(scope="module")
def receiver():
    sink = OtlpSink().start()
    yield sink, sink.port
    sink.stop()


PROMPTS = [[5, 6, 7, 8], [9, 10]]
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def run(receiver, tmp_path_factory, shared_ray_address):
    r, port = receiver
    model = make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("m"), with_tokenizer=True, vocab_size=300)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }
    up = Up("--model", str(model), "--metrics-port", "0", "--ray-address", shared_ray_address, env=env)
    try:
        metrics_port = up.wait_for_stderr(r"Prometheus metrics on :(\d+)").group(1)
        with Client(up.target) as client:
            for prompt in PROMPTS:
                assert len(list(client.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False))) > 0
            with pytest.raises(grpc.RpcError):
                list(client.generate([], max_new_tokens=1))
        prometheus = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        # Span batches go out every 100 ms: wait until every group call the router exported has its compute
        # span from a group, before the groups stop.
        exported = lambda name: sum(s.name == name for _, s in list(r.spans))
        deadline = time.monotonic() + 60
        while not 0 < exported("expertmesh.group_call") == exported("expertmesh.group.compute"):
            assert time.monotonic() < deadline, "group spans never arrived"
            time.sleep(0.1)
        assert up.stop() == 0
        up.wait_for_stderr("stopping expert groups")  # its last line: the reader thread may lag the exit
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    return r, prometheus, "".join(up.stderr)


def test_one_trace_per_request_with_the_span_tree(run):
    r, _, _ = run
    by_trace = defaultdict(list)
    for service, span in r.spans:
        by_trace[span.trace_id].append((service, span))
    requests = [s for _, s in r.spans if s.name == "expertmesh.request"]
    assert len(requests) == len(PROMPTS) + 1  # the refused request is traced too
    served = sorted(
        (s for s in requests if "expertmesh.prompt_tokens" in _attrs(s)), key=lambda s: s.start_time_unix_nano
    )
    assert [_attrs(s)["expertmesh.prompt_tokens"] for s in served] == [len(p) for p in PROMPTS]
    assert len({s.trace_id for s in served}) == len(PROMPTS)
    for request in served:
        spans = by_trace[request.trace_id]
        by_id = {s.span_id: s for _, s in spans}
        named = lambda name: [s for _, s in spans if s.name == name]
        steps = named("expertmesh.step")
        assert len(steps) == NEW_TOKENS  # prefill + one decode per further token
        assert all(by_id[s.parent_span_id].name == "expertmesh.request" for s in steps)
        assert _attrs(request)["expertmesh.completion_tokens"] == NEW_TOKENS
        layers = named("expertmesh.moe_layer")
        assert len(layers) == NEW_TOKENS * 2  # two MoE layers per step
        assert all(by_id[s.parent_span_id].name == "expertmesh.step" for s in layers)
        calls = named("expertmesh.group_call")
        assert calls and all(by_id[c.parent_span_id].name == "expertmesh.moe_layer" for c in calls)
        for call in calls:
            a = _attrs(call)
            assert a["expertmesh.group"] in ("g0", "g1") and a["expertmesh.layer"] in (0, 1)
            assert a["expertmesh.tokens"] >= 1 and a["expertmesh.bytes_sent"] > 0 and a["expertmesh.bytes_received"] > 0
            assert a["expertmesh.experts_hit"] and all(0 <= e < 4 for e in a["expertmesh.experts_hit"])
        group_side = [(svc, s) for svc, s in spans if svc == "expertmesh-expert-group"]
        computes = [s for _, s in group_side if s.name == "expertmesh.group.compute"]
        assert len(computes) == len(calls), "each group call continues in the group's process"
        # Directly under its group call (shared memory and stream frames carry the call's context), or
        # under gRPC's server and client spans of a unary Dispatch.
        call_ids = {c.span_id for c in calls}
        for compute in computes:
            parent = by_id[compute.parent_span_id]
            assert parent.span_id in call_ids or by_id[parent.parent_span_id].name.endswith("ExpertGroup/Dispatch")


def _latest(r, name):
    """Data points of metric ``name`` in the last export that has it."""
    for request in reversed(r.metrics):
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        return m
    raise AssertionError(f"metric {name} never exported")


def test_metrics_match_the_routing(run):
    r, _, _ = run
    tokens = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)  # tokens each MoE layer routed
    load = _latest(r, "expertmesh.expert.tokens")
    per_layer = defaultdict(float)
    for point in load.sum.data_points:
        a = {x.key: x.value.int_value for x in point.attributes}
        per_layer[a["layer"]] += point.as_double
    assert dict(per_layer) == {0: tokens * 2.0, 1: tokens * 2.0}  # x top-2
    duration = _latest(r, "expertmesh.request.duration").histogram.data_points
    assert sum(p.count for p in duration) == len(PROMPTS)
    itl = _latest(r, "expertmesh.inter_token_latency").histogram.data_points
    assert sum(p.count for p in itl) == len(PROMPTS) * (NEW_TOKENS - 1)
    errors = _latest(r, "expertmesh.errors").sum.data_points
    assert [(p.attributes[0].value.string_value, p.as_int) for p in errors] == [("INVALID_ARGUMENT", 1)]
    calls = _latest(r, "expertmesh.group.call.duration").histogram.data_points
    labels = [{a.key: a.value.string_value for a in p.attributes} for p in calls]
    assert {x["group"] for x in labels} == {"g0", "g1"}
    assert {x["transport"] for x in labels} == {"shm"}  # the groups run on this host
    balanced = _latest(r, "expertmesh.layer.balancedness").gauge.data_points
    assert len(balanced) == 2 and all(0 < p.as_double <= 1 for p in balanced)
    entropy = _latest(r, "expertmesh.layer.routing_entropy").gauge.data_points
    assert all(0 < p.as_double <= 2.0 for p in entropy)  # log2(4 experts)
    # each finished sequence's consecutive token pairs, per layer: T - 1 for T = prompt + new tokens - 1 routed
    transitions = _latest(r, "expertmesh.routing.transitions").sum.data_points
    pairs = sum(len(p) + NEW_TOKENS - 2 for p in PROMPTS)
    assert sorted((p.attributes[0].value.int_value, p.as_int) for p in transitions) == [(0, pairs), (1, pairs)]
    oscillating = _latest(r, "expertmesh.routing.oscillations").sum.data_points
    assert all(0 <= p.as_int <= pairs for p in oscillating) and len(oscillating) == 2
    gate = _latest(r, "expertmesh.gate.duration").histogram.data_points
    assert len(gate) == 2 and all(p.count > 0 for p in gate)  # every step ran each layer's gate once


def test_prometheus_text_and_json_request_logs(run):
    import json

    _, prometheus, stderr = run
    for name in sorted(PROMETHEUS_METRICS):
        assert name in prometheus, name
    finished = [json.loads(line) for line in stderr.splitlines() if line.startswith("{") and "finished" in line]
    assert len(finished) == len(PROMPTS), "one info line per request"
    assert all(len(entry["trace_id"]) == 32 and entry["completion_tokens"] == NEW_TOKENS for entry in finished)
