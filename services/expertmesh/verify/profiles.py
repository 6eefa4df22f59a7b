"""What ``expertmesh profile build`` measures: each query domain's expert choices through a running router.

Each labelled query goes to the router with its domain and the ``exact`` policy; the router's ``domain_load``
(expert choices per (layer, expert) by domain, counted since it started) before and after gives each domain's
counts, and ``router.policy.profiles.build_profiles`` turns them into capability profiles."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from expertmesh.classifier.corpus import Example
from expertmesh.client import Client
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.observability.remote import domain_load
from expertmesh.router.policy.profiles import build_profiles


def measure_profiles(client: Client, target: str, examples: Sequence[Example], max_tokens: int, concurrency: int):
    """The capability profiles of ``examples``' domains, by domain, measured through ``client`` (the router at
    ``target``, named in errors): ``concurrency`` queries in flight, ``max_tokens`` generated each."""
    try:
        moe_layers = tuple(client.models()[0].moe_layers)
    except grpc.RpcError as err:
        raise ExpertMeshError(f"cannot reach the router at {target}: {err.code().name}: {err.details()}") from None
    before = domain_load(client)

    def run(example: Example) -> None:
        chunks = client.generate(
            example.text, max_new_tokens=max_tokens, stop_at_eos=False, routing_policy="exact", domain=example.domain
        )
        try:
            for _ in chunks:
                pass
        except grpc.RpcError as err:
            raise ExpertMeshError(
                f"query {example.text[:40]!r} ({example.domain}): {err.code().name}: {err.details()}"
            ) from None

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, examples))
    after = domain_load(client)
    profiles = build_profiles({d: load - before.get(d, 0) for d, load in after.items()}, moe_layers)
    if not profiles:
        raise ExpertMeshError(
            f"the router at {target} counted no tokens by domain; is it an expertmesh router of this version?"
        )
    return profiles
