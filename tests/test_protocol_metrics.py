"""The model-server protocol's gauges (``serving.protocol_metrics``), scraped from a running router's /metrics:
`expertmesh up --http-port 0` with one active sequence at most, so that of three long requests one runs and two
wait; the gauges say so while they are in flight and go back to 0 once they are cancelled."""

from __future__ import annotations

import grpc
import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.client import generate_request
from expertmesh.infra.telemetry import PROMETHEUS_METRICS
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.serving.protocol_metrics import EPP_METRIC_FLAGS, MAX_MODEL_LABEL, model_label
from expertmesh.v1 import inference_pb2_grpc as pb_grpc
from helpers import Up, wait_for

CONTEXT = 2048
BLOCK_SIZE = 16
MODEL = "protocol-ckpt"


def test_the_model_label_is_bounded_and_never_empty():
    assert model_label("m" * (MAX_MODEL_LABEL + 50)) == "m" * MAX_MODEL_LABEL
    assert model_label("") == "unnamed"
    assert model_label("mixtral-8x7b") == "mixtral-8x7b"


def test_the_endpoint_picker_is_told_names_the_router_exports():
    named = {flag: name for flag, name in EPP_METRIC_FLAGS.items() if name}
    assert set(named) == {
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
        "cache-info-metric",
    }
    assert set(named.values()) <= PROMETHEUS_METRICS
    assert EPP_METRIC_FLAGS["lora-info-metric"] == "", "no adapters: the EPP must not look for them"


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_ray_address):
    path = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("protocol") / MODEL,
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=CONTEXT,
    )
    up = Up(
        "--model",
        str(path),
        "--http-port",
        "0",
        "--max-active",
        "1",
        "--max-new-tokens-cap",
        str(CONTEXT),
        "--kv-block-size",
        str(BLOCK_SIZE),
        "--ray-address",
        shared_ray_address,
    )
    try:
        url = up.wait_for_stderr(r"OpenAI-compatible HTTP API on (\S+)/v1").group(1)
        yield up, url
    finally:
        if up.proc.poll() is None:
            up.stop()


def _scrape(url: str) -> dict[str, object]:
    """Prometheus name -> its family, from the router's /metrics."""
    response = httpx2.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _gauge(families, name: str) -> tuple[float, dict[str, str]]:
    """The one sample of gauge ``name``: (value, labels but the exporter's ``otel_scope_*``)."""
    family = families[name]
    assert family.type == "gauge", (name, family.type)
    (sample,) = family.samples
    return sample.value, {k: v for k, v in sample.labels.items() if not k.startswith("otel_scope_")}


def _load(url: str) -> tuple[float, float]:
    families = _scrape(url)
    return _gauge(families, "expertmesh_requests_waiting")[0], _gauge(families, "expertmesh_requests_running")[0]


@pytest.mark.slow
def test_waiting_running_and_kv_gauges_follow_the_requests_in_flight(served):
    up, url = served
    families = _scrape(url)
    for name in ("expertmesh_requests_waiting", "expertmesh_requests_running", "expertmesh_kv_usage"):
        value, labels = _gauge(families, name)
        assert value == 0 and labels == {"model_name": MODEL}, (name, value, labels)
    info, labels = _gauge(families, "expertmesh_kv_cache_config_info")
    capacity, _ = _gauge(families, "expertmesh_kv_blocks_capacity")
    assert info == 1
    assert labels == {"model_name": MODEL, "block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(int(capacity))}
    assert capacity >= 1

    # Three requests far longer than the scrapes take: one runs (max-active 1), two wait behind it.
    # A channel each: every stream starts at once, on its own connection.
    channels = [grpc.insecure_channel(up.target) for _ in range(3)]
    calls = [
        pb_grpc.InferenceStub(channel).Generate(
            generate_request([5 + i, 6, 7, 8], max_new_tokens=CONTEXT - 8, stop_at_eos=False)
        )
        for i, channel in enumerate(channels)
    ]
    try:
        # Whichever arrived first runs (the channels connect in no set order: waiting on one call's first token
        # could wait out another's whole answer); each of 2040 tokens, so the state lasts far longer than a scrape.
        wait_for(lambda: _load(url) == (2, 1), "two requests waiting behind one running")
        usage, labels = _gauge(_scrape(url), "expertmesh_kv_usage")
        assert 0 < usage <= 1 and labels == {"model_name": MODEL}
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    wait_for(lambda: _load(url) == (0, 0), "the cancelled requests leave both queues")
    assert _gauge(_scrape(url), "expertmesh_kv_usage")[0] == 0
