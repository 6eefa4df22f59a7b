"""The bias audit (`expertmesh probe --labels`): shares, concentrations, disparity and parity on hand-checkable
counts, the labelled-prompts file's bounds, and the command's argument errors. End to end against a running
platform: `test_observability_probe.py::test_bias_audit_against_a_running_platform`."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from expertmesh.cli.bias_audit import format_audit
from expertmesh.cli.main import main
from expertmesh.observability import labels as labels_module
from expertmesh.observability.bias import (
    ValueCounts,
    add_activations,
    audit,
    concentrations,
    largest_spread,
    shares,
)
from expertmesh.observability.labels import LabelsError, parse_labels

# -- statistics ---------------------------------------------------------------------------


def test_shares_are_per_layer_and_rows_without_activations_are_zero():
    s = shares(np.array([[2.0, 2.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert s.tolist() == [[0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="non-negative"):
        shares(-np.ones((1, 2)))
    with pytest.raises(ValueError, match="layers, experts"):
        shares(np.ones(3))


def test_add_activations_counts_served_experts_by_moe_layer_row():
    counts = np.zeros((2, 4))
    add_activations(counts, (1, 3), [(1, [0, 2]), (3, [2, 3])])
    add_activations(counts, (1, 3), [(1, [2]), (3, [])])  # one slot dropped in layer 1, none served in 3
    assert counts.tolist() == [[1, 0, 2, 0], [0, 0, 1, 1]]
    with pytest.raises(ValueError, match="not one of the MoE layers"):
        add_activations(counts, (1, 3), [(2, [0])])
    with pytest.raises(ValueError, match="outside 0-3"):
        add_activations(counts, (1, 3), [(1, [4])])


def test_a_share_strictly_above_the_threshold_is_flagged_with_its_layer_and_value():
    counts = {
        ("gender", "female"): np.array([[45.0, 5.0, 25.0, 25.0], [40.0, 20.0, 20.0, 20.0]]),
        ("gender", "male"): np.array([[25.0, 25.0, 25.0, 25.0], [10.0, 10.0, 10.0, 70.0]]),
    }
    flags = concentrations(counts, moe_layers=(4, 9), threshold=0.40)
    assert [(f.layer, f.expert, f.dimension, f.value, f.share) for f in flags] == [
        (9, 3, "gender", "male", 0.7),
        (4, 0, "gender", "female", 0.45),
    ]  # 0.40 exactly (layer 9, female e0) is not above
    assert flags[0].activations == 100
    assert concentrations(counts, (4, 9), threshold=0.7) == []
    assert len(concentrations(counts, (4, 9), threshold=0.0)) == 16  # every expert with any share
    with pytest.raises(ValueError, match="threshold"):
        concentrations(counts, (4, 9), threshold=1.5)


def test_largest_spread_finds_the_widest_gap_across_values():
    per_value = {
        "EU": np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]),
        "US": np.array([[0.4, 0.4, 0.2], [0.1, 0.8, 0.1]]),
        "APAC": np.array([[0.3, 0.3, 0.4], [0.3, 0.4, 0.3]]),
    }
    s = largest_spread("region", per_value, (0, 2))
    assert (s.layer, s.expert, s.high_value, s.low_value, s.values) == (2, 1, "US", "EU", 3)
    assert s.difference == pytest.approx(0.5)
    assert (s.high_amount, s.low_amount) == (pytest.approx(0.8), pytest.approx(0.3))
    assert largest_spread("region", {"EU": per_value["EU"]}, (0, 2)) is None


def _vc(rows, prompts=1, tokens=1):
    return ValueCounts(np.array(rows, dtype=float), prompts, tokens)


def test_parity_difference_is_the_docstring_example():
    exact = {("gender", "female"): _vc([[50, 50, 0, 0]]), ("gender", "male"): _vc([[25, 25, 25, 25]])}
    policy = {("gender", "female"): _vc([[60, 40, 0, 0]]), ("gender", "male"): _vc([[25, 25, 25, 25]])}
    report = audit({"exact": exact, "delta_gap": policy}, (3,), 4, 2)
    p = report.parity["gender"]
    assert p.difference == pytest.approx(0.1)
    assert (p.layer, p.expert, p.high_value, p.low_value) == (3, 0, "female", "male")
    assert (p.high_amount, p.low_amount) == (pytest.approx(0.1), 0.0)
    assert report.disparity["exact"]["gender"].difference == pytest.approx(0.25)
    assert report.disparity["delta_gap"]["gender"].difference == pytest.approx(0.35)
    assert [(f.expert, f.value) for f in report.flags["exact"]] == [(0, "female"), (1, "female")]
    assert [(f.expert, f.share) for f in report.flags["delta_gap"]] == [(0, 0.6)]  # 0.4 is not above


def test_a_policy_that_moves_every_value_alike_has_zero_parity_difference():
    exact = {("age", "young"): _vc([[10, 30, 0, 0]]), ("age", "old"): _vc([[0, 10, 30, 0]])}
    alike = {("age", "young"): _vc([[10, 20, 10, 0]]), ("age", "old"): _vc([[0, 0, 40, 0]])}  # e1 -0.25, e2 +0.25
    assert audit({"exact": exact, "p": alike}, (0,), 4, 2).parity["age"].difference == pytest.approx(0.0)
    assert audit({"exact": exact, "p": exact}, (0,), 4, 2).parity["age"].difference == 0.0
    young_only = {("age", "young"): _vc([[10, 20, 10, 0]]), ("age", "old"): _vc([[0, 10, 30, 0]])}
    p = audit({"exact": exact, "p": young_only}, (0,), 4, 2).parity["age"]
    assert p.difference == pytest.approx(0.25) and p.expert in (1, 2)


def test_parity_leaves_out_values_without_activations_and_single_value_dimensions():
    exact = {
        ("region", "EU"): _vc([[10, 10]]),
        ("region", "US"): _vc([[0, 0]], prompts=0),
        ("job", "nurse"): _vc([[5, 5]]),
    }
    report = audit({"exact": exact, "p": exact}, (0,), 2, 1)
    assert report.parity == {"job": None, "region": None}  # region has one value with activations
    assert report.disparity["exact"] == {"job": None, "region": None}
    assert audit({"exact": exact}, (0,), 2, 1).policy is None


def test_audit_refuses_what_it_cannot_compare():
    exact = {("g", "a"): _vc([[1, 1]])}
    with pytest.raises(ValueError, match="exact"):
        audit({"p": exact}, (0,), 2, 1)
    with pytest.raises(ValueError, match="one policy"):
        audit({"exact": exact, "p": exact, "q": exact}, (0,), 2, 1)
    with pytest.raises(ValueError, match="expected"):
        audit({"exact": exact}, (0, 1), 2, 1)


def test_report_json_and_table_show_the_skew():
    exact = {
        ("gender", "female"): _vc([[9, 1, 5, 5], [5, 5, 5, 5]], prompts=2, tokens=10),
        ("gender", "male"): _vc([[5, 5, 5, 5], [5, 5, 5, 5]], prompts=2, tokens=10),
    }
    report = audit({"exact": exact, "sticky": exact}, (1, 3), 4, 2)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["share_ceiling"] == 0.5 and data["even_share"] == 0.25
    assert data["runs"]["exact"]["dimensions"]["gender"]["female"]["share"][0] == [0.45, 0.05, 0.25, 0.25]
    assert data["runs"]["exact"]["flags"] == [
        {"layer": 1, "expert": 0, "dimension": "gender", "value": "female", "share": 0.45, "activations": 20.0}
    ]
    assert data["parity"]["policy"] == "sticky" and data["parity"]["dimensions"]["gender"]["difference"] == 0.0
    table = format_audit(report, "m", "h:1", "l.jsonl", 4, 5)
    assert "45.0*" in table and "flagged under exact: 1" in table
    assert "demographic parity difference of sticky against exact" in table
    assert ["1", "female", "2", "10", "45.0*", "5.0", "25.0", "25.0"] in [line.split() for line in table.splitlines()]
    wide = audit({"exact": {("g", "a"): _vc([[1] * 40 + [0] * 23 + [60]])}}, (0,), 64, 4)
    table = format_audit(wide, "m", "h:1", "l.jsonl", 1, 1)
    assert "e63 60.0*" in table and "no share can exceed 25.0%" in table


# -- the labelled-prompts file ---------------------------------------------------------------


def _lines(*records) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records)


def test_labels_parse_with_line_numbers():
    text = _lines(
        {"text": "hello", "labels": {"gender": "female", "region": "EU"}}, "", {"text": "hi", "labels": {"age": "30"}}
    )
    prompts = parse_labels(text, "f.jsonl")
    assert [(p.text, p.labels, p.line) for p in prompts] == [
        ("hello", {"gender": "female", "region": "EU"}, 1),
        ("hi", {"age": "30"}, 3),
    ]


@pytest.mark.parametrize(
    "record, message",
    [
        ("{not json", "f.jsonl line 2: not JSON"),
        ({"text": "x"}, "line 2: labels must be a non-empty object"),
        ({"text": "x", "labels": {}}, "line 2: labels must be a non-empty object"),
        ({"text": "", "labels": {"a": "b"}}, "line 2: text must be a non-empty string"),
        ({"text": "x", "labels": {"a": "b"}, "domain": "d"}, "line 2: expected"),
        ({"text": "x", "labels": {"age": 30}}, "line 2: a label's value of 'age' must be a non-empty string, got 30"),
        ({"text": "x", "labels": {"a" * 65: "b"}}, "line 2: label dimension 'aaaaaaaaaaaaaaaaaaaa'... is 65"),
        ({"text": "x", "labels": {"a": "b\n"}}, "line 2: label value of 'a' 'b\\n' has characters that do not print"),
        ({"text": "x" * 16385, "labels": {"a": "b"}}, "line 2: text is 16385 characters"),
    ],
)
def test_bad_label_lines_are_refused_naming_the_line(record, message):
    with pytest.raises(LabelsError) as err:
        parse_labels(_lines({"text": "ok", "labels": {"a": "b"}}, record), "f.jsonl")
    assert message in str(err.value)


def test_label_bounds(monkeypatch):
    with pytest.raises(LabelsError, match="f.jsonl: no labelled prompts"):
        parse_labels("\n\n", "f.jsonl")
    many_dims = {"text": "x", "labels": {f"d{i}": "v" for i in range(17)}}
    with pytest.raises(LabelsError, match="line 1: dimension 'd16' is one more than the 16 allowed"):
        parse_labels(_lines(many_dims), "f.jsonl")
    values = [{"text": "x", "labels": {"job": f"j{i}"}} for i in range(65)]
    with pytest.raises(LabelsError, match="line 65: dimension 'job' has more than 64 values"):
        parse_labels(_lines(*values), "f.jsonl")
    monkeypatch.setattr(labels_module, "MAX_PROMPTS", 3)
    with pytest.raises(LabelsError, match="line 4: more than 3 prompts"):
        parse_labels(_lines(*values[:4]), "f.jsonl")


# -- the command's argument errors: exit 2 with one line, before connecting -------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--labels", "/nonexistent/l.jsonl"], "--labels /nonexistent/l.jsonl: no such file"),
        (["--labels", "{good}", "--threshold", "1.5"], "--threshold must be between 0 and 1"),
        (["--threshold", "0.3"], "--threshold belongs to the bias audit: pass --labels FILE"),
        (["--policy", "delta_gap"], "--policy belongs to the bias audit"),
        (["--labels", "{good}", "--prompts", "p.txt"], "--prompts is not used by the bias audit"),
        (["--labels", "{good}", "--policy", "exact"], "--policy: name a routing policy other than exact"),
        (["--labels", "{bad}"], "line 2: labels must be a non-empty object"),
    ],
)
def test_bias_audit_argument_errors_exit_2_with_one_line(capsys, tmp_path, argv, message):
    (tmp_path / "good.jsonl").write_text(_lines({"text": "x", "labels": {"a": "b"}}))
    (tmp_path / "bad.jsonl").write_text(_lines({"text": "x", "labels": {"a": "b"}}, {"text": "y", "labels": []}))
    argv = [a.format(good=tmp_path / "good.jsonl", bad=tmp_path / "bad.jsonl") for a in argv]
    assert main(["probe", *argv, "--target", f"127.0.0.1:{_closed_port()}", "--timeout", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("expertmesh probe: error: ") and message in err[0], err


def test_bias_audit_unreachable_target_exits_2(capsys, tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text(_lines({"text": "x", "labels": {"a": "b"}}))
    target = f"127.0.0.1:{_closed_port()}"
    assert main(["probe", "--labels", str(path), "--target", target, "--timeout", "5"]) == 2
    assert f"cannot list models from {target}: UNAVAILABLE" in capsys.readouterr().err
