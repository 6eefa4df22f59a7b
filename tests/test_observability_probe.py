"""`expertmesh probe`: the sparsity computations on hand-checkable load counts,
its error paths, and (slow) the probe and the heatmap against a real platform."""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import numpy as np
import pytest
import yaml

from expertmesh.cli.main import main
from expertmesh.cli.probe import format_table
from expertmesh.observability import remote
from expertmesh.observability.sparsity import (
    ModelShape,
    active_spread,
    analyse,
    entropy_bits,
    group_shares,
    histogram_percentile,
)
from expertmesh.v1 import inference_pb2 as pb


def _model(layers=(0, 1), experts=4, top_k=2, dense=1000, per_expert=100):
    total = dense + per_expert * experts * len(layers)
    return ModelShape("m", tuple(layers), experts, top_k, total, dense, per_expert)


def _two_groups(layers=(0, 1), experts=4):
    half = experts // 2
    return {
        "g0": [(layer, e) for layer in layers for e in range(half)],
        "g1": [(layer, e) for layer in layers for e in range(half, experts)],
    }


# -- sparsity: pure computations ------------------------------------------------------


def test_uniform_load_is_perfectly_balanced():
    model = _model()
    report = analyse(np.full((2, 4), 50.0), model, _two_groups())
    for layer in report.layers:
        assert layer.tokens == 100  # 200 pairs / top-2
        assert layer.pairs_per_token == 2
        assert layer.utilisation == (1.0, 1.0, 1.0, 1.0)
        assert layer.entropy_bits == pytest.approx(2.0) == pytest.approx(layer.max_entropy_bits)
        assert layer.entropy_ratio == pytest.approx(1.0)
        assert layer.load_std == 0 and layer.load_cv == 0
        assert layer.balancedness == 1.0
        assert layer.never_used == () and layer.rarely_used == ()
        assert layer.group_load == {"g0": 100.0, "g1": 100.0}
    assert report.tokens == 100
    assert report.active_parameters_per_token == 1000 + 2 * 2 * 100
    assert report.active_share == pytest.approx(1400 / 1800)
    assert report.mean_balancedness == 1.0


def test_one_hot_load_has_zero_entropy_and_half_balance():
    report = analyse(np.array([[0.0, 0.0, 0.0, 100.0]]), _model(layers=(3,)), _two_groups(layers=(3,)))
    (layer,) = report.layers
    assert layer.layer == 3
    assert layer.entropy_bits == 0.0
    assert layer.tokens == 50
    assert layer.utilisation == (0.0, 0.0, 0.0, 4.0)  # 100 / (50 tokens * 2 / 4 experts)
    assert layer.never_used == (0, 1, 2)
    assert layer.rarely_used == ()
    assert layer.group_load == {"g0": 0.0, "g1": 100.0}
    assert layer.balancedness == 0.5  # mean 50 / max 100: one of two groups does everything
    assert layer.load_std == pytest.approx(math.sqrt(3 * 25**2 + 75**2) / 2)


def test_entropy_std_and_cv_by_hand():
    assert entropy_bits(np.array([1.0, 1.0, 2.0])) == pytest.approx(1.5)
    assert entropy_bits(np.zeros(4)) == 0.0
    report = analyse(np.array([[0.0, 10.0]]), _model(layers=(0,), experts=2, top_k=1))
    assert report.layers[0].load_std == 5.0
    assert report.layers[0].load_cv == 1.0
    assert report.layers[0].balancedness == 1.0  # no groups given: one group holds everything


def test_rare_threshold_is_a_parameter():
    load = np.array([[1.0, 99.0, 100.0, 100.0]])  # 300 tokens, fair share 75
    model = _model(layers=(0,), top_k=1)
    assert analyse(load, model).layers[0].rarely_used == (0,)  # 1/75 < 0.1
    assert analyse(load, model, rare_threshold=0.01).layers[0].rarely_used == ()
    assert analyse(load, model, rare_threshold=0.9).layers[0].rarely_used == (0,)
    assert analyse(load, model, rare_threshold=1.5).layers[0].rarely_used == (0, 1, 2, 3)


