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

import numpy as np
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
    if not avoid and not view.replicated.get(layer):
        numpy_holds = index.device.type == "cpu" and weights.dtype in _NUMPY_WEIGHTS
        if numpy_holds and index.numel() > PYTHON_PLAN_SLOTS:
            return _plan_primaries(view.primary[layer].numpy(), num_experts, index, weights)
        if index.numel() <= SMALL_PLAN_SLOTS:
            return _plan_small(view.primary[layer].tolist(), num_experts, index, weights)
    return _plan_tensors(view, layer, index, weights, in_flight, avoid)


def _plan_tensors(
    view: RoutingView,
    layer: int,
    index: torch.Tensor,
    weights: torch.Tensor,
    in_flight: Sequence[int],
    avoid: frozenset[int] = frozenset(),
) -> list[GroupCall]:
    """``plan_layer`` in torch ops, on the index's device: replicas, groups to avoid, any dtype."""
    num_experts = view.num_experts
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


#: Up to this many (token, expert) slots (decode steps), a layer without replicated experts whose weights numpy
#: does not hold (bfloat16) is planned in plain Python: a dozen small torch ops cost several times the arithmetic.
SMALL_PLAN_SLOTS = 128
#: Past this many slots, a layer without replicated experts on the host is planned in numpy (``_plan_primaries``),
#: below in plain Python. One thread, two groups of four experts, top-2: 1 / 4 / 8 / 16 / 32 / 64 / 480 tokens
#: 22 / 22 / 23 / 23 / 23 / 26 / 58 us in numpy, 18 / 23 / 25 / 37 / 60 / 108 / 728 in Python, the torch path
#: 76 at 64 tokens and 110 at 480 (~400 in a serving process).
PYTHON_PLAN_SLOTS = 8


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


#: weight dtypes numpy holds (not bfloat16: there the tensor path)
_NUMPY_WEIGHTS = (torch.float32, torch.float64, torch.float16)


def _plan_primaries(
    primary: np.ndarray, num_experts: int, index: torch.Tensor, weights: torch.Tensor
) -> list[GroupCall]:
    """``plan_layer``'s tensor path for primaries only, on the host in numpy: the same calls (each numpy op a few
    microseconds on these sizes, each torch op 10-20 in a serving process: a 480-token prompt's layer planned in
    ~400 us the torch way). primary [E] group index of each expert (-1: none)."""
    idx, w = index.numpy(), weights.numpy()  # [T, K] each
    owner = np.where(idx < num_experts, primary[np.minimum(idx, num_experts - 1)], -1)  # [T, K]
    calls = []
    for g in np.unique(owner[owner >= 0]).tolist():
        mine = owner == g  # [T, K]
        tokens = np.flatnonzero(mine.any(axis=1))  # [Tg]
        ids = np.where(mine, idx, -1)[tokens].astype(np.int32)  # [Tg, K]
        picked = np.where(mine, w, np.zeros((), w.dtype))[tokens]  # [Tg, K]
        calls.append(GroupCall(g, torch.from_numpy(tokens), torch.from_numpy(ids), torch.from_numpy(picked)))
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
