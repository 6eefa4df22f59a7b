"""The alerting rules (helm/expertmesh/files/expertmesh-alerts.yaml) through Prometheus's own promtool: `check
rules`, and `test rules` on synthetic series, each alert firing on the trouble it names and quiet on a healthy
series beside it. promtool comes with Debian's prometheus package (`make test` installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from expertmesh.infra.telemetry import ORCHESTRATOR_PROMETHEUS_METRICS, PROMETHEUS_METRICS

RULES = Path(__file__).resolve().parents[1] / "helm" / "expertmesh" / "files" / "expertmesh-alerts.yaml"
#: counted only once it happens, so absent from a healthy router's /metrics (router.dispatch's counter)
DEGRADED = "expertmesh_tokens_degraded_total"


@pytest.fixture(scope="module")
def promtool():
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed: run through `make test`, which installs Debian's prometheus package")
    return binary


def test_the_rules_check(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


def test_every_metric_the_rules_read_is_one_the_platform_exports():
    """A renamed metric must break this test, not silently silence an alert."""
    exprs = " ".join(rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"])
    used = set(re.findall(r"\bexpertmesh_[a-z_]+", exprs))
    exported = PROMETHEUS_METRICS | ORCHESTRATOR_PROMETHEUS_METRICS | {DEGRADED}
    assert used <= exported, used - exported
    assert "expertmesh_group_circuit_open" in used and DEGRADED in used and "expertmesh_anomaly_active" in used


def _counter(per_minute: list[float]) -> str:
    """A counter's samples, one a minute, rising by ``per_minute[i]`` in minute i."""
    total, out = 0.0, []
    for step in [0.0, *per_minute]:
        total += step
        out.append(f"{total:g}")
    return " ".join(out)


DAY = 24 * 60


