"""Shared fixtures: tiny random checkpoints made with transformers' own config
classes and ``save_pretrained`` (cached for the session), and the Redis URL the
Makefile's loopback redis-server listens on."""

from __future__ import annotations

import os

import pytest

from expertmesh.tiny import make_tiny_checkpoint


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
def redis_url():
    url = os.environ.get("EXPERTMESH_TEST_REDIS_URL")
    if not url:
        pytest.skip("EXPERTMESH_TEST_REDIS_URL is unset: run through `make test`, which starts a loopback redis-server")
    return url
