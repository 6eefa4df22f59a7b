"""Router weights checked (issue 44, item 5): the router's own weights fingerprinted at load, checked again
periodically and on demand; a changed tensor makes /health not ready naming it, the gauge count it and the log
name it.

The fingerprints and their comparison on plain modules, ``WeightWatch`` on a small module (a flipped bit, a tensor
replaced whole, tied weights, the gauge, the log), then a real router in this process (``test_warm_up``'s: an
expert group on loopback, ``DataPlane.attach``, ``start_apis``) whose LayerNorm has one bit flipped while it serves.
"""

from __future__ import annotations

import logging

import httpx2
import pytest
import torch
from grpc_health.v1.health_pb2 import HealthCheckResponse
from torch import nn

from expertmesh.config.settings import DataPlaneConfig, read_config_file
from expertmesh.models import grouped_experts
from expertmesh.router.weight_check import WeightWatch, changed_tensors, router_tensors, tensor_fingerprints
from helpers import wait_for
from test_warm_up import _grpc_health, checkpoint, group, served_router  # noqa: F401 (fixtures)

SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING


def _flip_bit(tensor: torch.Tensor) -> None:
    """The lowest bit of the first element's word, in place (a float32 tensor moves by one ulp there)."""
    with torch.no_grad():
        tensor.view(-1)[:1].view(torch.int32).bitwise_xor_(1)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LM heads are
        self.register_buffer("bias", torch.zeros(10))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_changed_tensors_names_those_whose_fingerprints_differ_or_are_missing():
    assert changed_tensors({"a": "1", "b": "2"}, {"a": "1", "b": "3"}) == ["b"]
    assert changed_tensors({"a": "1"}, {"a": "1", "c": "9"}) == ["c"]
    assert changed_tensors({"a": "1"}, {"a": "1"}) == []


def test_every_tensor_the_model_holds_is_fingerprinted_once_and_apart():
    model = Tiny()
    tensors = router_tensors(model)
    assert sorted(tensors) == ["bias", "embed.weight", "norm.bias", "norm.weight"], "tied once; persistent only"
    before = tensor_fingerprints(tensors)
    _flip_bit(model.norm.weight)
    after = tensor_fingerprints(router_tensors(model))
    assert changed_tensors(before, after) == ["norm.weight"], "one bit of one tensor: that tensor, and only it"


def test_the_watch_names_a_flipped_weight_counts_it_and_logs_it(caplog):
    model = Tiny()
    watch = WeightWatch(model, interval_s=0)
    assert watch.last is None and watch.tensors == 4
    assert watch.check().ok and watch._gauge(None)[0].value == 0

    _flip_bit(model.embed.weight)
    with caplog.at_level(logging.ERROR, logger="expertmesh.router.weight_check"):
        check = watch.check()
    assert check.changed == ("embed.weight",) and check.tensors == 4
    assert watch._gauge(None)[0].value == 1
    assert any("embed.weight" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)

    _flip_bit(model.embed.weight)  # back as it was loaded
    assert watch.check().ok and watch._gauge(None)[0].value == 0


def test_a_tensor_replaced_whole_is_read_as_it_is_now():
    model = Tiny()
    watch = WeightWatch(model, interval_s=0)
    model.norm.weight.data = torch.full((4,), 2.0)  # a hot update that swaps the storage
    assert watch.check().changed == ("norm.weight",)


def test_a_packed_copy_apart_from_its_weight_is_named():
    """A weight whose products read a oneDNN-packed copy (``linear_kernels.PackedLinear``): a fault in that copy,
    which the state dict's fingerprints do not read, is named as the copy; a write to the weight torch did not see
    (the copy still computes the old values) names both."""
    from expertmesh.models.linear_kernels import pack_linears

    model = nn.Sequential(nn.Linear(4, 4))
    pack_linears(model, "onednn-packed")
    watch = WeightWatch(model, interval_s=0)
    with torch.no_grad():
        model(torch.randn(2, 4))  # the first product makes the copy
    assert watch.check().ok
    model[0]._weight._packed = torch.ops.mkldnn._reorder_linear_weight(model[0].weight.detach() * 2, 8)
    assert watch.check().changed == ("0.weight (packed copy)",)
    model[0]._weight._packed = torch.ops.mkldnn._reorder_linear_weight(model[0].weight.detach(), 8)
    assert watch.check().ok
    model[0].weight.data.mul_(2)  # not seen by the version counter: the copy keeps the old values
    assert watch.check().changed == ("0.weight", "0.weight (packed copy)")


