"""The router's side of the ``health_round`` anomaly action (router/reporting/anomaly_monitor.py, anomaly_publisher.py):
each expert's load share, read from the load window every few steps and judged by one vectorised baseline; an
anomaly that starts (load share, or a layer's gate confidence) handed over as an ``AnomalyRecord`` naming the
implicated (layer, expert) pairs, which the publisher numbers and writes to the store, bounded. The orchestrator's
side is tests/orchestrator/test_health_anomalies.py."""

import json
import time

import numpy as np
import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from expertmesh.contracts.load_window import LoadWindow
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.reporting.anomaly import BaselineConfig
from expertmesh.router.reporting.anomaly_monitor import AnomalyMonitor
from expertmesh.router.reporting.anomaly_publisher import AnomalyPublisher
from expertmesh.store import AnomalyRecord, open_store
from test_anomaly_action import _active
from test_routing_policy import _model

CONFIG = BaselineConfig(window=64, warm_up=8, sigma=3.0, persistence=2, recovery=3)
E, TOKENS = 4, 64


def _route(window: LoadWindow, rng, hot: tuple[int, int] | None = None) -> None:
    """One step's routing of TOKENS tokens (top-2) at each layer: the two experts drawn at random from all four
    (each expert about a quarter of the choices), or with ``hot`` = (layer, expert) that expert in every token."""
    for layer in window.moe_layers:
        ids = np.stack([rng.permutation(E)[:2] for _ in range(TOKENS)])  # [T, 2]
        if hot is not None and hot[0] == layer:
            ids[:, 0] = hot[1]
            ids[:, 1] = np.where(ids[:, 1] == hot[1], (hot[1] + 1) % E, ids[:, 1])
        window.record(layer, torch.from_numpy(ids))


def _monitor(action, window, **kw):
    reader = InMemoryMetricReader()
    records: list[AnomalyRecord] = []
    monitor = AnomalyMonitor(
        None,
        CONFIG,
        action,
        MeterProvider(metric_readers=[reader]).get_meter("test"),
        load=window,
        load_share_every=2,
        publish=records.append,
        clock=lambda: 1234.5,
        **kw,
    )
    return monitor, records, reader


def test_a_load_share_shift_names_the_expert_and_hands_over_a_record():
    window = LoadWindow((1, 3), E, 2)
    monitor, records, reader = _monitor("health_round", window)
    rng = np.random.default_rng(0)
    for _ in range(2 * 30):  # 30 load-share observations, one every second step
        _route(window, rng)
        monitor.end_step()
    assert records == [] and monitor.load_share_anomalies() == []
    assert _active(reader)[("load_share", 3)] == 0
    for _ in range(2 * CONFIG.persistence):  # layer 3's expert 2 takes every token
        _route(window, rng, hot=(3, 2))
        monitor.end_step()
    assert (3, 2) in monitor.load_share_anomalies() and all(layer == 3 for layer, _ in monitor.load_share_anomalies())
    # the hot expert's share rose and the others' fell (a sixth each): each that breached is named, in its layer's
    # record of the observation that started it
    assert records and all((r.signal, r.layer, r.at, r.sigma) == ("load_share", 3, 1234.5, 3.0) for r in records)
    (hot,) = [r for r in records if (3, 2) in r.pairs]
    assert all(layer == 3 for r in records for layer, _ in r.pairs)
    assert _active(reader)[("load_share", 3)] == 1 and _active(reader)[("load_share", 1)] == 0
    for _ in range(2 * 10):  # it lasts: no second record for the hot expert
        _route(window, rng, hot=(3, 2))
        monitor.end_step()
    assert [r for r in records if (3, 2) in r.pairs] == [hot]
    for _ in range(2 * (CONFIG.recovery + 1)):
        _route(window, rng)
        monitor.end_step()
    assert monitor.load_share_anomalies() == [] and _active(reader)[("load_share", 3)] == 0


