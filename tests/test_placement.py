import pytest

from expertmesh.contracts import group_map as placement
from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.models.checkpoint import MoESpec

SPEC = MoESpec("deepseek_v3", 3, (1, 2), 8, 2, 32, ("gate_up_proj", "down_proj"))


def test_contiguous_split_covers_every_expert_once():
    p = placement.contiguous(SPEC, 3)
    placement.validate(p, SPEC)
    assert list(p.groups) == ["g0", "g1", "g2"]
    assert p.groups["g0"] == ((1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2))
    hosts = p.hosts()
    assert sorted(hosts) == SPEC.all_experts()
    assert all(len(g) == 1 for g in hosts.values())


def test_contiguous_refuses_more_groups_than_experts():
    with pytest.raises(PlacementError, match="more than the 8 experts"):
        placement.contiguous(SPEC, 9)
    with pytest.raises(PlacementError, match="at least 1"):
        placement.contiguous(SPEC, 0)


def test_parse_star_ranges_and_replicas():
    p = placement.parse({"groups": {"a": {"*": ["0-3"]}, "b": {"*": ["4-7"]}, "hot": {1: [0], "2": [5]}}}, SPEC)
    placement.validate(p, SPEC)
    assert p.hosts()[(1, 0)] == ("a", "hot")
    assert p.hosts()[(2, 5)] == ("b", "hot")
    assert p.hosts()[(2, 0)] == ("a",)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"groups": {"a": {"*": ["0-6"]}}}, r"leaves 2 experts unhosted: layer 1 expert 7, layer 2 expert 7"),
        ({"groups": {"a": {"*": ["0-7"]}, "b": {5: [0]}}}, "layer 5, which is not an MoE layer"),
        ({"groups": {"a": {"*": ["0-7"]}, "b": {1: [8]}}}, "expert 8 of layer 1, which does not exist"),
        ({"groups": {"A_bad": {"*": ["0-7"]}}}, "group name 'A_bad'"),
        ({"groups": {}}, "non-empty 'groups:'"),
        ({"groups": {"a": {"*": "0-7"}}}, "expected a list of experts"),
        ({"groups": {"a": {"*": ["7-0"]}}}, "empty range"),
        ({"groups": {"a": {"x": [0]}}}, "a layer is a number or"),
    ],
)
def test_bad_placements_are_refused_with_the_reason(data, message):
    with pytest.raises(PlacementError, match=message):
        placement.validate(placement.parse(data, SPEC), SPEC)


def test_load_reports_missing_and_invalid_files(tmp_path):
    with pytest.raises(PlacementError, match="does not exist"):
        placement.load(tmp_path / "nope.yaml", SPEC)
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [unclosed")
    with pytest.raises(PlacementError, match="not valid YAML"):
        placement.load(bad, SPEC)


def test_routing_table_json_round_trip():
    table = RoutingTable.from_placement(placement.contiguous(SPEC, 2), SPEC.num_experts, version=7)
    back = RoutingTable.from_json(table.to_json())
    assert back == table
    assert back.groups() == ["g0", "g1"] and back.layers() == [1, 2]
