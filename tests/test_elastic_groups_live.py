"""Expert groups added and removed live, end to end on the embedded platform:
``expertmesh up --orchestrator --groups-as process`` (real ``group serve`` processes, no
Ray) serving streaming greedy clients while ``expertmesh groups add --wait`` starts an
empty group that the planner fills by live moves, and ``expertmesh groups remove g0
--wait`` drains g0 by make-before-break moves and stops its process.

Every answer is compared token by token with stock transformers; no request may fail.
Timings (add -> the first token the new group computes, remove -> its process stopped)
are printed and recorded as test properties, never asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from expertmesh.client import Client
from expertmesh.v1 import admin_pb2 as apb
from expertmesh.v1 import admin_pb2_grpc as apb_grpc
from expertmesh.v1 import experts_pb2 as epb
from expertmesh.v1 import experts_pb2_grpc as epb_grpc
from helpers import Up, held_pairs, stock_greedy, wait_for

pytestmark = pytest.mark.slow
BIN = os.path.dirname(sys.executable)
PROMPTS = [[5 + i, 17 + 3 * i, 40 + i] * (1 + i % 3) for i in range(6)]
NEW_TOKENS = 10


def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [os.path.join(BIN, "expertmesh"), "groups", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _rows_computed(address: str) -> int:
    """(token, expert) rows the group at ``address`` has computed since it started."""
    with grpc.insecure_channel(address) as channel:
        described = epb_grpc.ExpertGroupStub(channel).Describe(epb.DescribeRequest(), timeout=10)
    return sum(s.rows for s in described.expert_stats)


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints("mixtral", num_local_experts=8)


@pytest.fixture(scope="module")
def up(model, tmp_path_factory):
    up = Up(
        "--model",
        str(model),
        "--groups-as",
        "process",
        "--orchestrator",
        "--admin-port",
        "0",
        env={"EXPERTMESH_HOME": str(tmp_path_factory.mktemp("home")), "EXPERTMESH_HEARTBEAT_S": "0.2"},
    )
    up.admin = up.wait_for_stderr(r"orchestrator admin gRPC on (\S+:\d+)").group(1)
    yield up
    assert up.stop() == 0


def test_groups_added_and_removed_under_streaming_load_fail_nothing_and_change_no_token(up, model, record_property):
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(model, experts_implementation="eager").eval()
    reference = [stock_greedy(stock, p, NEW_TOKENS) for p in PROMPTS]
    channel = grpc.insecure_channel(up.admin)
    admin = apb_grpc.AdminStub(channel)

    def groups() -> dict[str, apb.ExpertGroupStatus]:
        return {g.name: g for g in admin.ListGroups(apb.ListGroupsRequest(), timeout=10).groups}

    before = groups()
    assert {n: apb.GroupPhase.Name(g.phase) for n, g in before.items()} == {
        "g0": "GROUP_PHASE_SERVING",
        "g1": "GROUP_PHASE_SERVING",
    }

    stop = threading.Event()
    completed: Counter[int] = Counter()
    problems: list[str] = []

    def client_loop(i: int) -> None:
        with Client(up.target) as client:
            while not stop.is_set():
                try:
                    chunks = client.generate(PROMPTS[i], max_new_tokens=NEW_TOKENS, stop_at_eos=False)
                    got = [t for chunk in chunks for t in chunk.token_ids]
                except grpc.RpcError as err:
                    problems.append(f"client {i}: {err.code().name}: {err.details()}")
                    return
                if got != reference[i]:
                    problems.append(f"client {i}: tokens {got} != stock {reference[i]}")
                completed[i] += 1

    clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(PROMPTS))]
    for t in clients:
        t.start()
    timings: dict[str, float] = {}
    try:
        wait_for(lambda: all(completed[i] for i in range(len(PROMPTS))), "every client's first answer", 300)

        # -- add: a new empty group process, filled by live moves, serves tokens
        t0 = time.monotonic()
        add = _cli("add", "--wait", "--admin", up.admin)
        new = wait_for(lambda: groups().get("g2"), "the new group's record", 60)
        address = wait_for(lambda: groups()["g2"].address, "the new group to register", 120)
        wait_for(lambda: _rows_computed(address) > 0, "the first token through the new group", 300, poll_s=0.05)
        timings["add_to_first_token_s"] = time.monotonic() - t0
        out, err = add.communicate(timeout=300)
        timings["add_to_serving_s"] = time.monotonic() - t0
        assert add.returncode == 0, err
        assert "g2    serving" in out, out
        new = groups()["g2"]
        assert apb.GroupPhase.Name(new.phase) == "GROUP_PHASE_SERVING", new.reason
        assert new.experts > 0 and new.moves_done == new.moves_planned > 0
        assert held_pairs(address) and len(held_pairs(address)) == new.experts

        # -- remove: g0 drained by make-before-break moves, then its process stopped
        pid = groups()["g0"].pid
        assert pid and Path(f"/proc/{pid}").exists()
        done_before = Counter(completed)
        t0 = time.monotonic()
        remove = _cli("remove", "g0", "--wait", "--admin", up.admin)
        out, err = remove.communicate(timeout=300)
        timings["remove_to_stopped_s"] = time.monotonic() - t0
        assert remove.returncode == 0, err
        removed = groups()["g0"]
        assert apb.GroupPhase.Name(removed.phase) == "GROUP_PHASE_STOPPED", removed.reason
        assert removed.experts == 0 and removed.HasField("exit_code") and removed.exit_code == 0
        assert not Path(f"/proc/{pid}").exists(), "g0's process must have ended"
        timings["remove_moves"] = removed.moves_done
        # every client is served again after the removal, by g1 and g2 alone
        wait_for(
            lambda: all(completed[i] > done_before[i] + 1 for i in range(len(PROMPTS))),
            "every client to finish a request after the removal",
            300,
        )
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)

    assert problems == []
    after = groups()
    channel.close()
    assert after["g1"].pid == before["g1"].pid, "nothing else restarts: g1 is the process it was"
    assert sorted(n for n, g in after.items() if apb.GroupPhase.Name(g.phase) == "GROUP_PHASE_SERVING") == ["g1", "g2"]
    assert sum(g.experts for g in after.values()) == 2 * 8  # every (layer, expert) pair, each once
    timings["requests"] = sum(completed.values())
    assert up.proc.poll() is None  # and the router's process serves on
    for key, value in timings.items():
        record_property(key, value)
    print(f"\nelastic groups timings (shared 2-core machine): {timings}")