def test_a_layer_with_too_few_new_tokens_waits_and_its_counts_carry_over():
    window = LoadWindow((0,), E, 2)
    monitor, _, _ = _monitor("none", window, load_share_min_tokens=3 * TOKENS * 2)
    rng = np.random.default_rng(1)
    for _ in range(2):
        _route(window, rng)
        monitor.end_step()
    assert monitor._shares._count.tolist() == [0] * E, "2 steps of 128 choices: fewer than 384, not judged"
    _route(window, rng)
    monitor.end_step()
    _route(window, rng)
    monitor.end_step()
    assert monitor._shares._count.tolist() == [1] * E, "4 steps together: one observation"


def test_without_the_health_round_action_nothing_is_handed_over():
    window = LoadWindow((0,), E, 2)
    for action in ("none", "exact_routing"):
        monitor, records, _ = _monitor(action, window)
        rng = np.random.default_rng(2)
        for i in range(2 * 30 + 2 * CONFIG.persistence):
            _route(window, rng, hot=(0, 1) if i >= 60 else None)
            monitor.end_step()
        assert monitor.load_share_anomalies() != [] and records == [], action


def test_a_gate_confidence_anomaly_hands_over_the_layers_busiest_experts_capped():
    model = _model("mixtral")
    gate_bias = GateBias(model)
    layer = min(gate_bias.gates)
    experts = gate_bias.num_experts[layer]
    window = LoadWindow(tuple(sorted(gate_bias.gates)), experts, 2)
    counts = torch.tensor([[experts - 1, 0]] * 5 + [[1, 0]] * 3)  # expert 0: 8 tokens, the last 5, expert 1: 3
    window.record(layer, counts)
    config = BaselineConfig(window=8, warm_up=4, persistence=2)
    records: list[AnomalyRecord] = []
    monitor = AnomalyMonitor(
        gate_bias,
        config,
        "exact_routing+health_round",
        MeterProvider().get_meter("test"),
        load=window,
        load_share_every=1000,
        publish=records.append,
        max_pairs=2,
    )
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        for _ in range(config.warm_up):
            monitor.begin_step()
            model(input_ids=prompt)
            monitor.end_step()
        gate_bias.gates[layer].weight.mul_(50.0)
        for _ in range(config.persistence):
            monitor.begin_step()
            model(input_ids=prompt)
            monitor.end_step()
    assert monitor.exact_routing, "both actions"
    (record,) = [r for r in records if r.layer == layer]
    assert record.signal == "gate_confidence" and record.pairs == ((layer, 0), (layer, experts - 1))
    assert record.value > record.mean


def test_the_publisher_numbers_keeps_the_last_few_and_the_store_reads_them_back():
    store = open_store("memory://")
    publisher = AnomalyPublisher(store, keep=3, router="r1")
    template = AnomalyRecord("", 0, "load_share", 1, ((1, 2),), 10.0, 0.6, 0.25, 0.02, 3.0)
    for _ in range(5):
        publisher.submit(template)
    publisher.flush()
    read = store.anomalies()
    assert [(r.router_id, r.seq) for r in read] == [("r1", 3), ("r1", 4), ("r1", 5)]
    assert read[0].pairs == ((1, 2),) and read[0].describe().startswith("router r1: load_share of layer 1 = 0.6")
    started = AnomalyPublisher(store, router="r2").start()  # the thread writes on submit
    try:
        started.submit(template)
        deadline = time.monotonic() + 30
        while not any(r.router_id == "r2" for r in store.anomalies()):
            assert time.monotonic() < deadline, "the publisher's thread never wrote"
            time.sleep(0.01)
    finally:
        started.stop()


def test_unreadable_anomaly_records_are_skipped():
    store = open_store("memory://")
    good = {"router_id": "r1", "seq": 1, "signal": "load_share", "layer": 0, "pairs": [[0, 1]], "at": 1.0}
    good |= {"value": 0.5, "mean": 0.25, "std": 0.01, "sigma": 3.0}
    store._kv.hset(store._key("anomalies"), "r1", json.dumps([good, {"seq": "x"}, {**good, "pairs": [[0]]}]).encode())
    store._kv.hset(store._key("anomalies"), "r2", b"not json")
    (record,) = store.anomalies()
    assert record.pairs == ((0, 1),) and record.seq == 1


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError):
        AnomalyMonitor(None, CONFIG, "none", MeterProvider().get_meter("t"), load_share_every=0)