def test_replicated_expert_splits_its_load_between_groups():
    groups = {"a": [(0, 0), (0, 1)], "b": [(0, 2), (0, 3)], "hot": [(0, 0)]}
    report = analyse(np.array([[40.0, 10.0, 10.0, 20.0]]), _model(layers=(0,)), groups)
    layer = report.layers[0]
    assert layer.group_load == {"a": 30.0, "b": 30.0, "hot": 20.0}
    assert layer.balancedness == pytest.approx((80 / 3) / 30)


def test_a_group_without_experts_in_a_layer_does_not_count_there():
    groups = {"a": [(layer, e) for layer in (0, 1) for e in range(4)], "hot": [(1, 0)]}
    report = analyse(np.array([[10.0] * 4, [20.0, 10.0, 5.0, 5.0]]), _model(), groups)
    assert report.layers[0].group_load == {"a": 40.0}
    assert report.layers[0].balancedness == 1.0
    assert report.layers[1].group_load == {"a": 30.0, "hot": 10.0}
    assert report.layers[1].balancedness == pytest.approx(20 / 30)


def test_group_shares_are_one_per_hosted_expert():
    names, shares = group_shares({"x": [(5, 0), (5, 1)], "y": [(5, 1)], "z": [(9, 0)]}, (5,), 3)
    assert names == ("x", "y", "z")
    assert shares.shape == (3, 1, 3)
    assert shares[:, 0, :].tolist() == [[1.0, 0.5, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]


def test_known_token_counts_change_pairs_per_token_and_active_parameters():
    model = _model(layers=(0,), top_k=2)
    report = analyse(np.array([[15.0, 15.0, 15.0, 15.0]]), model, tokens=[40])  # some choices dropped
    assert report.layers[0].pairs_per_token == 1.5
    assert report.active_parameters_per_token == 1000 + 1.5 * 100
    assert report.layers[0].utilisation == (0.75, 0.75, 0.75, 0.75)


@pytest.mark.parametrize(
    "load, message",
    [
        (np.ones((3, 4)), r"expected \(2, 4\)"),
        (np.zeros((2, 4)), "no routed tokens"),
        (-np.ones((2, 4)), "non-negative"),
    ],
)
def test_bad_load_is_refused(load, message):
    with pytest.raises(ValueError, match=message):
        analyse(load, _model())


def test_report_dict_is_json_and_table_shows_every_layer():
    load = np.array([[30.0, 10.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0]])
    report = analyse(load, _model(), _two_groups(), placement="assumed contiguous")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["overall"]["never_used"] == 2
    assert data["overall"]["active_share"] == pytest.approx(1400 / 1800)
    assert data["layers"][0]["balancedness"] == pytest.approx(20 / 40)
    assert data["layers"][0]["load"] == [30.0, 10.0, 0.0, 0.0]
    table = format_table(report, "host:1", "a test")
    assert "1,400 (77.8%)" in table
    assert "assumed contiguous" in table
    assert [line.split()[0] for line in table.splitlines() if line.strip().startswith(("0 ", "1 ", "all "))][:3] == [
        "0",
        "1",
        "all",
    ]


def test_wide_layers_are_summarised_in_the_table():
    model = _model(layers=(0,), experts=64, top_k=4)
    load = np.arange(64, dtype=float)[None, :]
    table = format_table(analyse(load, model), "h:1", "t")
    assert "lowest e0 0.00, e1 " in table and "highest e63 " in table


@pytest.mark.parametrize("seed", range(5))
def test_histogram_percentiles_are_nearest_rank(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, size=12) * (rng.random(12) < 0.6)
    counts[rng.integers(0, 12)] += 1  # at least one token
    values = np.repeat(np.arange(12), counts)
    for q in (5, 50, 95, 100):
        assert histogram_percentile(counts, q) == int(np.percentile(values, q, method="inverted_cdf"))
    assert histogram_percentile(np.zeros(4), 50) is None
    assert histogram_percentile([0, 2, 2], 50) == 1 and histogram_percentile([0, 2, 2], 51) == 2


def test_active_parameter_spread_overall_and_by_query_length():
    model = _model()  # 2 layers, top-2: 4 experts a token under exact routing; dense 1000, 100 per expert
    per_token = np.zeros((3, 2 * 3 + 1))
    per_token[0, 4] = 90  # short queries: 90 tokens at exactly L * k experts
    per_token[0, 2] = 10  # ... and 10 at 2 (delta_gap's top-1)
    per_token[2, 6] = 50  # long queries: every token one more per layer (dynamic_k)
    overall, short, middle, long = active_spread(per_token, model, ["1-16", "17-64", "65+"])
    assert (overall.label, overall.tokens, overall.p5, overall.p50, overall.p95) == ("all", 150, 1200, 1400, 1600)
    assert (short.label, short.tokens, short.p5, short.p50, short.p95) == ("1-16", 100, 1200, 1400, 1400)
    assert (middle.tokens, middle.p50) == (0, None)
    assert (long.p5, long.p95) == (1600, 1600)
    report = analyse(np.full((2, 4), 50.0), model)
    report = dataclasses.replace(report, spread=(overall, short, middle, long))
    data = json.loads(json.dumps(report.to_dict()))["active_parameters_per_token_spread"]
    assert data["overall"]["p50"] == 1400 and [b["query_length"] for b in data["by_query_length"]] == [
        "1-16",
        "17-64",
        "65+",
    ]
    table = format_table(report, "h:1", "t")
    rows = [line.split() for line in table.splitlines()]
    assert "by query length" in table and ["1-16", "100", "1,200", "1,400", "1,400"] in rows
    assert "17-64" not in table  # buckets without tokens are left out of the table
    with pytest.raises(ValueError, match="buckets"):
        active_spread(per_token, model, ["one"])


# -- the I/O helpers that need no server ----------------------------------------------


def _info(groups=("g0", "g1", "g2")):
    return pb.ModelInfo(
        name="m", architecture="mixtral", num_layers=4, moe_layers=[1, 3], num_experts=8, top_k=2, groups=list(groups)
    )


def test_default_groups_are_the_contiguous_split_and_say_so():
    groups, how = remote.expert_groups(_info(), None)
    assert sorted(e for layer, e in groups["g0"] if layer == 1) == [0, 1, 2]
    assert sorted(e for layer, e in groups["g1"] if layer == 3) == [3, 4]
    assert sorted(e for layer, e in groups["g2"] if layer == 3) == [5, 6, 7]
    assert how.startswith("assumed contiguous split over 3 groups (g0, g1, g2)")
    _, how = remote.expert_groups(_info(("a", "hot")), None)
    assert "may use another placement" in how


def test_groups_from_a_placement_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"groups": {"a": {"*": ["0-7"]}, "hot": {3: [0]}}}))
    groups, how = remote.expert_groups(_info(), path)
    assert set(groups) == {"a", "hot"}
    assert groups["hot"] == ((3, 0),)
    assert how == f"from {path}"


