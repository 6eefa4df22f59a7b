"""Shared fixtures: tiny random checkpoints made with transformers' own config
classes and ``save_pretrained`` (cached for the session), one local Ray for the
modules that can share it, and a Redis database of each module's own on the
Makefile's loopback redis-server."""

from __future__ import annotations

import os
from urllib.parse import urlparse, urlunparse

import pytest

from expertmesh.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> checkpoint directory, built on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, object] = {}

    def get(arch: str, **kwargs):
        key = arch + repr(sorted(kwargs.items()))
        if key not in built:
            built[key] = make_tiny_checkpoint(arch, root / f"{arch}-{len(built)}", **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def _shared_ray_finaliser():
    yield
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_shared_ray_finaliser):
    """One local Ray (``address="local"``: never a cluster some earlier ``ray start`` left on the machine)
    shared by the modules that drive Ray in this process: started by the first that asks (again after a
    module that needed a Ray of its own, see ``without_shared_ray``) and shut down after the last test."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield


@pytest.fixture(scope="module")
def shared_ray_address(ray_session) -> str:
    """The shared Ray's address, for an ``expertmesh up`` process to join (``--ray-address``) when the
    module tests what it serves, not how it starts Ray: ~8 s less per process, start and stop."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def without_shared_ray():
    """For a module that starts a Ray of its own in this process (e.g. with a runtime environment of its own)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    yield


#: db 0 of the test server holds only these claims; each module gets a database of its own
_CLAIM = "expertmesh-test-db-claim:{}"


@pytest.fixture(scope="module")
def redis_url():
    """A Redis database of this module's own, empty when the module starts and flushed when it ends.

    Databases are claimed with SET NX in db 0, so modules never see or clear each other's keys, also
    when two test runs share one server."""
    import redis

    base = os.environ.get("EXPERTMESH_TEST_REDIS_URL")
    if not base:
        pytest.skip("EXPERTMESH_TEST_REDIS_URL is unset: run through `make test`, which starts a loopback redis-server")
    claims = redis.Redis.from_url(urlunparse(urlparse(base)._replace(path="/0")))
    databases = int(claims.config_get("databases")["databases"])
    owner = f"{os.getpid()}:{id(claims)}"
    db = next((n for n in range(1, databases) if claims.set(_CLAIM.format(n), owner, nx=True, ex=3600)), None)
    if db is None:
        claims.close()
        pytest.fail(
            f"all {databases - 1} Redis databases of {base} are claimed: start redis-server with more --databases"
        )
    url = urlunparse(urlparse(base)._replace(path=f"/{db}"))
    own = redis.Redis.from_url(url)
    own.flushdb()
    try:
        yield url
    finally:
        own.flushdb()
        own.close()
        claims.delete(_CLAIM.format(db))
        claims.close()