def _tests() -> list[dict]:
    """promtool test cases: series at 1-minute steps, and the alerts expected at given times."""
    even, skewed = [10.0] * 60, [100.0] * 60
    wobble = [10.0 + (i % 3) for i in range(DAY + 60)]  # a share that varies a little: a baseline with spread
    series = [
        # layer 0: expert 0 takes 10x the others (load CV 1.2); layer 1 even
        *(
            {
                "series": f'expertmesh_expert_tokens_total{{layer="0",expert="{e}"}}',
                "values": _counter(skewed if e == 0 else even),
            }
            for e in range(4)
        ),
        *(
            {"series": f'expertmesh_expert_tokens_total{{layer="1",expert="{e}"}}', "values": _counter(even)}
            for e in range(4)
        ),
        {"series": 'expertmesh_layer_balancedness{layer="0"}', "values": "0.3x60"},
        {"series": 'expertmesh_layer_balancedness{layer="1"}', "values": "0.9x60"},
        {"series": 'expertmesh_expert_kl{layer="1",expert="2",group="g0"}', "values": "0.2x60"},
        {"series": 'expertmesh_expert_kl{layer="1",expert="3",group="g0"}', "values": "0.01x60"},
        {"series": 'expertmesh_expert_health{layer="1",expert="2"}', "values": "1 1 0x58"},
        {"series": 'expertmesh_expert_health{layer="1",expert="3"}', "values": "1x60"},
        {"series": DEGRADED + '{layer="1",fallback="next_best"}', "values": "0+5x60"},
        {"series": 'expertmesh_group_circuit_open{group="g1"}', "values": "1x60"},
        {"series": 'expertmesh_group_circuit_open{group="g0"}', "values": "0x60"},
        {"series": 'expertmesh_router_weights_changed{instance="r1"}', "values": "0 0 1x58"},
        {"series": 'expertmesh_router_weights_changed{instance="r0"}', "values": "0x60"},
        # anomalies: r1's layer 0 from 2m on; its layer 1 flaps minute by minute (never 2 minutes on); r0's KV
        *(
            {
                "series": f'expertmesh_anomaly_active{{signal="gate_confidence",layer="{layer}",instance="r1"}}',
                "values": v,
            }
            for layer, v in (("0", "0 0 1x58"), ("1", " ".join("1" if i % 2 else "0" for i in range(61))))
        ),
        # load share: r0's layer 2 from 10m on, its layer 3 on for 3 minutes only (under the rule's 5)
        {"series": 'expertmesh_anomaly_active{signal="load_share",layer="2",instance="r0"}', "values": "0x10 1x50"},
        {"series": 'expertmesh_anomaly_active{signal="load_share",layer="3",instance="r0"}', "values": "0x10 1x3 0x47"},
        {"series": 'expertmesh_anomaly_active{signal="kv_fragmentation",instance="r0"}', "values": "0x5 1x55"},
        {"series": 'expertmesh_anomaly_active{signal="kv_fragmentation",instance="r1"}', "values": "0x60"},
        # TTFT: every first token between 1 and 10 s (p99 ~9.9 s); ITL: every gap between 0.5 and 5 s
        {"series": 'expertmesh_time_to_first_token_seconds_bucket{le="1"}', "values": "0x60"},
        {"series": 'expertmesh_time_to_first_token_seconds_bucket{le="10"}', "values": "0+10x60"},
        {"series": 'expertmesh_time_to_first_token_seconds_bucket{le="+Inf"}', "values": "0+10x60"},
        {"series": 'expertmesh_inter_token_latency_seconds_bucket{le="0.5"}', "values": "0x60"},
        {"series": 'expertmesh_inter_token_latency_seconds_bucket{le="5"}', "values": "0+10x60"},
        {"series": 'expertmesh_inter_token_latency_seconds_bucket{le="+Inf"}', "values": "0+10x60"},
    ]
    day = [
        # layer 2: four experts evenly for a day, then expert 0 takes everything (entropy 2 bits -> 0)
        *(
            {
                "series": f'expertmesh_expert_tokens_total{{layer="2",expert="{e}"}}',
                "values": _counter([10.0] * DAY + ([40.0] * 60 if e == 0 else [0.0] * 60)),
            }
            for e in range(4)
        ),
        # layer 3: expert 0's share wobbles near 0.5 for a day, then jumps to 0.75 (entropy 1 -> 0.81 bits: no collapse)
        {
            "series": 'expertmesh_expert_tokens_total{layer="3",expert="0"}',
            "values": _counter(wobble[:DAY] + [30.0] * 60),
        },
        {
            "series": 'expertmesh_expert_tokens_total{layer="3",expert="1"}',
            "values": _counter([10.0] * DAY + [10.0] * 60),
        },
    ]

    def alerts(name: str, at: str, *labelled: dict) -> dict:
        return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": {**labels}} for labels in labelled]}

    warning = {"severity": "warning"}
    return [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                alerts("ExpertmeshLoadImbalance", "8m"),  # not for 10 minutes yet
                alerts("ExpertmeshLoadImbalance", "30m", {**warning, "layer": "0"}),
                alerts("ExpertmeshLowBalancedness", "10m"),
                alerts("ExpertmeshLowBalancedness", "30m", {**warning, "layer": "0"}),
                alerts("ExpertmeshExpertKLSuspect", "30m", {**warning, "layer": "1", "expert": "2", "group": "g0"}),
                alerts("ExpertmeshExpertQuarantined", "1m"),
                alerts("ExpertmeshExpertQuarantined", "3m", {"severity": "critical", "layer": "1", "expert": "2"}),
                alerts("ExpertmeshDegradedTokens", "30m", warning),
                alerts("ExpertmeshCircuitOpen", "30m", {**warning, "group": "g1"}),
                alerts("ExpertmeshRouterWeightsChanged", "2m"),  # changed at 2m: not for a minute yet
                alerts("ExpertmeshRouterWeightsChanged", "30m", {"severity": "critical", "instance": "r1"}),
                alerts("ExpertmeshGateConfidenceAnomaly", "3m"),  # on at 2m: not for 2 minutes yet
                alerts("ExpertmeshGateConfidenceAnomaly", "30m", {**warning, "instance": "r1", "layer": "0"}),
                alerts("ExpertmeshLoadShareAnomaly", "14m"),  # on at 10m: not for 5 minutes yet
                alerts("ExpertmeshLoadShareAnomaly", "30m", {**warning, "instance": "r0", "layer": "2"}),
                alerts("ExpertmeshKVFragmentationAnomaly", "10m"),  # on at 5m: not for 10 minutes yet
                alerts("ExpertmeshKVFragmentationAnomaly", "30m", {**warning, "instance": "r0"}),
                alerts("ExpertmeshTimeToFirstTokenHigh", "30m", warning),
                alerts("ExpertmeshInterTokenLatencyHigh", "30m", warning),
                alerts("ExpertmeshRoutingEntropyCollapse", "30m"),  # even layers: no collapse
            ],
        },
        {
            "interval": "1m",
            "input_series": day,
            "alert_rule_test": [
                alerts("ExpertmeshRoutingEntropyCollapse", f"{DAY - 10}m"),
                alerts("ExpertmeshRoutingEntropyCollapse", f"{DAY + 40}m", {**warning, "layer": "2"}),
                alerts("ExpertmeshExpertLoadAnomaly", f"{DAY - 10}m"),
                # layer 3's jump, and layer 2's collapse: every one of its experts left its baseline too
                alerts(
                    "ExpertmeshExpertLoadAnomaly",
                    f"{DAY + 40}m",
                    *({**warning, "layer": "2", "expert": str(e)} for e in range(4)),
                    {**warning, "layer": "3", "expert": "0"},
                    {**warning, "layer": "3", "expert": "1"},
                ),
            ],
        },
    ]


def test_each_alert_fires_on_its_trouble_and_not_beside_it(promtool, tmp_path):
    # the expressions under test, without their annotations (promtool would compare their rendered wording;
    # `check rules` above checks that their templates parse)
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": _tests()}, sort_keys=False)
    )
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
