"""Cost per million output tokens (`--price-per-hour`) in `bench serve` and `bench scale`: the arithmetic, the
rows and lines that print it, and the refused prices. Pure: made-up runs and a simulated day; never how fast
anything was."""

from __future__ import annotations

import math

import pytest

from expertmesh.bench.cost import check_price, per_million_tokens
from expertmesh.bench.report import BenchError
from expertmesh.bench.scale.model import day_tokens, diurnal
from expertmesh.bench.scale.suite import cost_lines, day_cost
from expertmesh.bench.serve.stats import sweep_point
from expertmesh.bench.serve.tables import sweep_table, table
from expertmesh.cli.main import main
from test_bench_vllm import _result, _row


def test_per_million_tokens_is_the_hours_price_over_the_hours_tokens():
    assert per_million_tokens(2.0, 100.0) == pytest.approx(2.0 / 360_000 * 1e6)  # $5.56
    assert per_million_tokens(0.0, 100.0) == 0.0
    assert per_million_tokens(2.0, 0.0) is None  # nothing produced: no rate to price
    assert check_price(None) is None and check_price(1.5) == 1.5
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(BenchError, match="--price-per-hour must be a finite amount"):
            check_price(bad)


def _priced(runs: list[dict], price: float) -> dict:
    result = _result(
        [{**r, "usd_per_million_output_tokens": per_million_tokens(price, r["tokens_per_s"])} for r in runs], None
    )
    result["setup"]["price_per_hour"] = price
    return result


def test_bench_serve_prints_each_runs_cost_and_the_sweep_both_sides():
    runs = [_row("platform: 2 streaming clients", None, 50.0), _row("vLLM (2 streaming clients)", "vllm", 100.0)]
    result = _priced(runs, 3.6)
    line = table(result).splitlines()[-1]
    assert line == (
        "cost per million output tokens at $3.60/hour: platform: 2 streaming clients $20.00; "
        "vLLM (2 streaming clients) $10.00"
    )
    point = sweep_point(2, result)
    assert point["usd_per_million_output_tokens"] == {"platform": pytest.approx(20.0), "vllm": pytest.approx(10.0)}
    head, _, row = sweep_table({"model": result["model"], "points": [point]}).splitlines()[1:4]
    assert head.rstrip().endswith("platform $/M tok vLLM $/M tok") and row.split()[-2:] == ["20.00", "10.00"]
    unpriced = _result(runs, None)
    assert "cost per million" not in table(unpriced)
    assert "$/M tok" not in sweep_table({"model": unpriced["model"], "points": [sweep_point(2, unpriced)]})


def test_a_bad_price_is_refused_before_anything_runs(capsys):
    assert main(["bench", "serve", "--price-per-hour", "-2"]) == 2
    assert "--price-per-hour must be a finite amount of US dollars >= 0, got -2.0" in capsys.readouterr().err
    assert main(["bench", "scale", "--quick", "--price-per-hour", "nan"]) == 2
    assert "--price-per-hour must be a finite amount" in capsys.readouterr().err


def test_a_simulated_days_tokens_are_the_diurnal_integral_and_its_cost_per_million():
    steps = 24 * 600
    numeric = sum(diurnal((i + 0.5) * 24 / steps) for i in range(steps)) * 24 / steps  # peak-hours in a day
    assert day_tokens(2, 1000.0, 24.0) == pytest.approx(2 * 1000 * 3600 * numeric, rel=1e-6)
    assert day_tokens(2, 1000.0, 24.0) == pytest.approx(2 * 1000 * 3600 * 24 * 0.55)  # cos integrates to 0
    result = {"case": {"gpus": 8, "routers": 2, "hours": 24.0}}
    cost = day_cost(result, 2.0)
    assert cost["usd"] == 8 * 2.0 * 24 and cost["tokens"] == pytest.approx(2 * 1000 * 3600 * 24 * 0.55)
    assert cost["usd_per_million_tokens"] == pytest.approx(cost["usd"] / cost["tokens"] * 1e6)
    line = cost_lines([{**result, "cost": cost}], 2.0)
    assert line.startswith("cost at $2.00 per GPU-hour over the simulated day: 8 GPUs 2 routers $")
