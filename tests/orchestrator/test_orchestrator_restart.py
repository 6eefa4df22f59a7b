"""An orchestrator SIGKILLed between the switch and the unload of a move: a new
`expertmesh orchestrator` process on the same Redis finishes it.

Real processes and servers: two orchestrator processes one after the other, real
expert groups on loopback (``migration_mesh``) registered in a real redis-server.
The router is a stand-in that reports heartbeats through the same store protocol
(``FollowingRouter``): holding its version back is what keeps the move draining
while the first orchestrator is killed.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import grpc
import pytest
import yaml
from migration_mesh import EXPERT, LAYER, PAIR, PLACEMENT, FollowingRouter, mesh_in_redis

from expertmesh.orchestrator.migration.state import Phase, load
from expertmesh.v1 import admin_pb2 as pb
from expertmesh.v1 import admin_pb2_grpc as pb_grpc
from helpers import orchestrator_argv, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis]

#: a redis database of its own: other suites flush database 0 of the same server
DATABASE = 6


class Orchestrator:
    def __init__(self, url: str, model, placement):
        self.proc = subprocess.Popen(
            orchestrator_argv(url, model, placement, "--no-kube", "--interval", "0.5"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while not (
            found := [re.search(r"admin gRPC on (\S+:\d+)", line) for line in self.stderr if "admin gRPC on" in line]
        ):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.stderr)[-3000:]
            time.sleep(0.05)
        self.admin = found[0].group(1)


def test_a_move_left_draining_by_a_killed_orchestrator_is_finished_by_the_next_one(
    redis_url, tiny_checkpoints, tmp_path
):
    url = redis_url.rsplit("/", 1)[0] + f"/{DATABASE}"
    path = tiny_checkpoints("mixtral")
    placement = tmp_path / "placement.yaml"
    placement.write_text(
        yaml.safe_dump(
            {
                "groups": {
                    g: {layer: sorted(e for l, e in pairs if l == layer) for layer in {l for l, _ in pairs}}
                    for g, pairs in PLACEMENT.groups.items()
                }
            }
        )
    )
    with mesh_in_redis(url, path) as mesh:
        store = mesh.store
        first = second = None
        try:
            with FollowingRouter(store, "r1", stop_at=2):  # acknowledges the make (v2), never the break (v3)
                first = Orchestrator(url, path, placement)
                with grpc.insecure_channel(first.admin) as channel:
                    started = pb_grpc.AdminStub(channel).Migrate(
                        pb.MigrateRequest(layer=LAYER, expert=EXPERT, target="g2")
                    )
                wait_for(lambda: load(store, started.id).phase is Phase.DRAINING, "the move to drain")
                first.proc.send_signal(signal.SIGKILL)
                first.proc.wait(timeout=30)
                assert load(store, started.id).phase is Phase.DRAINING
                assert PAIR in mesh.groups["g0"].hosted.pairs(), "the source must stay loaded while routers may use it"
                second = Orchestrator(url, path, placement)
            with FollowingRouter(store, "r1"):  # the router takes v3: the new orchestrator's resumed move drains
                done = wait_for(lambda: (m := load(store, started.id)).phase.terminal and m, "the resumed move to end")
            assert done.phase is Phase.SUCCEEDED, done.reason
            assert store.routing_table().replicas[PAIR] == ("g2",)
            assert PAIR not in mesh.groups["g0"].hosted.pairs() and PAIR in mesh.groups["g2"].hosted.pairs()
            assert [h.phase for h in done.history][-2:] == [Phase.UNLOADING, Phase.SUCCEEDED]
            second.proc.send_signal(signal.SIGTERM)
            assert second.proc.wait(timeout=60) == 0, "".join(second.stderr)[-3000:]
        finally:
            for orchestrator in (first, second):
                if orchestrator is not None and orchestrator.proc.poll() is None:
                    orchestrator.proc.kill()
