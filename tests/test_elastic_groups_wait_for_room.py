"""A group added on a Ray cluster with no room for it now waits for room (``group_wait_for_room_s``) and serves
once a node joins, as under an autoscaler.

Real: a Ray cluster of two raylets on this machine (``ray.cluster_utils.Cluster``: a head of 1 CPU, then a
worker node of 1 CPU added while the group waits), Ray Serve, ``expertmesh up --orchestrator --ray-address``
(its 2 groups of 0.5 CPU fill the head), the admin API, the live moves that fill the new group. Not here: the
Ray autoscaler itself; the test adds the node the autoscaler would add for the pending replica's demand.
"""

from __future__ import annotations

import time

import pytest

from expertmesh.bench.chaos.platform import Child

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(without_shared_ray):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    yield cluster
    cluster.shutdown()


def _record(stub, name: str) -> dict:
    from expertmesh.orchestrator.admin_client import call
    from expertmesh.v1 import admin_pb2 as apb

    status = call(stub.GetGroup, apb.GetGroupRequest(name=name))
    return {"phase": apb.GroupPhase.Name(status.phase), "reason": status.reason, "address": status.address}


def test_a_group_without_room_waits_and_serves_once_a_node_joins(cluster, tiny_checkpoints, tmp_path):
    from expertmesh.orchestrator.admin_client import call, connect
    from expertmesh.v1 import admin_pb2 as apb

    model = tiny_checkpoints("mixtral", num_local_experts=8)
    argv = ["up", "--model", str(model), "--groups", "2", "--dtype", "float32", "--orchestrator"]
    argv += ["--port", "0", "--admin-port", "0", "--ray-address", cluster.address]
    env = {
        "EXPERTMESH_GROUP_NUM_CPUS": "0.5",
        "EXPERTMESH_GROUP_WAIT_FOR_ROOM_S": "240",
        "EXPERTMESH_HOME": str(tmp_path),
    }
    up = Child("up", argv, env).start()
    try:
        up.wait_for(r"expertmesh is serving \S+ on (\S+:\d+) ", 240)
        admin = up.wait_for(r"orchestrator admin gRPC on (\S+:\d+)", 60).group(1)
        channel, stub = connect(admin)
        with channel:
            name = call(stub.AddGroup, apb.AddGroupRequest()).name  # no refusal: the platform waits for room
            time.sleep(5)
            waiting = _record(stub, name)
            assert waiting["phase"] == "GROUP_PHASE_STARTING", waiting  # pending: the head has no CPU free
            said = [
                line for line in up.lines if f"expert group {name}: the Ray cluster has 0 of its 1 CPUs free" in line
            ]
            assert said and "deployed anyway, waiting up to 300 s for room" in said[0], up.lines[-20:]

            worker = cluster.add_node(num_cpus=1)  # what the autoscaler adds for the pending demand
            deadline = time.monotonic() + 240
            record = _record(stub, name)
            while record["phase"] not in ("GROUP_PHASE_SERVING", "GROUP_PHASE_FAILED") and time.monotonic() < deadline:
                time.sleep(0.5)
                record = _record(stub, name)
            assert record["phase"] == "GROUP_PHASE_SERVING", (record, "".join(up.lines[-30:]))
            assert "filled by" in record["reason"]
            assert record["address"].rsplit(":", 1)[0] in (worker.node_ip_address, "127.0.0.1")
    finally:
        up.stop()
