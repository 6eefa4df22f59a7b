"""The router's routing view and per-group dispatch plan: pure functions, tested without servers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.contracts.errors import UnhostedExperts
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.router.dispatch import layer_plan as dispatch_plan
from expertmesh.router.dispatch.layer_plan import NoHealthyReplica, plan_layer, restrict_to
from expertmesh.router.dispatch.replica_split import EXPERT_FIXED_ROWS, level_rows
from expertmesh.router.dispatch.routing_view import RoutingView

E = 4


def _table(replicas, shares=None, version=3):
    return RoutingTable(version=version, num_experts=E, replicas=replicas, shares=shares or {})


def _two_groups():
    """Layers 0 and 1; experts 0-1 on ga, 2-3 on gb, expert 3 of layer 1 also on gc."""
    replicas = {(layer, e): ("ga",) if e < 2 else ("gb",) for layer in (0, 1) for e in range(E)}
    replicas[(1, 3)] = ("gb", "gc")
    return _table(replicas)


def _rebuild(calls, num_tokens, k):
    """[T, K] group index per slot from the calls (-1 where no call has it); fails on a slot sent twice."""
    owner = torch.full((num_tokens, k), -1)
    for call in calls:
        mine = call.expert_ids >= 0
        assert (owner[call.tokens][mine] == -1).all(), "a slot went to two groups"
        rows = owner[call.tokens]
        rows[mine] = call.group
        owner[call.tokens] = rows
    return owner


def test_view_refuses_a_table_that_leaves_an_expert_unhosted():
    replicas = dict(_two_groups().replicas)
    del replicas[(1, 2)]
    with pytest.raises(UnhostedExperts, match=r"version 3 leaves 1 experts .* 1/2"):
        RoutingView.build(_table(replicas), moe_layers=(0, 1))


def test_view_refuses_a_table_missing_a_whole_moe_layer():
    replicas = {pair: g for pair, g in _two_groups().replicas.items() if pair[0] == 0}
    with pytest.raises(UnhostedExperts, match="leaves 4 experts"):
        RoutingView.build(_table(replicas), moe_layers=(0, 1))


def test_view_lists_primaries_and_replicas():
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    assert view.groups == ("ga", "gb", "gc") and view.version == 3
    assert view.primary[1].tolist() == [0, 0, 1, 1]
    assert [r.expert for r in view.replicated[1]] == [3] and view.holders[(1, 3)] == (1, 2)


def test_each_slot_goes_to_a_group_holding_its_expert_with_its_weight():
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    index = torch.tensor([[0, 2], [1, 0], [3, 2], [E, 1]])  # [T, K]; E is the skip sentinel
    weights = torch.rand(4, 2)
    calls = plan_layer(view, 0, index, weights, in_flight=[0, 0, 0])
    assert [c.group for c in calls] == [0, 1]
    ga, gb = calls
    assert ga.tokens.tolist() == [0, 1, 3] and gb.tokens.tolist() == [0, 2]
    assert ga.expert_ids.tolist() == [[0, -1], [1, 0], [-1, 1]]
    assert gb.expert_ids.tolist() == [[-1, 2], [3, 2]]
    assert torch.equal(ga.weights[1], weights[1]) and ga.weights[0, 1] == 0 and ga.weights[2, 0] == 0
    assert ga.expert_ids.dtype == torch.int32


def test_a_replicated_expert_is_split_across_its_replicas():
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    index = torch.full((40, 1), 3)
    calls = plan_layer(view, 1, index, torch.ones(40, 1), in_flight=[0, 0, 0])
    assert {c.group: c.tokens.numel() for c in calls} == {1: 20, 2: 20}


def test_a_replicated_experts_rows_go_where_they_level_the_steps_work():
    """Layer 1: expert 3 on gb and gc, expert 2 on gb alone. gb already computes expert 2's rows, so
    expert 3's go to gc, all of them while that keeps gc the lower, the rest shared to one level."""
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    one_token = plan_layer(view, 1, torch.tensor([[2, 3]]), torch.ones(1, 2), in_flight=[0, 0, 0])
    assert {c.group: c.expert_ids.tolist() for c in one_token} == {1: [[2, -1]], 2: [[-1, 3]]}
    index = torch.tensor([[2]] * 10 + [[3]] * 30)  # gb: 8 + 10; expert 3's 30 rows: 6 to gb, 24 to gc
    calls = plan_layer(view, 1, index, torch.ones(40, 1), in_flight=[0, 0, 0])
    assert {c.group: c.tokens.numel() for c in calls} == {1: 16, 2: 24}


