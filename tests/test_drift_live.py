"""Drift end to end: `expertmesh up --orchestrator --drift` (real Ray Serve groups, the
in-process store, the orchestrator and its drift loop in the same process, a scan a
second) over a deliberately lopsided placement: g0 holds experts 0-6 of every layer,
g1 expert 7, each group with a budget of 29 experts' weights, so g0 stands at 97 %
of its memory (above the 90 % high watermark) and g1 at 14 % (below the 40 % low one).

The loop holds until the routers' load windows hold 1000 tokens (the reference
requests make 165), so the reference completions are taken before anything can
move. Then greedy clients run until drift has moved g0's two least-used experts to
g1 through live migrations; every completion, during and after, must equal its
reference token for token, g0 must end below the high watermark, and the layers'
balancedness over the routers' own load statistics must rise.
"""

import json
import re
import threading
import time

import grpc
import numpy as np
import pytest

from expertmesh.client import Client
from expertmesh.models.embedded import SHAPE
from expertmesh.orchestrator.placement.quality import balancedness
from expertmesh.v1 import admin_pb2 as apb
from expertmesh.v1 import admin_pb2_grpc as apb_grpc
from expertmesh.v1 import experts_pb2 as epb
from expertmesh.v1 import experts_pb2_grpc as epb_grpc
from expertmesh.v1 import inference_pb2 as ipb
from expertmesh.v1 import inference_pb2_grpc as ipb_grpc
from helpers import Up

pytestmark = pytest.mark.slow
LAYERS, EXPERTS = SHAPE["num_hidden_layers"], SHAPE["num_local_experts"]
#: gate, up and down projections of one expert, float32
EXPERT_BYTES = 3 * SHAPE["hidden_size"] * SHAPE["intermediate_size"] * 4
BUDGET = 29 * EXPERT_BYTES
PROMPTS = [[(37 * i + 11 * j) % 300 + 10 for j in range(4 + i % 5)] for i in range(8)]
BEFORE = {
    "g0": {(layer, e) for layer in range(LAYERS) for e in range(7)},
    "g1": {(layer, 7) for layer in range(LAYERS)},
}


def _tokens(client: Client, prompt) -> list[int]:
    return [t for chunk in client.generate(prompt, max_new_tokens=16, stop_at_eos=False) for t in chunk.token_ids]


def _hosted(address: str) -> tuple[set[tuple[int, int]], int]:
    with grpc.insecure_channel(address) as channel:
        described = epb_grpc.ExpertGroupStub(channel).Describe(epb.DescribeRequest(), timeout=10)
    return {(r.layer, r.expert) for r in described.experts}, described.weight_bytes


def _shares(placement: dict[str, set[tuple[int, int]]]) -> np.ndarray:
    shares = np.zeros((LAYERS, EXPERTS, len(placement)))
    for g, name in enumerate(sorted(placement)):
        for layer, expert in placement[name]:
            shares[layer, expert, g] = 1.0
    return shares


@pytest.fixture(scope="module")
def up(tmp_path_factory, shared_ray_address):
    home = tmp_path_factory.mktemp("home")
    placement = home / "lopsided.yaml"
    placement.write_text('groups:\n  g0: {"*": ["0-6"]}\n  g1: {"*": [7]}\n')
    env = {
        "EXPERTMESH_HOME": str(home),
        "EXPERTMESH_HEARTBEAT_S": "0.2",
        "EXPERTMESH_LOAD_PUBLISH_S": "0.5",
        "EXPERTMESH_GROUP_BUDGET_BYTES": str(BUDGET),
        "EXPERTMESH_DRIFT_SCAN_INTERVAL_S": "1",
        "EXPERTMESH_DRIFT_MIN_WINDOW_TOKENS": "1000",
    }
    up = Up(
        "--placement",
        str(placement),
        "--orchestrator",
        "--drift",
        "--admin-port",
        "0",
        "--ray-address",
        shared_ray_address,
        env=env,
    )
    up.admin = up.wait_for_stderr(r"orchestrator admin gRPC on (\S+:\d+)").group(1)
    up.groups = dict(re.findall(r"(g\d+)@(\S+:\d+)", up.wait_for_stderr(r"data plane ready").string))
    yield up
    assert up.stop() == 0


def _scan(admin) -> apb.ScanDriftResponse:
    return admin.ScanDrift(apb.ScanDriftRequest(dry_run=True), timeout=30)