def test_load_stats_difference_and_window_roll():
    import torch

    from expertmesh.contracts.load_window import LoadWindow

    window = LoadWindow((0, 2), 4, 2, max_context=64, position_bins=4)
    before = remote.LoadStats.from_json(json.dumps(window.snapshot().to_stats_dict()))
    window.record(2, torch.tensor([[0, 1], [1, 3]]), torch.tensor([0, 40]))
    after = remote.LoadStats.from_json(json.dumps(window.snapshot().to_stats_dict()))
    delta = after - before
    assert delta.moe_layers == (0, 2)
    assert delta.load.tolist() == [[0, 0, 0, 0], [1, 2, 0, 1]]
    assert delta.position_load.shape == (2, 4, 4)
    assert delta.position_load[1, 0].tolist() == [1, 1, 0, 0] and delta.position_load[1, 2].tolist() == [0, 1, 0, 1]
    with pytest.raises(Exception, match="aged out"):
        before - after


# -- CLI error paths: exit 2 with one line ----------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_probe_unreachable_target_exits_2_with_one_line(capsys):
    target = f"127.0.0.1:{_closed_port()}"
    line = _one_error_line(capsys, ["probe", "--target", target, "--timeout", "5"])
    assert line.startswith(f"expertmesh probe: error: cannot list models from {target}: UNAVAILABLE")


