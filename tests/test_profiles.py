"""Expert capability profiles (router/profiles.py): built from counts by domain, stored, read back; the
load window's counts by domain; and a request's routing as the router resolves it (serving/
request_routing.py): biases from the profile, the trained default classifier called once, only when
the policy needs a domain, under a ``classify`` span."""

import numpy as np
import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.classifier import default_classifier
from expertmesh.errors import InvalidRequest
from expertmesh.router.load_window import LoadSnapshot, LoadWindow
from expertmesh.router.profiles import build_profiles, load_profiles, lookup, save_profiles
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.state import open_store
from expertmesh.v1 import inference_pb2 as pb

LAYERS = (1, 3)


def _loads():
    code = np.array([[30.0, 10, 0, 0], [5, 5, 20, 10]])  # [L, E]
    legal = np.array([[0.0, 10, 20, 10], [10, 10, 10, 10]])
    return {"code": code, "legal": legal, "empty": np.zeros((2, 4))}


def test_shares_and_lifts_over_the_overall_share():
    profiles = build_profiles(_loads(), LAYERS)
    assert set(profiles) == {"code", "legal"}  # a domain with no tokens gets no profile
    code = profiles["code"]
    assert np.allclose(code.share.sum(axis=1), 1) and code.choices.tolist() == [40, 40]
    assert code.share[0].tolist() == [0.75, 0.25, 0, 0]
    # overall layer-1 shares: [30, 20, 20, 10] / 80
    assert np.allclose(code.lift[0], [0.75 / 0.375, 0.25 / 0.25, 0, 0])
    assert np.allclose(profiles["legal"].lift[1], [0.25 / (15 / 80), 0.25 / (15 / 80), 0.25 / (30 / 80), 0.25 / (20 / 80)])
    assert lookup(profiles, "legal/contract") is profiles["legal"] and lookup(profiles, "medical") is None
    store = open_store("memory://")
    save_profiles(store, profiles)
    back = load_profiles(store)
    assert set(back) == {"code", "legal"} and np.array_equal(back["code"].lift, code.lift) and back["code"].moe_layers == LAYERS
    assert build_profiles({}, LAYERS) == {}


def test_the_load_window_counts_by_domain_since_start():
    window = LoadWindow(LAYERS, num_experts=4, top_k=2)
    index = torch.tensor([[0, 1], [2, 4], [1, 3]])  # [T, K]; 4 is the skip sentinel
    window.record(1, index, domains=(torch.tensor([0, 0, 1]), ("code", "legal")))
    window.record(3, index)  # no domains: counted in load only
    snap = window.snapshot()
    assert snap.domain_load["code"][0].tolist() == [1, 1, 1, 0] and snap.domain_load["legal"][0].tolist() == [0, 1, 0, 1]
    assert snap.domain_load["code"][1].sum() == 0
    back = LoadSnapshot.from_bytes(snap.to_bytes())
    assert set(back.domain_load) == {"code", "legal"} and np.array_equal(back.domain_load["legal"], snap.domain_load["legal"])
    assert (back + back).domain_load["code"][0].tolist() == [2, 2, 2, 0]
    assert snap.to_stats_dict()["domain_load"]["legal"][0] == [0, 1, 0, 1]


@pytest.fixture(scope="module")
def spans():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_a_request_is_classified_once_and_only_when_its_policy_needs_a_domain(spans):
    store = open_store("memory://")
    save_profiles(store, build_profiles(_loads(), LAYERS))
    classifier, texts = default_classifier(), []

    class Counted:  # the trained default classifier, counting its calls
        domains = classifier.domains

        def classify(self, text):
            texts.append(text)
            return classifier.classify(text)

    router = RequestRouter(2, 4, LAYERS, "exact", store, kl_bound=0.1, classifier=Counted)
    query = "Write a Python function that parses a JSON file and returns a dict"

    def resolve(**fields):
        return router.resolve(pb.GenerateRequest(text=query, **fields), lambda: query)

    assert resolve() is None
    assert resolve(routing_policy=pb.RoutingPolicy(name="dynamic_k")).domain is None
    given = resolve(routing_policy=pb.RoutingPolicy(name="restrict", top_n=2), domain="legal")
    assert torch.isinf(given.biases[1]).tolist() == [True, False, False, True]  # legal's top 2 at layer 1: 2, then 1
    assert texts == [] and not [s for s in spans.get_finished_spans() if s.name == "classify"]

    classified = resolve(routing_policy=pb.RoutingPolicy(name="prefer", alpha=2))
    assert texts == [query] and classified.domain == "code"
    bias = classified.biases[1]
    assert torch.allclose(bias, torch.tensor([2 * 0.6, 0, -2, -2]), atol=1e-4)  # 2 tanh(log lift), lift [2, 1, 0, 0]
    (span,) = [s for s in spans.get_finished_spans() if s.name == "classify"]
    assert span.attributes["expertmesh.domain"] == "code" and 0 < span.attributes["expertmesh.confidence"] <= 1
    assert span.attributes["expertmesh.classify_ms"] > 0

    with pytest.raises(InvalidRequest, match="^domain: no capability profile for 'medical'"):
        resolve(routing_policy=pb.RoutingPolicy(name="prefer"), domain="medical")
    with pytest.raises(InvalidRequest, match="^domain: .*token-id prompt"):
        router.resolve(pb.GenerateRequest(routing_policy=pb.RoutingPolicy(name="prefer")), lambda: None)


def test_the_domain_heatmap_shows_each_domains_share_per_expert():
    from expertmesh.observability.domain_heatmap import domain_frequency, render_domain_heatmap

    domains, freq = domain_frequency(_loads(), top_k=2)
    assert domains == ["code", "legal"] and freq.shape == (2, 2, 4)  # [L, D, E]; the empty domain is left out
    assert np.allclose(freq.sum(axis=2), 2) and freq[0, 0].tolist() == [1.5, 0.5, 0, 0]
    assert render_domain_heatmap(_loads(), LAYERS, top_k=2, model_name="tiny")[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no tokens"):
        render_domain_heatmap({"code": np.zeros((2, 4))}, LAYERS, top_k=2)
