"""`expertmesh bench serve --baseline vllm`: vLLM's server as the speed baseline in the same run.

The report's shape is checked with made-up results (pure); the run itself starts vLLM's real CPU build from its
own venv (``make vllm-venv``, or ``EXPERTMESH_VLLM_VENV``) on a tiny checkpoint, behind the ``vllm`` marker that
``make test`` leaves out (its install is ~1 GB and vLLM compiles the model at start). Never how fast anything was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from expertmesh.bench.serve.stats import sweep_point
from expertmesh.bench.serve.tables import sweep_table, table
from expertmesh.cli.main import main
from expertmesh.models.tiny import make_tiny_checkpoint


def _row(name: str, baseline: str | None, tokens_per_s: float, concurrency: int = 2) -> dict:
    row = {
        "name": name,
        "requests": 2,
        "concurrency": concurrency,
        "tokens": 8,
        "seconds": 8 / tokens_per_s,
        "tokens_per_s": tokens_per_s,
        "itl_ms": {"p50": 10.0, "p99": 20.0},
        "ttft_ms": {"p50": 100.0 + tokens_per_s, "p99": 200.0},
    }
    return row if baseline is None else {**row, "baseline": baseline}


def _result(runs: list[dict], agreement: dict | None) -> dict:
    return {
        "model": {"model_type": "mixtral", "path": "/m/tiny", "moe_layers": 2, "num_experts": 4, "hidden_size": 32},
        "setup": {
            "dtype": "float32",
            "max_new_tokens": 4,
            "prompt_lengths": [8, 16],
            "prompt_tokens": 16,
            "requests_per_client": 1,
            "threads": 2,
            "machine": {"cpus": 2},
            "repeats": 1,
        },
        "runs": runs,
        "platform_vs": {r["name"]: runs[0]["tokens_per_s"] / r["tokens_per_s"] for r in runs[1:]},
        "agreement": agreement,
    }


def test_a_sweep_point_and_its_row_carry_vllms_figures_beside_generates():
    runs = [
        _row("platform: 2 streaming clients", None, 50.0),
        _row("transformers generate, one at a time", "generate", 20.0, 1),
        _row("transformers generate, batched x2", "generate", 40.0),
        _row("vLLM (2 streaming clients)", "vllm", 100.0),
    ]
    point = sweep_point(2, _result(runs, {"requests": 2, "differ": [], "passed": True}))
    assert point["ratio_to_batched"] == pytest.approx(50 / 40) and point["ratio_to_vllm"] == pytest.approx(0.5)
    assert point["ttft_p50_ms"] == {"platform": 150.0, "vllm": 200.0} and point["same_answers"] is True
    text = sweep_table({"model": _result(runs, None)["model"], "points": [point]})
    head, _, row = text.splitlines()[1:4]
    assert "vLLM tok/s" in head and "ratio to vLLM" in head and "vLLM TTFT p50 ms" in head
    assert row.split()[-4:] == ["100.0", "0.50", "150", "200"] and "PASS" in row.split()


def test_a_sweep_over_shapes_shows_each_points_lengths_and_both_sides_itl():
    points = []
    for prompt, new, vllm in ((480, 96, 100.0), (64, 256, 80.0)):
        runs = [_row("platform: 2 streaming clients", None, 50.0), _row("vLLM (2 streaming clients)", "vllm", vllm)]
        result = _result(runs, None)
        result["setup"].update(prompt_tokens=prompt, max_new_tokens=new)
        points.append(sweep_point(2, result))
    assert [(p["prompt_tokens"], p["max_new_tokens"]) for p in points] == [(480, 96), (64, 256)]
    text = sweep_table({"model": points[0]["result"]["model"], "points": points})
    title, head, _, first, second = text.splitlines()[:5]
    assert "prompt and new tokens per row" in title and "96 new tokens" not in title
    assert head.split()[:3] == ["clients", "prompt", "new"]
    assert first.split()[:3] == ["2", "480", "96"] and second.split()[:3] == ["2", "64", "256"]
    assert "vLLM ITL p50 ms" in head and "vLLM ITL p99 ms" in head and "ITL p99 ms" in head
    assert first.split()[-7:] == ["20.0", "10.0", "20.0", "100.0", "0.50", "150", "200"]
    assert second.split()[-4:-2] == ["80.0", "0.62"]
    one_shape = sweep_table({"model": points[0]["result"]["model"], "points": points[:1]})
    assert one_shape.splitlines()[1].split()[:2] == ["clients", "platform"] and "96 new tokens" in one_shape


def test_vllm_alone_is_compared_for_speed_and_agreement_is_not_claimed():
    runs = [_row("platform: 2 streaming clients", None, 50.0), _row("vLLM (2 streaming clients)", "vllm", 100.0)]
    result = _result(runs, None)
    point = sweep_point(2, result)
    assert point["generate_batched_tokens_per_s"] is None and point["ratio_to_batched"] is None
    assert point["same_answers"] is None and point["ratio_to_vllm"] == pytest.approx(0.5)
    lines = table(result).splitlines()
    assert "same answers: not checked (no generate baseline in this run" in "\n".join(lines)
    assert any(line.startswith("vLLM: its own kernels, not token-identical") for line in lines)
    assert "0.50x vLLM (2 streaming clients)" in table(result)
    assert sweep_table({"model": result["model"], "points": [point]}).splitlines()[3].split()[2] == "-"


def _vllm_venv() -> Path | None:
    venv = Path(os.environ.get("EXPERTMESH_VLLM_VENV") or "build/vllm-venv")
    return venv if (venv / "bin" / "python").is_file() else None


@pytest.mark.vllm
@pytest.mark.skipif(_vllm_venv() is None, reason="no vLLM venv: `make vllm-venv`, or set EXPERTMESH_VLLM_VENV")
def test_bench_serve_runs_vllm_beside_generate_on_the_same_checkpoint(capsys, tmp_path, ray_session):
    """A real vLLM server (its CPU build) on the tiny Mixtral: every request streams exactly M tokens, counted from
    vLLM's own token ids; the agreement is still generate's; the platform's ratio to vLLM is reported."""
    model = make_tiny_checkpoint(  # head_dim 32: vLLM's CPU attention has no kernel for the tiny default's 8
        "mixtral",
        tmp_path / "tiny",
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=128,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    out_file = tmp_path / "serve.json"
    capsys.readouterr()
    code = main(
        [
            "bench", "serve", "--model", str(model), "--baseline", "vllm,generate", "--clients", "2",
            "--requests-per-client", "2", "--max-new-tokens", "4", "--prompt-tokens", "16", "--out", str(out_file),
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    result = json.loads(out_file.read_text())
    names = [r["name"] for r in result["runs"]]
    assert names == [
        "platform: 2 streaming clients",
        "transformers generate, one at a time",
        "transformers generate, batched x2",
        "vLLM (2 streaming clients)",
    ], "generate first whatever the order given: its first run is the reference"
    vllm = result["runs"][-1]
    assert vllm["baseline"] == "vllm" and vllm["requests"] == 4 and vllm["tokens"] == 16 and vllm["concurrency"] == 2
    assert result["agreement"]["passed"], result["agreement"]
    assert result["platform_vs"]["vLLM (2 streaming clients)"] == pytest.approx(
        result["runs"][0]["tokens_per_s"] / vllm["tokens_per_s"]
    )
    assert "vLLM (2 streaming clients)" in out and "not token-identical" in out
