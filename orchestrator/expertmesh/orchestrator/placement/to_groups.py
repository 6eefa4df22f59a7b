"""From a GPU placement (``expertmesh plan``) to expert groups bound to hardware.

Glossary
- *group per GPU* (default): group ``gpu-<id>`` holds the replicas the plan
  put on that GPU.
- *group per island*: group ``<node>-<island>`` holds the replicas of all GPUs of
  one NVLink island; an expert placed on two GPUs of the island is held once
  with the shares added.
- *row*: a placement layer index, the ordinal among the model's MoE layers.

Pure: plain data in, plain data out; the data plane turns ``hardware`` into Ray
resources and in-replica binding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.topology import Topology
from expertmesh.orchestrator.placement.memory import GB, expert_budget_bytes


@dataclass(frozen=True)
class GroupHardware:
    node: str
    island: str
    gpu_ids: tuple[int, ...]
    numa: int | None
    #: bytes of GPU memory the group has over its GPUs (the topology's memory_gb; 0: not stated)
    memory_bytes: int = 0

    @property
    def expert_budget_bytes(self) -> int | None:
        """The group's default budget of expert weights: its GPU memory less the memory model's overhead."""
        return expert_budget_bytes(self.memory_bytes) if self.memory_bytes else None


@dataclass(frozen=True)
class GroupLayout:
    placement: GroupPlacement
    #: (layer, expert) -> {group: share of the expert's tokens}, shares summing to 1
    shares: dict[tuple[int, int], dict[str, float]]
    hardware: dict[str, GroupHardware]


def _name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40]


def groups_from_placement(
    placement: Placement, topology: Topology, moe_layers: tuple[int, ...], per: Literal["gpu", "island"] = "gpu"
) -> GroupLayout:
    if placement.num_layers != len(moe_layers):
        raise PlacementError(
            f"the placement has {placement.num_layers} layers but the model has {len(moe_layers)} MoE layers"
        )
    where: dict[int, tuple[str, GroupHardware]] = {}  # gpu id -> (group, hardware)
    for node in topology.nodes:
        for island in node.islands:
            if per == "island":
                memory = int(sum(g.memory_gb for g in island.gpus) * GB)
                hw = GroupHardware(node.name, island.name, tuple(g.id for g in island.gpus), island.numa, memory)
                for gpu in island.gpus:
                    where[gpu.id] = (_name(f"{node.name}-{island.name}"), hw)
            else:
                for gpu in island.gpus:
                    numa = gpu.numa if gpu.numa is not None else island.numa
                    hw = GroupHardware(node.name, island.name, (gpu.id,), numa, int(gpu.memory_gb * GB))
                    where[gpu.id] = (f"gpu-{gpu.id}", hw)
    pairs: dict[str, set[tuple[int, int]]] = {}
    shares: dict[tuple[int, int], dict[str, float]] = {}
    for row, layer in enumerate(moe_layers):
        for expert in range(placement.num_experts):
            for g in np.flatnonzero(placement.shares[row, expert] > 0):
                group, _ = where[placement.gpu_ids[g]]
                pairs.setdefault(group, set()).add((layer, expert))
                by_group = shares.setdefault((layer, expert), {})
                by_group[group] = by_group.get(group, 0.0) + float(placement.shares[row, expert, g])
    hardware = {group: hw for group, hw in where.values() if group in pairs}
    return GroupLayout(
        placement=GroupPlacement({g: tuple(sorted(p)) for g, p in sorted(pairs.items())}),
        shares=shares,
        hardware=dict(sorted(hardware.items())),
    )
