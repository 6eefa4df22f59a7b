"""Dispatch racing LoadExperts/UnloadExperts on a real gRPC server (no Ray).

Each load or unload rebuilds the layer's stacked weights, and the experts that
stay hosted move to other rows. A Dispatch that read the old id map with the
new weights (or half-replaced weights) would compute with another expert's
weights and still answer OK. Every OK answer must equal the stock experts
module; an expert that is being churned may be NOT_FOUND, nothing else."""

import sys
import threading

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts import wire
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

LAYER = 1
#: always hosted; ids above the churned ones, so every load or unload moves their rows
FIXED = (2, 3)
#: loaded and unloaded in a loop while the dispatchers run
CHURNED = (0, 1)
CYCLES = 150
DISPATCHERS = 4


def _cases(stock):
    """(request, expected partial sums, whether it names a churned expert), built before the race."""
    generator = torch.Generator().manual_seed(0)
    module = stock[LAYER][1]
    cases = []
    for choices in [FIXED, FIXED[::-1], (FIXED[0], -1), (CHURNED[0], FIXED[1]), (FIXED[0], CHURNED[1]), CHURNED]:
        hidden = torch.randn(6, 32, generator=generator)  # [T, H]
        ids = torch.tensor([choices] * 6)  # [T, K]
        weights = torch.rand(6, 2, generator=generator)  # [T, K]
        with torch.no_grad():
            expected = module(hidden, ids.clamp(min=0), torch.where(ids >= 0, weights, 0.0))  # [T, H]
        request = pb.DispatchRequest(
            layer=LAYER,
            hidden_states=wire.encode(hidden),
            expert_ids=wire.encode(ids.to(torch.int32)),
            routing_weights=wire.encode(weights),
        )
        cases.append((request, expected, any(c in CHURNED for c in choices)))
    return cases


@pytest.fixture
def fast_thread_switches():
    """Switch threads often so the race shows within a bounded number of cycles."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_dispatch_never_answers_ok_with_wrong_weights_while_experts_move(tiny_checkpoints, fast_thread_switches):
    path = tiny_checkpoints("mixtral")
    hosted = HostedExperts(Checkpoint(path))
    hosted.load([(LAYER, e) for e in FIXED])
    server, port = start_server("g-race", hosted)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExpertGroupStub(channel)
    cases = _cases(experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")))
    done = threading.Event()
    wrong: list[str] = []
    answered = {"ok": 0, "not_found": 0}

    def dispatch(worker: int) -> None:
        i = worker
        while not done.is_set() and not wrong:
            request, expected, churned = cases[i % len(cases)]
            i += 1
            try:
                got = wire.decode(stub.Dispatch(request).partial_sums)
            except grpc.RpcError as err:
                if churned and err.code() == grpc.StatusCode.NOT_FOUND:
                    answered["not_found"] += 1
                    continue
                wrong.append(f"case {i % len(cases)}: {err.code().name}: {err.details()}")
                continue
            answered["ok"] += 1
            error = (got - expected).abs().max().item()
            if error > 1e-6:
                wrong.append(f"case {i % len(cases)}: answered OK but off by {error:.3g}")

    def churn() -> None:
        refs = [pb.ExpertRef(layer=LAYER, expert=e) for e in CHURNED]
        try:
            for _ in range(CYCLES):
                if wrong:
                    return
                stub.LoadExperts(pb.LoadExpertsRequest(experts=refs))
                stub.UnloadExperts(pb.UnloadExpertsRequest(experts=refs))
        finally:
            done.set()

    threads = [threading.Thread(target=dispatch, args=(w,)) for w in range(DISPATCHERS)]
    threads.append(threading.Thread(target=churn))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in threads), "the race test did not finish"
    finally:
        done.set()
        channel.close()
        server.stop(0)
    assert not wrong, f"{len(wrong)} wrong answers, first: {wrong[:3]}"
    assert answered["ok"] > 0
    assert hosted.pairs() == [(LAYER, e) for e in FIXED]
