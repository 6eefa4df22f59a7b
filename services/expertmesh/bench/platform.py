"""The platform the benchmarks measure, and where it computes.

A router (``DataPlane``) over the contiguous split of the experts into expert
groups, which run either as Ray Serve deployments (``DataPlane.start``), as
plain ``expertmesh group serve`` processes, or in the router's own process,
whose addresses the router is handed in an in-process store
(``DataPlane.attach``): neither Ray nor Redis, as on the GPU machine.
``--device`` puts the router's model (and each benchmark's stock transformers
baseline) on a GPU; the groups on this host then compute on that GPU too.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from expertmesh.infra.console import progress

if TYPE_CHECKING:
    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.platform.data_plane import DataPlane

GROUPS_AS = ("ray", "process", "in-process")


def add_platform_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--groups-as",
        choices=GROUPS_AS,
        default="ray",
        help="expert groups as Ray Serve deployments, as plain `expertmesh group serve` processes (no Ray), or in "
        "the router's process, called in place (no Ray, no copies)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device of the router's model and of the stock transformers baseline: auto (the first CUDA GPU when "
        "there is one, else cpu), cpu, cuda or cuda:N; process groups compute on that GPU too (default auto)",
    )


def device_summary(device) -> dict:
    """The report's words for where a benchmark computed: the device, and the GPU's name on one."""
    import torch

    return {"device": str(device), **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})}


@contextmanager
def started(config: DataPlaneConfig, groups_as: str, bench: str) -> Iterator[DataPlane]:
    """The router's data plane over groups on Ray Serve or in plain processes; stopped on exit."""
    from expertmesh.platform.data_plane import DataPlane

    if groups_as == "ray":
        plane = DataPlane.start(config)
        try:
            yield plane
        finally:
            progress(f"bench {bench}: stopping the platform")
            plane.close()
        return
    groups, store = _local_groups(config, groups_as, bench)
    try:
        lookup = groups.lookup if groups_as == "in-process" else None
        plane = DataPlane.attach(config, store=store, in_process=lookup)
        try:
            yield plane
        finally:
            plane.close()
    finally:
        progress(f"bench {bench}: stopping the expert groups")
        groups.stop_all()


def _local_groups(config: DataPlaneConfig, groups_as: str, bench: str):
    """The groups of the contiguous split on this host (``expertmesh group serve`` processes, or in this process),
    and an in-process store that lists them and their routing table (as ``DataPlane.start`` publishes it):
    neither Ray nor Redis."""
    from expertmesh.platform.group_processes import start_process_groups
    from expertmesh.platform.in_process_groups import start_in_process_groups
    from expertmesh.store import open_store

    config = config.model_copy(update={"state_url": "memory://", "placement": None})
    store = open_store("memory://")
    if groups_as == "in-process":
        progress(f"bench {bench}: starting {config.groups} expert groups in this process")
        return start_in_process_groups(config, store), store
    progress(f"bench {bench}: starting {config.groups} expert groups as plain processes (expertmesh group serve)")
    return start_process_groups(config, store), store
