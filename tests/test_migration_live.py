"""Live migration end to end: `expertmesh up --orchestrator` (real Ray Serve groups, the
in-process store, the orchestrator's admin API in the same process) serving 8 streaming
greedy clients while 20 moves run back and forth between the two groups.

Nothing is faked: the moves go through the admin gRPC API and the `expertmesh migrate` /
`expertmesh migrations` commands, each one loads, checks, switches, drains and unloads
real experts, and the clients' completions are compared token by token with the same
requests served before any move.
"""

import os
import re
import subprocess
import sys
import threading
from collections import Counter

import grpc
import pytest

from expertmesh.client import Client
from expertmesh.v1 import admin_pb2 as apb
from expertmesh.v1 import admin_pb2_grpc as apb_grpc
from expertmesh.v1 import experts_pb2 as epb
from expertmesh.v1 import experts_pb2_grpc as epb_grpc
from helpers import Up

pytestmark = pytest.mark.slow
BIN = os.path.dirname(sys.executable)
MOVES = 20
PROMPTS = [[5 + i, 17 + 3 * i, 40 + i] * (1 + i % 3) for i in range(8)]


def _tokens(client: Client, prompt) -> list[int]:
    return [t for chunk in client.generate(prompt, max_new_tokens=12, stop_at_eos=False) for t in chunk.token_ids]


def _hosted(address: str) -> set[tuple[int, int]]:
    with grpc.insecure_channel(address) as channel:
        described = epb_grpc.ExpertGroupStub(channel).Describe(epb.DescribeRequest(), timeout=10)
    return {(r.layer, r.expert) for r in described.experts}


def _cli(*args):
    return subprocess.run([os.path.join(BIN, "expertmesh"), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def up(tmp_path_factory, shared_ray_address):
    home = tmp_path_factory.mktemp("home")
    up = Up(
        "--orchestrator",
        "--admin-port",
        "0",
        "--ray-address",
        shared_ray_address,
        env={"EXPERTMESH_HOME": str(home), "EXPERTMESH_HEARTBEAT_S": "0.2"},
    )
    up.admin = up.wait_for_stderr(r"orchestrator admin gRPC on (\S+:\d+)").group(1)
    up.groups = dict(re.findall(r"(g\d+)@(\S+:\d+)", up.wait_for_stderr(r"data plane ready").string))
    yield up
    assert up.stop() == 0


def test_moves_under_streaming_load_fail_no_request_and_change_no_token(up):
    assert sorted(up.groups) == ["g0", "g1"]
    with Client(up.target) as client:
        reference = [_tokens(client, p) for p in PROMPTS]

    stop = threading.Event()
    completed: Counter[int] = Counter()
    problems: list[str] = []

    def client_loop(i: int) -> None:
        with Client(up.target) as client:
            while not stop.is_set():
                try:
                    got = _tokens(client, PROMPTS[i])
                except grpc.RpcError as err:
                    problems.append(f"client {i}: {err.code().name}: {err.details()}")
                    return
                if got != reference[i]:
                    problems.append(f"client {i}: tokens {got} != {reference[i]}")
                completed[i] += 1

    clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(PROMPTS))]
    for t in clients:
        t.start()

    versions = []
    channel = grpc.insecure_channel(up.admin)
    admin = apb_grpc.AdminStub(channel)
    try:
        # Experts 0-3 start on g0: each goes to g1 and comes back, one layer after another.
        for n in range(MOVES):
            layer, expert = (n // 2) % 4, (n // 2) % 4
            source, target = ("g0", "g1") if n % 2 == 0 else ("g1", "g0")
            if n == 0:  # the first one as a person would: the command line, waiting for the end
                run = _cli(
                    "migrate",
                    "--layer",
                    str(layer),
                    "--expert",
                    str(expert),
                    "--to",
                    target,
                    "--wait",
                    "--admin",
                    up.admin,
                )
                assert run.returncode == 0, run.stderr
                assert "succeeded" in run.stdout
                final = admin.ListMigrations(apb.ListMigrationsRequest()).migrations[-1]
            else:
                started = admin.Migrate(apb.MigrateRequest(layer=layer, expert=expert, target=target, source=source))
                *_, final = admin.WatchMigrations(apb.WatchMigrationsRequest(id=started.id))
            assert final.phase == apb.MIGRATION_PHASE_SUCCEEDED, final.reason
            assert (final.source, final.target) == (source, target)
            history = [h.routing_table_version for h in final.history]
            assert history == sorted(history)
            versions.append(final.routing_table_version)
            assert (layer, expert) not in _hosted(up.groups[source]), f"move {n}: the source still holds it"
            assert (layer, expert) in _hosted(up.groups[target])
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
        channel.close()

    assert problems == []
    assert versions == sorted(set(versions)), "table versions must strictly increase"
    assert all(completed[i] >= 1 for i in range(len(PROMPTS))), completed
    listing = _cli("migrations", "--admin", up.admin)
    assert listing.returncode == 0 and listing.stdout.count("succeeded") == MOVES, listing.stdout


def test_bad_migrations_are_refused_with_one_line_and_nothing_moves(up):
    before = _hosted(up.groups["g0"])
    cases = [
        (["--layer", "0", "--expert", "5", "--to", "nowhere"], "unknown group 'nowhere'"),
        (["--layer", "0", "--expert", "5", "--to", "g1"], "already serves layer 0 expert 5"),
        (["--layer", "0", "--expert", "1", "--mode", "evict"], "only replica"),
        (["--layer", "9", "--expert", "0", "--to", "g1"], "layer 9 expert 0 is not in routing table"),
        (["--layer", "0", "--expert", "1"], "--mode move needs --to GROUP"),
    ]
    for args, message in cases:
        run = _cli("migrate", *args, "--admin", up.admin)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert _hosted(up.groups["g0"]) == before
    unreachable = _cli("migrations", "--admin", "127.0.0.1:1")
    assert unreachable.returncode == 2 and "no orchestrator admin API at 127.0.0.1:1" in unreachable.stderr
