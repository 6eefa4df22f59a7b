"""Which tokens of one MoE layer go to which expert group. Pure: tensors in, tensors out.

``plan_layer`` assigns every chosen (token, expert) slot to one group holding the
expert: the primary replica, or for a replicated expert the replicas that level the
step's work across groups (``replica_split``). Each group gets each of its tokens once, with only the expert
ids and weights it must apply (others -1 / 0), so the sum of the groups' partial
sums is the layer's output.

``avoid`` names groups that just failed: their slots go to other replicas (the
same step's failover); an expert with no replica outside ``avoid`` raises
``NoHealthyReplica``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from expertmesh.router.dispatch.replica_split import EXPERT_FIXED_ROWS, level_rows
from expertmesh.router.dispatch.routing_view import RoutingView


class NoHealthyReplica(Exception):
    """Some chosen experts have no replica outside the groups to avoid."""

    def __init__(self, layer: int, experts: list[int]):
        super().__init__(f"layer {layer}: experts {experts} have no other replica")
        self.experts = experts


@dataclass(frozen=True)
class GroupCall:
    group: int  # group index in the view
    tokens: torch.Tensor  # [Tg] int64: rows of the layer's hidden states this group needs
    expert_ids: torch.Tensor  # [Tg, K] int32: global ids to apply, -1 elsewhere
    weights: torch.Tensor  # [Tg, K]: their routing weights, 0 elsewhere


def plan_layer(
    view: RoutingView,
    layer: int,
    index: torch.Tensor,
    weights: torch.Tensor,
    in_flight: Sequence[int],
    avoid: frozenset[int] = frozenset(),
) -> list[GroupCall]:
    """index [T, K] int64 (>= num_experts: transformers' skip sentinel), weights [T, K] -> one call per group.

    in_flight[g]: calls in flight to group index g, to break ties of replica splits toward idle replicas.
    A replicated expert's slots follow ``replica_split.level_rows``; its replicas' shares are not read here.
    """
    num_experts = view.num_experts
    if index.numel() <= SMALL_PLAN_SLOTS and not avoid and not view.replicated.get(layer):
        return _plan_small(view.primary[layer].tolist(), num_experts, index, weights)
    valid = index < num_experts  # [T, K]
    owner = torch.where(
        valid, view.primary[layer][index.clamp(max=num_experts - 1)], -1
    )  # [T, K]; -1: fallback experts
    present = [e for e in torch.unique(index[valid]).tolist() if view.holders[(layer, e)]]
    splits = {r.expert: r.groups for r in view.replicated.get(layer, ())}  # expert -> the replicas it may go to
    if avoid:
        for expert in present:
            groups = view.holders[(layer, expert)]
            if any(g in avoid for g in groups):
                splits[expert] = tuple(g for g in groups if g not in avoid)
    stranded = sorted(e for e in present if e in splits and not splits[e])
    if stranded:
        raise NoHealthyReplica(layer, stranded)
    rows = torch.bincount(index[valid], minlength=num_experts).tolist()  # [E] slots per expert this step
    loads = [0.0] * len(view.groups)  # each group's work from its experts with one replica here
    for expert in present:
        if expert not in splits:
            loads[int(view.primary[layer][expert])] += EXPERT_FIXED_ROWS + rows[expert]
    for expert in sorted((e for e in present if e in splits), key=lambda e: (-rows[e], e)):
        groups = splits[expert]
        counts = level_rows(rows[expert], groups, loads, in_flight)
        slots = (index == expert).nonzero()  # [n, 2] (token, k) of this expert's tokens
        owner[slots[:, 0], slots[:, 1]] = torch.repeat_interleave(torch.tensor(groups), torch.tensor(counts))

    calls = []
    for g in torch.unique(owner[owner >= 0]).tolist():
        mine = owner == g  # [T, K]
        tokens = mine.any(dim=1).nonzero().squeeze(1)  # [Tg]
        calls.append(
            GroupCall(
                group=g,
                tokens=tokens,
                expert_ids=torch.where(mine, index, -1)[tokens].to(torch.int32),
                weights=torch.where(mine, weights, 0)[tokens],
            )
        )
    return calls


#: Up to this many (token, expert) slots (decode steps), a layer without replicated experts is planned
#: in plain Python: a dozen small torch ops cost several times the arithmetic they do.
SMALL_PLAN_SLOTS = 128


def _plan_small(primary: list[int], num_experts: int, index: torch.Tensor, weights: torch.Tensor) -> list[GroupCall]:
    """``plan_layer`` for primaries only (primary[e]: group index of expert e, -1: none), slot by slot:
    the same calls, tokens in order, ids and weights where the group's slots are, -1 / 0 elsewhere."""
    rows, row_weights = index.tolist(), weights.tolist()
    mine: dict[int, list[int]] = {}  # group -> its tokens, in order
    for t, row in enumerate(rows):
        for e in row:
            g = primary[e] if e < num_experts else -1
            if g >= 0 and (not mine.get(g) or mine[g][-1] != t):
                mine.setdefault(g, []).append(t)
    calls = []
    for g in sorted(mine):
        tokens = mine[g]
        ids = [[e if e < num_experts and primary[e] == g else -1 for e in rows[t]] for t in tokens]
        picked = [[w if e >= 0 else 0.0 for e, w in zip(ids_t, row_weights[t])] for ids_t, t in zip(ids, tokens)]
        calls.append(
            GroupCall(
                group=g,
                tokens=torch.tensor(tokens, dtype=torch.long),
                expert_ids=torch.tensor(ids, dtype=torch.int32),
                weights=torch.tensor(picked, dtype=weights.dtype),
            )
        )
    return calls


def restrict_to(call: GroupCall, num_tokens: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's [T, K] index and weights keeping only ``call``'s slots (the rest skipped), to re-plan them."""
    k = call.expert_ids.shape[1]
    index = torch.full((num_tokens, k), num_experts, dtype=torch.long)  # [T, K] all sentinels
    weights = torch.zeros((num_tokens, k), dtype=call.weights.dtype)
    index[call.tokens] = torch.where(call.expert_ids >= 0, call.expert_ids.long(), num_experts)
    weights[call.tokens] = call.weights
    return index, weights


def slot_groups(num_tokens: int, k: int, calls: Sequence[GroupCall]) -> torch.Tensor:
    """[T, K] int64: the group index that served each (token, slot) of a layer, from the calls that
    answered (-1: no group, an empty slot or one the fallback dropped). A slot two calls claim (never,
    for a plan of ``plan_layer``) keeps the later call's group."""
    owner = torch.full((num_tokens, k), -1, dtype=torch.long)
    for call in calls:
        mine = call.expert_ids >= 0  # [Tg, K']
        rows = owner[call.tokens, : mine.shape[1]]  # [Tg, K'] (a copy: written back below)
        owner[call.tokens, : mine.shape[1]] = torch.where(mine, call.group, rows)
    return owner
