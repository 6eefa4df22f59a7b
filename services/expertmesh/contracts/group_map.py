"""Group placement: which expert group hosts which logical experts.

A placement file (YAML) names groups and, for each, the experts it hosts per
MoE layer; ``"*"`` stands for every MoE layer, and an expert list may use
ranges::

    groups:
      g0: {"*": [0, 1]}
      g1: {"*": ["2-3"]}
      hot: {1: [0]}          # a second replica of expert 0 of layer 1

Without a file, ``contiguous(spec, n)`` splits each layer's experts into ``n``
contiguous runs, group ``i`` taking run ``i`` in every layer.

``validate`` refuses, before anything starts, a placement that leaves a logical
expert unhosted or names one the checkpoint does not have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from expertmesh.contracts.errors import PlacementError

if TYPE_CHECKING:  # checkpoint imports torch, which the routing table's readers (admin commands) do not need
    from expertmesh.models.checkpoint import MoESpec

# Group names become Ray Serve deployment names and Kubernetes-style labels.
_GROUP_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


@dataclass(frozen=True)
class GroupPlacement:
    """``groups[name]`` = sorted tuple of (layer, expert) pairs that group hosts."""

    groups: dict[str, tuple[tuple[int, int], ...]]

    def hosts(self) -> dict[tuple[int, int], tuple[str, ...]]:
        """(layer, expert) -> names of the groups holding it, in group order."""
        out: dict[tuple[int, int], list[str]] = {}
        for name, pairs in self.groups.items():
            for pair in pairs:
                out.setdefault(pair, []).append(name)
        return {pair: tuple(names) for pair, names in sorted(out.items())}


def contiguous(spec: MoESpec, num_groups: int) -> GroupPlacement:
    if num_groups < 1:
        raise PlacementError(f"--groups must be at least 1, got {num_groups}")
    if num_groups > spec.num_experts:
        raise PlacementError(
            f"--groups {num_groups} is more than the {spec.num_experts} experts per layer; each group needs one"
        )
    bounds = [round(i * spec.num_experts / num_groups) for i in range(num_groups + 1)]
    return GroupPlacement(
        {
            f"g{i}": tuple((layer, e) for layer in spec.moe_layers for e in range(bounds[i], bounds[i + 1]))
            for i in range(num_groups)
        }
    )


def _expand_experts(items: Any, where: str) -> list[int]:
    if not isinstance(items, list):
        raise PlacementError(f"{where}: expected a list of experts, got {items!r}")
    out: list[int] = []
    for item in items:
        if isinstance(item, bool):
            raise PlacementError(f"{where}: {item!r} is not an expert id")
        if isinstance(item, int):
            out.append(item)
        elif isinstance(item, str) and re.fullmatch(r"\d+-\d+", item):
            lo, hi = map(int, item.split("-"))
            if lo > hi:
                raise PlacementError(f"{where}: empty range {item!r}")
            out.extend(range(lo, hi + 1))
        else:
            raise PlacementError(f"{where}: {item!r} is not an expert id or a range like '0-3'")
    return out


def parse(data: Any, spec: MoESpec) -> GroupPlacement:
    """Placement from parsed YAML; layers given as ``"*"`` expand to every MoE layer."""
    if not isinstance(data, dict) or not isinstance(data.get("groups"), dict) or not data["groups"]:
        raise PlacementError("a placement needs a non-empty 'groups:' mapping of group name -> {layer: [experts]}")
    groups: dict[str, tuple[tuple[int, int], ...]] = {}
    for name, layers in data["groups"].items():
        name = str(name)
        if not _GROUP_NAME.match(name):
            raise PlacementError(f"group name {name!r}: use lower-case letters, digits and '-' (at most 40)")
        if not isinstance(layers, dict) or not layers:
            raise PlacementError(f"group {name}: expected a mapping of layer -> [experts]")
        pairs: set[tuple[int, int]] = set()
        for layer_key, experts in layers.items():
            where = f"group {name}, layer {layer_key}"
            if layer_key == "*":
                layer_ids = list(spec.moe_layers)
            elif isinstance(layer_key, int) or (isinstance(layer_key, str) and layer_key.isdigit()):
                layer_ids = [int(layer_key)]
            else:
                raise PlacementError(f"{where}: a layer is a number or '*'")
            for layer in layer_ids:
                pairs.update((layer, e) for e in _expand_experts(experts, where))
        groups[name] = tuple(sorted(pairs))
    return GroupPlacement(groups)


def load(path: str | Path, spec: MoESpec) -> GroupPlacement:
    path = Path(path)
    if not path.is_file():
        raise PlacementError(f"placement file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise PlacementError(f"placement file {path} is not valid YAML: {err}") from None
    return parse(data, spec)


def validate(placement: GroupPlacement, spec: MoESpec, *, complete: bool = True) -> None:
    """Raise PlacementError unless every logical expert is hosted and every named one exists. ``complete=False``:
    ``placement`` is a part of one (a RayService application of one group), so only what it names is checked."""
    moe_layers = set(spec.moe_layers)
    for name, pairs in placement.groups.items():
        if not pairs:
            raise PlacementError(f"group {name} hosts no experts")
        for layer, expert in pairs:
            if layer not in moe_layers:
                raise PlacementError(
                    f"group {name} names layer {layer}, which is not an MoE layer (MoE layers: {sorted(moe_layers)})"
                )
            if not 0 <= expert < spec.num_experts:
                raise PlacementError(
                    f"group {name} names expert {expert} of layer {layer}, which does not exist "
                    f"(experts 0-{spec.num_experts - 1})"
                )
    if not complete:
        return
    hosted = placement.hosts()
    unhosted = [pair for pair in spec.all_experts() if pair not in hosted]
    if unhosted:
        shown = ", ".join(f"layer {layer} expert {e}" for layer, e in unhosted[:5])
        more = f" and {len(unhosted) - 5} more" if len(unhosted) > 5 else ""
        raise PlacementError(f"the placement leaves {len(unhosted)} experts unhosted: {shown}{more}")
