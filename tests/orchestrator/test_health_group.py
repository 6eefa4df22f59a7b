"""What expert groups give the health monitor, over gRPC on loopback (``HostedExperts``
+ ``start_server``, no Ray): weight fingerprints taken at load and recomputed by the
``Fingerprint`` RPC, and ``LoadExperts(reload=True)``, which reads held experts from
disk again. The weight overwrites here are faults the tests inject in-process."""

from __future__ import annotations

import grpc
import pytest
import torch

from expertmesh.contracts import wire
from expertmesh.expert_group.service import start_server
from expertmesh.models import fingerprint as fp
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

PAIRS = [(0, 0), (0, 1), (1, 2)]


@pytest.fixture
def group(tiny_checkpoints):
    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    hosted.load(PAIRS)
    server, port = start_server("g0", hosted, max_concurrent_dispatch=2, workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield hosted, pb_grpc.ExpertGroupStub(channel)
    channel.close()
    server.stop(0)


def overwrite(hosted: HostedExperts, layer: int, expert: int, delta: float) -> None:
    """The injected fault: add ``delta`` to one weight of the expert, in place in the group's memory where its
    products read it (a write torch sees: a packed copy, ``models.linear_kernels``, is made again from it)."""
    held = hosted._layers[layer]
    with torch.no_grad():
        held.module.down_proj[held.ids.index(expert), 0, 0] += delta


def prints(stub, pairs=()) -> dict[tuple[int, int], tuple[str, str]]:
    request = pb.FingerprintRequest(experts=[pb.ExpertRef(layer=l, expert=e) for l, e in pairs])
    return {(f.layer, f.expert): (f.loaded, f.current) for f in stub.Fingerprint(request, timeout=10).fingerprints}


def output(stub, layer: int, expert: int) -> torch.Tensor:
    hidden = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    request = pb.DispatchRequest(
        layer=layer,
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(torch.full((8, 1), expert, dtype=torch.int32)),
        routing_weights=wire.encode(torch.ones(8, 1)),
    )
    return wire.decode(stub.Dispatch(request, timeout=10).partial_sums)


def test_fingerprints_match_until_the_weights_change_in_memory(group):
    hosted, stub = group
    before = prints(stub)
    assert sorted(before) == PAIRS and all(loaded == current for loaded, current in before.values())
    assert len({loaded for loaded, _ in before.values()}) == 3, "every expert has its own"
    overwrite(hosted, 0, 1, 1e-6)  # far below anything the output statistics would notice
    after = prints(stub)
    assert after[(0, 1)][0] == before[(0, 1)][0] and after[(0, 1)][1] != after[(0, 1)][0]
    assert after[(0, 0)] == before[(0, 0)] and after[(1, 2)] == before[(1, 2)]
    assert prints(stub, [(0, 1)]) == {(0, 1): after[(0, 1)]}


def test_fingerprint_of_an_expert_not_held_is_not_found(group):
    _, stub = group
    with pytest.raises(grpc.RpcError) as err:
        prints(stub, [(1, 1)])
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and "(1, 1)" in err.value.details()


def test_a_reload_restores_the_weights_and_restarts_statistics(group):
    hosted, stub = group
    good = output(stub, 0, 1)
    overwrite(hosted, 0, 1, 5.0)
    assert not torch.equal(output(stub, 0, 1), good)
    stats = {(s.layer, s.expert): s.calls for s in stub.Describe(pb.DescribeRequest(), timeout=10).expert_stats}
    assert stats[(0, 1)] == 2
    response = stub.LoadExperts(
        pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=0, expert=1)], reload=True), timeout=30
    )
    assert [(e.layer, e.expert) for e in response.loaded] == [(0, 1)]
    assert torch.equal(output(stub, 0, 1), good)
    loaded, current = prints(stub)[(0, 1)]
    assert loaded == current
    stats = {(s.layer, s.expert): s.calls for s in stub.Describe(pb.DescribeRequest(), timeout=10).expert_stats}
    assert stats[(0, 1)] == 1 and sorted(stats) == PAIRS, "reloaded: statistics since the reload; nothing else changed"
    plain = stub.LoadExperts(pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=0, expert=1)]), timeout=30)
    assert list(plain.loaded) == [], "without reload a held expert is skipped, as before"


def test_the_checksum_sees_one_changed_word_and_two_that_cancel():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    base = fp.fingerprint({"w": t})
    assert fp.fingerprint({"w": t.clone()}) == base
    flipped = t.clone()
    flipped.view(torch.int32)[3, 3] ^= 1  # one low mantissa bit
    assert fp.fingerprint({"w": flipped}) != base
    swapped = t.clone()
    swapped[0, 1], swapped[0, 2] = t[0, 2], t[0, 1]  # same words, other places: the plain sum cannot tell
    assert fp.fingerprint({"w": swapped}) != base
    assert fp.fingerprint({"w": t.to(torch.bfloat16)}) != fp.fingerprint({"w": t.to(torch.float16)})


def test_the_checksum_is_the_same_in_chunks(monkeypatch):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    whole = fp.fingerprint({"w": t})
    monkeypatch.setattr(fp, "CHUNK_WORDS", 7)
    assert fp.fingerprint({"w": t}) == whole
