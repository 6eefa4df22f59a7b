"""A placement: for each layer, each expert's replicas with the GPU and share.

Glossary
--------
logical expert
    Expert ``e`` of a MoE layer as the model defines it.
replica
    One copy of a logical expert's weights on one GPU. An expert has one or more
    replicas, at most one per GPU.
share
    The fraction of a logical expert's tokens that one replica takes; the shares
    of an expert sum to 1, so a replica's load is ``load[l][e] * share``.
slot
    Room for one replica on one GPU in one layer; a GPU holds at most
    ``slots_per_gpu`` replicas per layer.

Placement file (JSON), written by ``expertmesh plan``::

    {"layers": [{"layer": 0, "experts": [
        {"expert": 0, "replicas": [{"gpu": 3, "share": 0.5}, {"gpu": 9, "share": 0.5}]}]}]}

``gpu`` is the cluster-wide GPU id of the topology; layers and experts appear in
order, replicas by GPU id.

In memory the placement is dense: ``shares[l, e, g]`` is the share of expert ``e``
of layer ``l`` on the ``g``-th GPU of ``gpu_ids`` (0 = no replica there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from expertmesh.contracts.errors import PlacementError

SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Replica:
    gpu: int
    share: float


@dataclass(frozen=True, eq=False)
class Placement:
    gpu_ids: tuple[int, ...]  # [G] cluster GPU id of each column of shares
    shares: np.ndarray  # [L, E, G] float64

    @property
    def num_layers(self) -> int:
        return self.shares.shape[0]

    @property
    def num_experts(self) -> int:
        return self.shares.shape[1]

    def replicas(self, layer: int, expert: int) -> tuple[Replica, ...]:
        row = self.shares[layer, expert]
        return tuple(
            Replica(self.gpu_ids[g], float(row[g]))
            for g in sorted(np.flatnonzero(row > 0), key=lambda g: self.gpu_ids[g])
        )

    def slots_used(self) -> np.ndarray:
        """[L, G] replicas each GPU holds in each layer."""
        return (self.shares > 0).sum(axis=1)

    def check(self, slots_per_gpu: int | None = None) -> None:
        """Raise PlacementError unless every invariant of a placement holds."""
        sums = self.shares.sum(axis=2)
        if (self.shares < 0).any():
            raise PlacementError("placement: a share is negative")
        if ((self.shares > 0).sum(axis=2) < 1).any():
            layer, expert = np.argwhere((self.shares > 0).sum(axis=2) < 1)[0]
            raise PlacementError(f"placement: expert {expert} of layer {layer} has no replica")
        if np.abs(sums - 1).max() > SHARE_TOLERANCE:
            layer, expert = np.unravel_index(np.abs(sums - 1).argmax(), sums.shape)
            raise PlacementError(
                f"placement: shares of expert {expert} of layer {layer} sum to {sums[layer, expert]:.6f}, not 1"
            )
        if slots_per_gpu is not None and self.slots_used().max() > slots_per_gpu:
            layer, g = np.unravel_index(self.slots_used().argmax(), self.slots_used().shape)
            raise PlacementError(
                f"placement: GPU {self.gpu_ids[g]} holds {self.slots_used()[layer, g]} replicas in layer {layer},"
                f" more than its {slots_per_gpu} slots"
            )


def placement_to_dict(p: Placement) -> dict[str, Any]:
    return {
        "layers": [
            {
                "layer": layer,
                "experts": [
                    {"expert": e, "replicas": [{"gpu": r.gpu, "share": r.share} for r in p.replicas(layer, e)]}
                    for e in range(p.num_experts)
                ],
            }
            for layer in range(p.num_layers)
        ]
    }


def placement_from_dict(doc: Any, gpu_ids: tuple[int, ...], num_layers: int, num_experts: int) -> Placement:
    """Read a placement file against the topology's GPUs and the stats' shape."""
    column = {gid: g for g, gid in enumerate(gpu_ids)}
    shares = np.zeros((num_layers, num_experts, len(gpu_ids)))
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        raise PlacementError("placement file must be a JSON object with a 'layers' list")
    for entry in layers:
        layer = _index(entry, "layer", num_layers, "layer")
        experts = entry.get("experts")
        if not isinstance(experts, list):
            raise PlacementError(f"placement: layer {layer} has no 'experts' list")
        for ex in experts:
            e = _index(ex, "expert", num_experts, f"layer {layer}: expert")
            reps = ex.get("replicas")
            if not isinstance(reps, list) or not reps:
                raise PlacementError(f"placement: expert {e} of layer {layer} has no replicas")
            for r in reps:
                if (
                    not isinstance(r, dict)
                    or not isinstance(r.get("gpu"), int)
                    or not isinstance(r.get("share"), (int, float))
                ):
                    raise PlacementError(
                        f"placement: expert {e} of layer {layer}: each replica needs integer 'gpu' and number 'share'"
                    )
                if r["gpu"] not in column:
                    raise PlacementError(
                        f"placement: expert {e} of layer {layer} names GPU {r['gpu']}, not in the topology"
                    )
                if r["share"] <= 0:
                    raise PlacementError(
                        f"placement: expert {e} of layer {layer} has a replica with share {r['share']} (must be > 0)"
                    )
                g = column[r["gpu"]]
                if shares[layer, e, g] > 0:
                    raise PlacementError(f"placement: expert {e} of layer {layer} has two replicas on GPU {r['gpu']}")
                shares[layer, e, g] = float(r["share"])
    placement = Placement(tuple(gpu_ids), shares)
    placement.check()
    return placement


def placement_gpu_ids(text: str) -> tuple[int, ...]:
    """The GPU ids a placement file's replicas name, ascending (a file that is not one: ``PlacementError``, as
    ``parse_placement_json`` says it)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlacementError(f"placement file is not valid JSON: {err}") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        raise PlacementError("placement file must be a JSON object with a 'layers' list")
    return tuple(
        sorted(
            {
                r["gpu"]
                for entry in layers
                if isinstance(entry, dict) and isinstance(entry.get("experts"), list)
                for ex in entry["experts"]
                if isinstance(ex, dict) and isinstance(ex.get("replicas"), list)
                for r in ex["replicas"]
                if isinstance(r, dict) and isinstance(r.get("gpu"), int) and not isinstance(r.get("gpu"), bool)
            }
        )
    )


def parse_placement_json(text: str, gpu_ids: tuple[int, ...], num_layers: int, num_experts: int) -> Placement:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlacementError(f"placement file is not valid JSON: {err}") from None
    return placement_from_dict(doc, gpu_ids, num_layers, num_experts)


def _index(entry: Any, key: str, bound: int, what: str) -> int:
    value = entry.get(key) if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise PlacementError(f"placement: {what} {value!r} is not an integer in [0, {bound})")
    return value
