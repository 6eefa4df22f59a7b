"""Routing dynamics of finished sequences (router/reporting/routing_dynamics.py): the oscillation rate per layer
and experts per token by position, from known choices (pure), and the metrics they make. End to end (a router's
finished requests over real groups, the exported counters per layer): tests/test_telemetry.py."""

from __future__ import annotations

import numpy as np
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from expertmesh.router.reporting.routing_dynamics import (
    RoutingDynamics,
    experts_per_token,
    oscillations,
    position_bucket,
)

E = 8


def test_oscillations_count_pairs_whose_expert_sets_differ_ignoring_order_and_empty_slots():
    experts = np.array(
        [
            [[3, 1], [1, 3], [1, 5], [1, 5]],  # order alone is no change; 3->5 is one; then none: 1 of 3
            [[2, E], [2, E], [2, 4], [6, 7]],  # an empty slot filled is a change, so is a new pair: 2 of 3
        ]
    )  # [L=2, T=4, K=2]
    changes, pairs = oscillations(experts, E)
    assert changes.tolist() == [1, 2] and pairs.tolist() == [3, 3]
    assert oscillations(experts[:, :1], E)[1].tolist() == [0, 0]  # one token: no pair
    assert experts_per_token(experts, E).tolist() == [3, 3, 4, 4]  # empty slots are not experts used


def test_position_buckets_are_thirds_of_the_sequence():
    assert position_bucket(np.arange(6), 6).tolist() == [0, 0, 1, 1, 2, 2]
    assert position_bucket(np.array([0, 9]), 10).tolist() == [0, 2]
    assert position_bucket(np.array([0]), 1).tolist() == [0]


def _reader_and_dynamics():
    reader = InMemoryMetricReader()
    return reader, RoutingDynamics(E, MeterProvider(metric_readers=[reader]).get_meter("test"))


def _points(reader) -> dict:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out[(metric.name, tuple(sorted(point.attributes.items())))] = point
    return out


def test_recorded_per_layer_and_position():
    reader, dynamics = _reader_and_dynamics()
    experts = np.array([[[0, 1], [0, 1], [2, 3]], [[4, E], [4, 5], [4, 5]]])  # [2, 3, 2] layers 1 and 3
    dynamics.record((1, 3), experts, first_position=3, length=6)  # positions 3, 4, 5: middle, last, last
    points = _points(reader)
    assert points[("expertmesh.routing.transitions", (("layer", 1),))].value == 2
    assert points[("expertmesh.routing.oscillations", (("layer", 1),))].value == 1
    assert points[("expertmesh.routing.oscillations", (("layer", 3),))].value == 1
    middle = points[("expertmesh.routing.experts_per_token", (("position", "middle"),))]
    last = points[("expertmesh.routing.experts_per_token", (("position", "last"),))]
    assert (middle.count, middle.sum) == (1, 3.0) and (last.count, last.sum) == (1, 4.0)
    assert ("expertmesh.routing.experts_per_token", (("position", "first"),)) not in points