def _group(scan: apb.ScanDriftResponse, name: str) -> apb.DriftGroup:
    return next(g for g in scan.groups if g.group == name)


def test_drift_moves_experts_off_the_crowded_group_and_changes_no_token(up):
    assert sorted(up.groups) == ["g0", "g1"]
    assert _hosted(up.groups["g0"]) == (BEFORE["g0"], 28 * EXPERT_BYTES), "an expert weighs EXPERT_BYTES"
    channel = grpc.insecure_channel(up.admin)
    admin = apb_grpc.AdminStub(channel)
    first = _scan(admin)
    assert _group(first, "g0").memory == pytest.approx(28 / 29) and _group(first, "g1").memory == pytest.approx(4 / 29)
    assert _group(first, "g0").budget_bytes == BUDGET

    with Client(up.target, timeout=60) as client:
        reference = [_tokens(client, p) for p in PROMPTS]
    # The loop has seen g0 above the high watermark for three scans by now, and holds for lack of traffic.
    deadline = time.monotonic() + 30
    while not any(d.hold == "low_traffic" for d in _scan(admin).decisions):
        assert time.monotonic() < deadline, _scan(admin)
        time.sleep(0.5)
    assert list(admin.ListMigrations(apb.ListMigrationsRequest()).migrations) == [], (
        "nothing moved before the references"
    )

    stop = threading.Event()
    problems: list[str] = []
    completed: list[int] = []

    def client_loop(offset: int) -> None:
        with Client(up.target, timeout=60) as client:
            n = offset
            while not stop.is_set():
                i = n % len(PROMPTS)
                try:
                    got = _tokens(client, PROMPTS[i])
                except grpc.RpcError as err:
                    problems.append(f"prompt {i}: {err.code().name}: {err.details()}")
                    return
                if got != reference[i]:
                    problems.append(f"prompt {i}: tokens {got} != {reference[i]}")
                completed.append(i)
                n += 1

    clients = [threading.Thread(target=client_loop, args=(k * 2,)) for k in range(4)]
    for t in clients:
        t.start()
    try:
        deadline = time.monotonic() + 240
        while True:
            moves = list(admin.ListMigrations(apb.ListMigrationsRequest()).migrations)
            if len(moves) >= 2 and all(m.phase == apb.MIGRATION_PHASE_SUCCEEDED for m in moves):
                break
            assert not any(m.phase in (apb.MIGRATION_PHASE_FAILED, apb.MIGRATION_PHASE_ROLLED_BACK) for m in moves), (
                moves
            )
            assert time.monotonic() < deadline, f"no drift moves: {_scan(admin)}"
            time.sleep(0.5)
        # More completions on the new placement, checked against the references too.
        wanted, deadline = len(completed) + 2 * len(clients), time.monotonic() + 120
        while len(completed) < wanted and not problems:
            assert time.monotonic() < deadline, "clients stopped completing after the moves"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
    assert problems == []

    moves = list(admin.ListMigrations(apb.ListMigrationsRequest()).migrations)
    assert len(moves) == 2, "g0 is below the high watermark after one move of two experts"
    assert all(
        (m.initiator, m.source, m.target, m.phase)
        == ("drift:high_watermark", "g0", "g1", apb.MIGRATION_PHASE_SUCCEEDED)
        for m in moves
    )
    moved = {(m.layer, m.expert) for m in moves}
    after = {"g0": _hosted(up.groups["g0"])[0], "g1": _hosted(up.groups["g1"])[0]}
    assert after == {"g0": BEFORE["g0"] - moved, "g1": BEFORE["g1"] | moved}
    last = _scan(admin)
    assert _group(last, "g0").memory == pytest.approx(26 / 29) and _group(last, "g0").scans_above == 0
    assert _group(last, "g1").memory == pytest.approx(6 / 29)

    with grpc.insecure_channel(up.target) as inference:
        stats = json.loads(
            ipb_grpc.InferenceStub(inference).GetLoadStats(ipb.LoadStatsRequest(), timeout=30).stats_json
        )
    load = np.array(stats["load"])  # [layers, experts]: every token this router served
    assert all(load[layer, expert] > 0 for layer, expert in moved), "the least used were still used"
    assert balancedness(load, _shares(after)) > balancedness(load, _shares(BEFORE))

    with Client(up.target, timeout=60) as client:
        assert [_tokens(client, p) for p in PROMPTS] == reference
    channel.close()