@pytest.mark.parametrize(
    "n, loads, in_flight, expected, after",
    [
        (0, [0.0, 0.0], [0, 0], [0, 0], [0.0, 0.0]),
        (1, [0.0, 0.0], [0, 0], [1, 0], [9.0, 0.0]),  # a tie: the first
        (1, [0.0, 0.0], [2, 0], [0, 1], [0.0, 9.0]),  # a tie: fewer calls in flight
        (3, [0.0, 5.0], [0, 0], [3, 0], [11.0, 5.0]),  # too few rows to pay a second weight read
        (100, [0.0, 0.0], [0, 0], [50, 50], [58.0, 58.0]),
        (20, [30.0, 0.0], [0, 0], [0, 20], [30.0, 28.0]),
        (41, [0.0, 9.0, 100.0], [0, 0, 0], [25, 16, 0], [33.0, 33.0, 100.0]),
    ],
)
def test_level_rows(n, loads, in_flight, expected, after):
    assert level_rows(n, list(range(len(loads))), loads, in_flight) == expected
    assert loads == after


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.lists(st.floats(0, 200), min_size=1, max_size=4), st.data())
def test_property_level_rows_places_every_row_and_never_does_worse_than_one_replica(n, loads, data):
    """The counts are n rows over the replicas, and the highest load after is no higher than giving all
    n rows to the least loaded replica (what a split that ignored the step would do at best)."""
    in_flight = data.draw(st.lists(st.integers(0, 3), min_size=len(loads), max_size=len(loads)))
    before = list(loads)
    counts = level_rows(n, list(range(len(loads))), loads, in_flight)
    assert sum(counts) == n and min(counts) >= 0
    least = min(range(len(before)), key=lambda i: before[i])
    whole = list(before)
    whole[least] += EXPERT_FIXED_ROWS + n if n else 0
    assert max(loads) <= max(whole) + 1 + 1e-9  # + 1: rows are whole


def test_avoided_groups_fail_over_to_other_replicas_or_say_which_experts_have_none():
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    index = torch.full((6, 1), 3)
    calls = plan_layer(view, 1, index, torch.ones(6, 1), in_flight=[0, 0, 0], avoid=frozenset({1}))
    assert [(c.group, c.tokens.numel()) for c in calls] == [(2, 6)]
    with pytest.raises(NoHealthyReplica) as err:
        plan_layer(view, 1, torch.tensor([[2, 3]]), torch.ones(1, 2), in_flight=[0, 0, 0], avoid=frozenset({1}))
    assert err.value.experts == [2]


def test_restrict_to_keeps_only_one_calls_slots():
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    index = torch.tensor([[0, 3], [3, 2], [1, 0]])
    weights = torch.rand(3, 2)
    gb = [c for c in plan_layer(view, 0, index, weights, [0, 0, 0]) if c.group == 1][0]
    sub_index, sub_weights = restrict_to(gb, 3, E)
    assert sub_index.tolist() == [[E, 3], [3, 2], [E, E]]
    assert sub_weights[1].tolist() == weights[1].tolist() and sub_weights[2].tolist() == [0, 0]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 3),
    st.lists(st.sampled_from(["ga", "gb", "gc"]), min_size=1, max_size=3, unique=True),
    st.data(),
)
def test_property_every_valid_slot_is_sent_exactly_once_to_a_holder(tokens, k, layer1_expert3, data):
    replicas = dict(_two_groups().replicas)
    replicas[(1, 3)] = tuple(layer1_expert3)
    view = RoutingView.build(_table(replicas), moe_layers=(0, 1))
    index = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, E), min_size=k, max_size=k), min_size=tokens, max_size=tokens))
    )
    in_flight = data.draw(st.lists(st.integers(0, 3), min_size=3, max_size=3))
    calls = plan_layer(view, 1, index, torch.rand(tokens, k), in_flight)
    owner = _rebuild(calls, tokens, k)
    for t in range(tokens):
        for j in range(k):
            expert = int(index[t, j])
            if expert == E:
                assert owner[t, j] == -1
            else:
                assert int(owner[t, j]) in view.holders[(1, expert)]
    for call in calls:  # a token is sent to a group only if it has a slot there
        assert (call.expert_ids >= 0).any(dim=1).all()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.sampled_from([0, 1]),
    st.data(),
)
def test_property_layers_without_replicas_are_planned_in_python_and_numpy_exactly_as_with_tensors(
    tokens, k, dtype, layer, data
):
    """A layer with no replicated expert in play (layer 0; layer 1 where its replicated expert is not chosen) is
    planned in plain Python (decode-sized) or numpy (larger, weights numpy holds): each must give the tensor path's
    calls bit for bit (the weights' dtype and every value, -1 / 0 elsewhere), and plan_layer takes one of them."""
    view = RoutingView.build(_two_groups(), moe_layers=(0, 1))
    highest = E if layer == 0 else E - 1  # layer 1: expert 3 (replicated) never chosen, the sentinel E is
    index = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, highest), min_size=k, max_size=k), min_size=tokens, max_size=tokens))
    )
    index[index == E - 1] = E if layer == 1 else E - 1
    weights = torch.rand(tokens, k).to(dtype)
    tensors = dispatch_plan._plan_tensors(view, layer, index, weights, [0, 0])
    paths = {"plan_layer": plan_layer(view, layer, index, weights, [0, 0])}
    paths["python"] = dispatch_plan._plan_small(view.primary[layer].tolist(), E, index, weights)
    if dtype is not torch.bfloat16:
        paths["numpy"] = dispatch_plan._plan_primaries(view.primary[layer].numpy(), E, index, weights)
    for path, calls in paths.items():
        assert [c.group for c in calls] == [c.group for c in tensors], path
        for a, b in zip(calls, tensors):
            for name in ("tokens", "expert_ids", "weights"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and torch.equal(x, y), (path, name)
