"""A group keeps its endpoint in the state store: a flushed store heals without restarts."""

import time

from expertmesh.expert_group.registration import EndpointRegistration
from expertmesh.store import open_store


def test_a_flushed_endpoint_comes_back_by_itself():
    store = open_store()
    registration = EndpointRegistration(store, "g7", "10.0.0.7:50107", interval_s=0.05).start()
    assert store.endpoints() == {"g7": "10.0.0.7:50107"}
    store._kv._hashes.clear()  # FLUSHDB of the in-process backend
    deadline = time.monotonic() + 5
    while store.endpoints() != {"g7": "10.0.0.7:50107"}:
        assert time.monotonic() < deadline, "the group never registered again"
        time.sleep(0.01)
    registration.stop()