@pytest.mark.skipif(not grouped_experts.load(), reason="no C++ compiler here: the grouped kernel cannot build")
def test_a_grouped_kernels_copy_apart_from_its_weight_is_named():
    """The same for a weight on the grouped kernel (the router's dense products where it builds): a fault in its
    tiled copy is named as the copy; a write torch did not see names both."""
    from expertmesh.models.linear_kernels import pack_linears

    model = nn.Sequential(nn.Linear(8, 40))
    assert pack_linears(model, "grouped") == 1
    watch = WeightWatch(model, interval_s=0)
    with torch.no_grad():
        model(torch.randn(2, 8))  # the first product makes the copy
    assert watch.check().ok
    packed = model[0]._weight._rows.packed()  # [1, T, K, 32]
    kept = packed[0, 1, 3, 5].item()
    packed[0, 1, 3, 5] = kept + 1.0  # one value of the copy, not of the weight
    assert watch.check().changed == ("0.weight (packed copy)",)
    packed[0, 1, 3, 5] = kept
    assert watch.check().ok
    model[0].weight.data.mul_(2)  # not seen by the version counter: the copy keeps the old values
    assert watch.check().changed == ("0.weight", "0.weight (packed copy)")


def test_an_on_demand_check_within_the_gap_answers_with_the_last_one():
    model = Tiny()
    watch = WeightWatch(model, interval_s=0)
    first = watch.check()
    _flip_bit(model.norm.bias)
    assert watch.check(min_gap_s=3600) is first, "a burst of asks is one check"
    assert watch.check().changed == ("norm.bias",)


def test_the_check_interval_comes_from_the_environment_or_the_chart_key(tmp_path, monkeypatch):
    assert DataPlaneConfig(model="m").router_weight_check_s == 300
    monkeypatch.setenv("EXPERTMESH_ROUTER_WEIGHT_CHECK_S", "0")
    assert DataPlaneConfig(model="m").router_weight_check_s == 0
    values = tmp_path / "values.yaml"
    values.write_text("router:\n  weightCheckSeconds: 30\n")
    assert read_config_file(values).values == {"router_weight_check_s": 30}


# -- a running router --------------------------------------------------------------------------------------------


def _health(url: str) -> httpx2.Response:
    return httpx2.get(f"{url}/health", timeout=30)


def _norm(plane) -> tuple[str, torch.Tensor]:
    name = next(n for n in plane.model.state_dict() if "input_layernorm" in n)
    return name, plane.model.get_parameter(name)


def test_a_bit_flipped_in_a_running_routers_layernorm_turns_health_not_ready_naming_it(checkpoint, group, monkeypatch):  # noqa: F811
    with served_router(checkpoint, group, monkeypatch, router_weight_check_s=0.05) as (plane, apis, url):
        wait_for(lambda: _health(url).json()["router_weights"] == "unchanged", "the periodic check")
        assert _health(url).status_code == 200
        name, tensor = _norm(plane)

        _flip_bit(tensor)
        wait_for(lambda: _health(url).status_code == 503, "/health to turn not ready")
        body = _health(url).json()
        assert body["router_weights"] == "changed" and body["router_weights_changed"] == [name]
        assert any(name in reason and "weights changed" in reason for reason in body["reasons"]), body["reasons"]
        asked = httpx2.post(f"{url}/health/weights", timeout=30)
        assert asked.status_code == 503 and asked.json()["changed"] == [name]
        assert _grpc_health(apis.grpc.port) == NOT_SERVING, "the gRPC probes see it too"

        _flip_bit(tensor)  # as loaded again: the next check finds nothing
        wait_for(lambda: _health(url).status_code == 200, "/health to turn ready again")
        assert _grpc_health(apis.grpc.port) == SERVING


def test_checked_on_demand_when_the_periodic_check_is_off(checkpoint, group, monkeypatch):  # noqa: F811
    with served_router(checkpoint, group, monkeypatch, router_weight_check_s=0) as (plane, apis, url):
        wait_for(lambda: _health(url).status_code == 200, "/health to turn ready")
        name, tensor = _norm(plane)
        _flip_bit(tensor)
        try:
            assert _health(url).json()["router_weights"] == "not_checked", "no thread checks"
            asked = httpx2.post(f"{url}/health/weights", timeout=30)
            answer = asked.json()
            assert asked.status_code == 503 and answer.pop("seconds") >= 0
            assert answer == {"status": "changed", "changed": [name], "tensors": plane.weights.tensors}
            body = _health(url).json()
            assert body["status"] == "not_ready" and body["router_weights_changed"] == [name]
        finally:
            _flip_bit(tensor)