def test_heatmap_unreachable_target_exits_2_with_one_line(capsys, tmp_path):
    target = f"127.0.0.1:{_closed_port()}"
    line = _one_error_line(capsys, ["heatmap", "--target", target, "--out", str(tmp_path / "h.png"), "--timeout", "5"])
    assert line.startswith("expertmesh heatmap: error: cannot list models from")
    assert not (tmp_path / "h.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["probe", "--requests", "-1"], "--requests must be 0 or more"),
        (["probe", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["probe", "--rare-threshold", "2"], "--rare-threshold must be between 0 and 1"),
        (["probe", "--prompts", "/nonexistent/prompts.txt"], "prompts file /nonexistent/prompts.txt does not exist"),
        (["heatmap", "--out", "h.jpg"], "name the file *.png"),
        (["heatmap", "--out", "/nonexistent/dir/h.png"], "folder /nonexistent/dir does not exist"),
    ],
)
def test_bad_arguments_exit_2_before_connecting(capsys, argv, message):
    assert message in _one_error_line(capsys, [*argv, "--target", f"127.0.0.1:{_closed_port()}"])


# -- end to end: a real platform on a tiny checkpoint ----------------------------------------


@pytest.fixture(scope="module")
def platform(tmp_path_factory, ray_session):
    from expertmesh.config.settings import DataPlaneConfig, ServingConfig
    from expertmesh.models.tiny import make_tiny_checkpoint
    from expertmesh.platform.data_plane import DataPlane
    from expertmesh.platform.router_apis import serve_plane

    model = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("probe-ckpt"),
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=128,
    )
    plane = DataPlane.start(DataPlaneConfig(model=model, groups=2))
    server = serve_plane(plane, ServingConfig(port=0))
    yield f"127.0.0.1:{server.port}"
    server.drain_and_stop()
    plane.close()


