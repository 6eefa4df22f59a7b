"""A flushed Redis under `expertmesh up --orchestrator --state-url redis://…` (the embedded platform on a shared
store; real Ray Serve groups on the tests' Ray, a real redis-server): before, its groups never registered again
and nothing published the table, so `/health` stayed 503 and every later `migrate` failed FAILED_PRECONDITION.
Now the groups register themselves and the embedded orchestrator rebuilds the table from what they hold — after
a live move, the moved expert on its new group — at a version above the router's."""

import os
import subprocess
import sys

import httpx2
import pytest
import redis

from expertmesh.client import Client
from expertmesh.store import open_store
from helpers import Up, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis]
BIN = os.path.dirname(sys.executable)
PROMPT = [5, 17, 40, 9]


def _tokens(client: Client) -> list[int]:
    return [t for chunk in client.generate(PROMPT, max_new_tokens=8, stop_at_eos=False) for t in chunk.token_ids]


def _migrate(admin: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(BIN, "expertmesh"), "migrate", *args, "--wait", "--admin", admin],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_flush_after_a_live_move_is_rebuilt_from_what_the_groups_hold(redis_url, shared_ray_address, tmp_path):
    env = {"EXPERTMESH_HOME": str(tmp_path), "EXPERTMESH_HEARTBEAT_S": "0.2"}
    up = Up(
        "--orchestrator",
        "--admin-port",
        "0",
        "--http-port",
        "0",
        "--state-url",
        redis_url,
        "--ray-address",
        shared_ray_address,
        env=env,
    )
    store = open_store(redis_url)
    try:
        admin = up.wait_for_stderr(r"orchestrator admin gRPC on (\S+:\d+)").group(1)
        health = up.wait_for_stderr(r"HTTP API on (http://\S+)/v1").group(1) + "/health"
        with Client(up.target, timeout=60) as client:
            reference = _tokens(client)
            moved = _migrate(admin, "--layer", "0", "--expert", "0", "--to", "g1")
            assert moved.returncode == 0, moved.stderr
            before = store.routing_table_version()
            assert store.routing_table().replicas[(0, 0)] == ("g1",)

            redis.Redis.from_url(redis_url).flushdb()
            assert _tokens(client) == reference  # served on the router's cached table meanwhile
            wait_for(lambda: set(store.endpoints()) == {"g0", "g1"}, "the groups to register again", 90)
            table = wait_for(
                lambda: (t := store.routing_table()) is not None and t.version > before and t, "the table back", 90
            )
            assert table.replicas[(0, 0)] == ("g1",), "rebuilt from the file, not from what the groups hold"
            wait_for(lambda: httpx2.get(health, timeout=10).status_code == 200, "/health ready again", 90)
            assert _tokens(client) == reference
            back = _migrate(admin, "--layer", "0", "--expert", "0", "--to", "g0")
            assert back.returncode == 0, back.stderr
            assert _tokens(client) == reference
    finally:
        store.close()
        assert up.stop() == 0
