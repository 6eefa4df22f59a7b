"""The health monitor's probe inputs and how it sends them: routers' recorded
hidden states (``router.hidden_sample``) pinned as each layer's probe, the seeded
fallback (said in the verdict), re-pinning only over healthy layers, and one
Dispatch per group per layer for all of its experts.

Real parts: the expert groups are real gRPC servers on loopback (``health_mesh``), the router is the real
router model whose dispatcher
records what its MoE layers send, the store is the in-process one. Corrupted
weights are the fault ``health_mesh.corrupt`` injects in-process.
"""

from __future__ import annotations

import logging

import pytest
import torch
from health_mesh import CONFIG, REPLICATED, corrupt, rid, running

from expertmesh.orchestrator.health import probes
from expertmesh.orchestrator.health.config import HealthConfig
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.state import FindingKind, HealthState
from expertmesh.router.assembly import assemble_router
from expertmesh.router.reporting.hidden_sample import HiddenSampler, SamplePublisher
from expertmesh.router.transport import build as build_transport
from expertmesh.store import samples

LAYERS = (0, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def mesh(tiny_checkpoints):
    with running(tiny_checkpoints("mixtral")) as m:
        yield m


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def monitor(mesh, clock):
    m = HealthMonitor(
        mesh.store, mesh.checkpoint, HealthConfig(tokens=64, probation_checks=2, probe_refresh_s=100.0), clock=clock
    )
    yield m
    m.close()


@pytest.fixture
def router(mesh):
    """The router model over the mesh's groups, its dispatcher sampling 48 rows per layer."""
    router = assemble_router(
        mesh.store,
        LAYERS,
        build_transport("auto"),
        checkpoint=mesh.checkpoint,
        hidden_sampler=HiddenSampler(LAYERS, 48),
    )
    model, dispatcher = router.model, router.dispatcher
    yield model, dispatcher
    dispatcher.close()


def serve(model, seed: int, tokens: int = 40) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


def publish(mesh, dispatcher, router_id: str = "router-a") -> None:
    SamplePublisher(mesh.store, dispatcher.hidden_sampler, router_id, interval_s=60.0).publish()


# -- the router's side ------------------------------------------------------------------------


def test_routers_sample_what_their_layers_dispatch_without_changing_it(mesh, router):
    model, dispatcher = router
    sent: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    dispatch = dispatcher.dispatch

    def recording(layer, hidden, *args, **kwargs):
        sent[layer].append(hidden.detach().clone())
        return dispatch(layer, hidden, *args, **kwargs)

    dispatcher.dispatch = recording
    with_sampling = [serve(model, seed) for seed in range(3)]
    taken = dispatcher.hidden_sampler.take()
    assert set(taken) == set(LAYERS)
    for layer, sample in taken.items():
        everything = torch.cat(sent[layer])  # [120, H]
        assert sample.shape == (48, everything.shape[1]) and sample.dtype == torch.float32
        assert all((everything == row).all(dim=1).any() for row in sample), "every sampled row was dispatched"
        assert len({tuple(row.tolist()) for row in sample}) == 48, "no row twice"
    assert dispatcher.hidden_sampler.take() == {}, "a take restarts the reservoirs"
    dispatcher.hidden_sampler = None
    assert all(torch.equal(a, serve(model, seed)) for seed, a in enumerate(with_sampling)), "sampling changes no output"


def test_a_reservoir_keeps_every_row_with_the_same_chance():
    """Rows offered early and late are kept alike (algorithm R): 200 runs of 40 batches of 10 rows into 50 slots."""
    kept_early = kept_late = 0
    for run in range(200):
        sampler = HiddenSampler([0], 50, seed=run)
        for batch in range(40):
            sampler.offer(0, torch.arange(batch * 10, batch * 10 + 10, dtype=torch.float32)[:, None])
        ids = sampler.take()[0].flatten()
        assert ids.numel() == 50 and ids.unique().numel() == 50
        kept_early += int((ids < 200).sum())
        kept_late += int((ids >= 200).sum())
    # each half holds 25 of 50 on average; 5000 draws each: a 5 % skew is > 6 standard deviations
    assert abs(kept_early - kept_late) < 0.05 * (kept_early + kept_late)


def test_a_router_publishes_its_samples_and_removes_them_when_it_stops(mesh):
    sampler = HiddenSampler(LAYERS, 8)
    sampler.offer(1, torch.randn(20, 16, dtype=torch.bfloat16))
    publisher = SamplePublisher(mesh.store, sampler, "r1", interval_s=60.0)
    publisher.publish()
    assert mesh.store.hidden_samples(0) == {}, "a layer that saw nothing publishes nothing"
    stored = samples.decode(mesh.store.hidden_samples(1)["r1"])
    assert stored.shape == (8, 16) and stored.dtype == torch.bfloat16
    publisher.start().stop()
    assert mesh.store.hidden_samples(1) == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff\xfe garbage", "not a Tensor message"),
        (samples.encode(torch.ones(3)), "expected [rows, H]"),
        (samples.encode(torch.ones(2, 2, dtype=torch.int32)), "expected [rows, H] floats"),
    ],
)
def test_a_stored_sample_that_is_not_one_is_a_clear_error(raw, message):
    from expertmesh.contracts.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[")):
        samples.decode(raw)


# -- the monitor's side -----------------------------------------------------------------------


def test_without_recorded_states_the_monitor_probes_seeded_ones_and_says_so(mesh, monitor):
    round_ = monitor.update()
    assert round_.probes == {0: "seeded", 1: "seeded"}
    assert {r.probe_source for r in round_.records.values()} == {"seeded"}
    assert mesh.store.health_probes() == {}


def test_recorded_states_become_the_probe_once_every_replica_was_healthy_on_the_old_one(mesh, router, monitor, clock):
    model, dispatcher = router
    for seed in range(2):
        serve(model, seed)
    publish(mesh, dispatcher)
    first = monitor.update()  # baselines on the seeded probe, judged, then pinned and re-baselined on the recorded one
    assert first.probes == {0: "recorded", 1: "recorded"}
    pinned = probes.load_pinned(mesh.store, 32)
    assert set(pinned) == set(LAYERS) and all(p.hidden.shape == (48, 32) for p in pinned.values())
    assert all(r.baseline.probe == pinned[r.replica.layer].digest for r in first.records.values())
    assert {r.probe_source for r in first.records.values()} == {"recorded"}
    clock.now += 10
    second = monitor.update()
    assert second.probes == {0: "recorded", 1: "recorded"}
    assert all(found == () for found in second.findings.values())
    assert all(r.kl == 0.0 for r in second.records.values()), "the pinned input, the same figures"
    corrupt(mesh, "g1", REPLICATED, scale=1.5)
    clock.now += 10
    third = monitor.update()
    bad = third.records[rid(REPLICATED, "g1")]
    assert bad.state is HealthState.QUARANTINED and bad.probe_source == "recorded"
    assert FindingKind.DIVERGENCE in {f.kind for f in third.findings[rid(REPLICATED, "g1")]}
    clock.now += 10
    repaired = monitor.update().records[rid(REPLICATED, "g1")]
    assert repaired.state is HealthState.PROBATION, repaired.reason
    assert repaired.baseline.probe == pinned[1].digest, "verified against the checkpoint on the recorded probe"


def test_a_layer_with_an_unhealthy_replica_keeps_its_probe_and_refreshes_after_the_interval(
    mesh, router, monitor, clock
):
    model, dispatcher = router
    monitor.update()  # seeded baselines
    corrupt(mesh, "g1", REPLICATED)
    serve(model, 0)
    publish(mesh, dispatcher)
    round_ = monitor.update()
    assert round_.records[rid(REPLICATED, "g1")].state is HealthState.QUARANTINED
    assert round_.probes == {0: "recorded", 1: "seeded"}, "layer 1 has a bad replica: no new baseline for it"
    pinned = probes.load_pinned(mesh.store, 32)[0]
    serve(model, 1)
    publish(mesh, dispatcher)
    clock.now += 50
    monitor.update()
    assert probes.load_pinned(mesh.store, 32)[0].digest == pinned.digest, "not due yet"
    clock.now += 60
    refreshed = monitor.update()
    assert probes.load_pinned(mesh.store, 32)[0].digest != pinned.digest
    assert all(r.kl == 0.0 for i, r in refreshed.records.items() if i.layer == 0)


def test_samples_that_do_not_fit_are_left_out(mesh, monitor, caplog):
    mesh.store.publish_hidden_sample(0, "junk", b"\x08\x01 not a tensor")
    mesh.store.publish_hidden_sample(0, "wide", samples.encode(torch.randn(64, 33)))
    mesh.store.publish_hidden_sample(1, "few", samples.encode(torch.randn(probes.MIN_RECORDED_ROWS - 1, 32)))
    with caplog.at_level(logging.WARNING):
        round_ = monitor.update()
    assert round_.probes == {0: "seeded", 1: "seeded"}
    assert (
        "router junk's hidden-state sample of layer 0" in caplog.text
        and "router wide's sample of layer 0" in caplog.text
    )


def test_one_dispatch_per_group_per_layer_gives_each_expert_its_own_output(mesh, monitor):
    calls = []
    dispatch = monitor._groups.dispatch

    def counting(group, layer, batch):
        calls.append((group, layer, tuple(batch.expert_ids.unique().tolist())))
        return dispatch(group, layer, batch)

    monitor._groups.dispatch = counting
    round_ = monitor.update()
    assert sorted(calls) == [("g0", 0, (0, 1)), ("g0", 1, (0, 1)), ("g1", 0, (2, 3)), ("g1", 1, (1, 2, 3))]
    # each expert's rows of the batch are what it computes alone
    probe = probes.seeded(1, 32, CONFIG.tokens, 0)
    from expertmesh.orchestrator.health import measure

    alone = measure.summarise(dispatch("g1", 1, measure.probe_batch(probe.hidden, (2,))))
    assert round_.records[rid((1, 2), "g1")].norm_mean == alone.norm_mean


def test_a_small_batch_budget_splits_a_groups_experts_into_more_calls(mesh, clock):
    config = HealthConfig(tokens=64, probe_batch_bytes=2 * 64 * 32 * 4, probe_concurrency=1)
    m = HealthMonitor(mesh.store, mesh.checkpoint, config, clock=clock)
    calls = []
    dispatch = m._groups.dispatch
    m._groups.dispatch = lambda group, layer, batch: (
        calls.append(batch.expert_ids.unique().numel()) or dispatch(group, layer, batch)
    )
    try:
        round_ = m.update()
    finally:
        m.close()
    assert sorted(calls) == [1, 2, 2, 2, 2] and len(round_.findings) == 9