@pytest.mark.slow
def test_probe_and_heatmap_against_a_running_platform(platform, capsys, tmp_path):
    assert main(["probe", "--target", platform, "--requests", "6", "--max-tokens", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model, overall, traffic = report["model"], report["overall"], report["traffic"]
    L, k = len(model["moe_layers"]), model["top_k"]
    assert traffic["requests"] == 6 and traffic["completion_tokens"] == 6 * 24
    sent = traffic["prompt_tokens"] + traffic["completion_tokens"]
    assert len(report["layers"]) == L >= 1
    for layer in report["layers"]:
        assert layer["tokens"] * k == pytest.approx(sum(layer["load"]))
        # every prompt token and every generated token but the last of each request went through the model
        assert sent - 6 <= layer["tokens"] <= sent
        assert layer["pairs_per_token"] == pytest.approx(k)
        assert np.mean(layer["utilisation"]) == pytest.approx(1.0)
        assert 0 <= layer["entropy_bits"] <= layer["max_entropy_bits"] == pytest.approx(math.log2(model["num_experts"]))
        assert set(layer["group_load"]) == {"g0", "g1"}
        assert 0.5 <= layer["balancedness"] <= 1.0
    expected = (model["dense_parameters"] + k * model["parameters_per_expert"] * L) / model["total_parameters"]
    assert 0 < overall["active_share"] < 1
    assert overall["active_share"] == pytest.approx(expected)
    assert report["placement"].startswith("assumed contiguous split over 2 groups")
    # every routed token of the (finished) probe requests, each served by L x k experts under exact routing
    spread = report["active_parameters_per_token_spread"]
    assert spread["overall"]["tokens"] == pytest.approx(report["layers"][0]["tokens"])
    active = model["dense_parameters"] + L * k * model["parameters_per_expert"]
    assert spread["overall"]["p5"] == spread["overall"]["p50"] == spread["overall"]["p95"] == active
    assert sum(b["tokens"] for b in spread["by_query_length"]) == spread["overall"]["tokens"]

    # --requests 0 samples the router's whole window: at least the probe's own tokens
    assert main(["probe", "--target", platform, "--requests", "0"]) == 0
    table = capsys.readouterr().out
    assert "over the router's whole load window" in table and "\n  all " in table
    assert "active parameters per token of finished sequences, by query length" in table

    for positions in ("relative", "absolute"):  # relative: the default
        out = tmp_path / f"heat-{positions}.png"
        argv = ["heatmap", "--target", platform, "--out", str(out)]
        assert main(argv if positions == "relative" else [*argv, "--positions", positions]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"by {positions} position" in capsys.readouterr().err


@pytest.mark.slow
def test_bias_audit_against_a_running_platform(platform, capsys, tmp_path):
    """`probe --labels`: one value's prompts all the same text, so (one greedy token each: the prompt's last
    position) its tokens take the same two experts in every layer, 50 % each: deliberately skewed, flagged."""
    skewed = "The history of the Roman Empire begins with"
    mixed = [p for p in remote.PROMPTS if p != skewed][:5]
    lines = [{"text": skewed, "labels": {"topic": "history", "region": "EU" if i % 2 else "US"}} for i in range(4)]
    lines += [{"text": p, "labels": {"topic": "mixed", "region": "EU" if i % 2 else "US"}} for i, p in enumerate(mixed)]
    path = tmp_path / "labels.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    with remote.Router(platform) as router:
        (alone,) = router.trace([skewed], 1)  # the skewed prompt's one traced token, by itself
    (token,) = alone
    chosen = {layer: sorted(experts) for layer, experts in token}

    argv = ["probe", "--target", platform, "--labels", str(path), "--max-tokens", "1", "--concurrency", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    L, E, k = len(report["moe_layers"]), report["num_experts"], report["top_k"]
    assert report["prompts"] == 9 and report["threshold"] == 0.4 and report["share_ceiling"] == 1 / k == 0.5
    exact = report["runs"]["exact"]
    history = exact["dimensions"]["topic"]["history"]
    assert (history["prompts"], history["tokens"]) == (4, 4)
    assert history["activations"] == [4 * k] * L  # every slot of every traced token served
    flagged = {(f["layer"], f["expert"]) for f in exact["flags"] if f["value"] == "history"}
    assert flagged == {(layer, e) for layer in report["moe_layers"] for e in chosen[layer]}
    assert all(f["share"] == 0.5 for f in exact["flags"] if f["value"] == "history")
    for dimension in exact["dimensions"].values():
        for value in dimension.values():
            assert len(value["share"]) == L and all(sum(row) == pytest.approx(1.0) for row in value["share"])
            assert all(len(row) == E for row in value["share"])
    assert set(exact["disparity"]) == {"region", "topic"} and report["parity"] is None

    # a policy beside exact: its own run, flags and the parity difference, as JSON and as the table
    # a policy beside exact (noisy_topk: Gumbel noise on the gate, seeded per request, so it moves some choices
    # and reproducibly): its own run, flags and the parity difference, as JSON and as the table
    assert main([*argv, "--max-tokens", "3", "--policy", "noisy_topk", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["runs"]) == ["exact", "noisy_topk"]
    moved = False
    for dimension, values in report["runs"]["exact"]["dimensions"].items():
        for value, counts in values.items():
            noisy = report["runs"]["noisy_topk"]["dimensions"][dimension][value]
            assert counts["activations"] == noisy["activations"] == [counts["tokens"] * k] * L  # k kept
            moved |= counts["share"] != noisy["share"]
    assert moved
    parity = report["parity"]
    assert parity["policy"] == "noisy_topk" and set(parity["dimensions"]) == {"region", "topic"}
    for spread in parity["dimensions"].values():
        assert 0 <= spread["difference"] <= 2 and spread["values"] == 2
    assert max(spread["difference"] for spread in parity["dimensions"].values()) > 0
    assert main([*argv, "--policy", "noisy_topk", "--threshold", "0.3"]) == 0
    table = capsys.readouterr().out
    assert "topic, under exact" in table and "topic, under noisy_topk" in table
    assert "flagged under exact:" in table and "above 30.0%" in table
    assert "demographic parity difference of noisy_topk against exact" in table

    assert main([*argv, "--policy", "no_such_policy"]) == 2
    err = capsys.readouterr().err
    assert "routing policy 'no_such_policy'" in err and "INVALID_ARGUMENT" in err and f"{path} line 1" in err
