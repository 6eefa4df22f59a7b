"""`expertmesh bench dispatch` and `expertmesh bench serve`: tiny, fast runs that
check the JSON's structure and that its figures are consistent (never how fast
anything was), and the error paths (exit 2, one line)."""

import json

import pytest

from expertmesh.bench.report import MAX_SHAPES, BenchError, format_table, parse_int_list, parse_shapes, percentile
from expertmesh.cli.main import main
from expertmesh.models.tiny import make_tiny_checkpoint

CONTEXT = 128
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(
        "mixtral", tmp_path_factory.mktemp("ckpt"), with_tokenizer=True, vocab_size=300, max_position_embeddings=CONTEXT
    )


def _run(capsys, *argv):
    capsys.readouterr()  # drop what set-up printed
    code = main(["bench", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# -- fast: the shared printer and the error paths (nothing started) ---------------------------


def test_table_aligns_columns_and_prints_missing_values_as_dash():
    text = format_table(["name", "ms", "n"], [["a", 1.234, 3], ["longer", None, 10]], ["", ".2f", "d"])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "ms", "n"]
    assert set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0])
    assert lines[2].split() == ["a", "1.23", "3"] and lines[3].split() == ["longer", "-", "10"]
    assert len({len(line) for line in lines[2:]}) == 1, "right-aligned columns end together"


def test_percentile_and_int_lists():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert parse_int_list("1, 8,32", "--batches") == [1, 8, 32]
    for bad in ("", "1,x", "0", "4,-1"):
        with pytest.raises(BenchError, match="--batches"):
            parse_int_list(bad, "--batches")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dispatch", "--batches", "1,x"], "--batches takes positive integers"),
        (["dispatch", "--batches", "0"], "--batches takes positive integers"),
        (["dispatch", "--prefill-tokens", CONTEXT + 1], f"above the model's context of {CONTEXT}"),
        (["dispatch", "--decode-steps", CONTEXT], f"above the model's context of {CONTEXT}"),
        (
            ["dispatch", "--prefill-tokens", 32, "--device", "gpu"],
            "--device 'gpu': a device is auto, cpu, cuda or cuda:N",
        ),
        (["dispatch", "--repeats", "0"], "--repeats must be at least 1"),
        (["serve", "--repeats", "0"], "--repeats must be at least 1"),
        (["serve", "--prompt-tokens", "100", "--max-new-tokens", "64"], f"above the model's context of {CONTEXT}"),
        (["serve", "--clients", "0"], "--clients must be at least 1"),
        (["serve", "--sweep", "1,x"], "--sweep takes positive integers separated by commas"),
        (["serve", "--max-step-tokens", "0"], "--max-step-tokens must be at least 1"),
        (["serve", "--max-step-tokens", 65537], "--max-step-tokens is at most 65536, got 65537"),
        (["serve", "--max-step-tokens", 64, "--target", "127.0.0.1:1"], "a --target keeps its own step size"),
        (["serve", "--target", "127.0.0.1:1"], "cannot reach `expertmesh up` at 127.0.0.1:1"),
        (
            ["serve", "--classifier", "--prompt-tokens", "8"],
            "no query of the classifier's eval split fits --prompt-tokens 8",
        ),
        (["serve", "--guard", "self", "--sweep", "1,2"], "--sweep and --guard are different runs; choose one"),
        (["serve", "--shapes", "480"], "--shapes takes PROMPTxNEW pairs of positive token counts"),
        (["serve", "--shapes", "8x0"], "--shapes takes PROMPTxNEW pairs of positive token counts"),
        (["serve", "--shapes", "8x4,8X4"], "--shapes names a shape twice"),
        (["serve", "--shapes", "8x4,100x64"], f"--shapes 100x64 is above the model's context of {CONTEXT} tokens"),
        (["serve", "--shapes", "8x4", "--shared-prefix", 8], "--shapes and --shared-prefix are different runs"),
        (["serve", "--guard", "self", "--target", "127.0.0.1:1"], "drop --target"),
        (["serve", "--guard", "self", "--guard-policies", "delta_gap,exact"], "exact is the reference"),
        (["serve", "--guard", "self", "--guard-policies", ","], "name at least one routing policy"),
        (["serve", "--guard", "self", "--guard-threshold", "1.5"], "--guard-threshold must be between 0 and 1"),
        (["serve", "--guard", "self", "--threads", "1,2"], "--threads takes one count with --guard"),
        (["serve", "--threads", "1,0"], "--threads takes positive integers"),
        (["serve", "--redundant", 2, "--target", "127.0.0.1:1"], "--redundant places the experts of the platform"),
        (["serve", "--redundant", -1], "--redundant is a count of replicas per layer, >= 0; got -1"),
        (["serve", "--redundant", 1, "--shared-prefix", 8], "not --shared-prefix"),
        (["serve", "--redundant", 5], "2 groups hold at most 4 redundant replicas of a layer's 4 experts"),
        (["serve", "--baseline", "tgi"], "--baseline takes distinct names of generate, vllm, comma-separated"),
        (["serve", "--baseline", "generate,generate"], "--baseline takes distinct names"),
        (["serve", "--baseline", "vllm", "--shared-prefix", 8], "--baseline is for the throughput runs"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, checkpoint, tmp_path, argv, message):
    code, out, err = _run(capsys, *argv, "--model", checkpoint, "--out", tmp_path / "x.json")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "x.json").exists()


def test_a_vllm_baseline_without_its_venv_is_one_line_before_anything_starts(capsys, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_VLLM_VENV", str(tmp_path / "no-venv"))
    code, _, err = _run(capsys, "serve", "--model", checkpoint, "--baseline", "vllm", "--out", tmp_path / "x.json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{tmp_path / 'no-venv'}/bin/python is missing: `make vllm-venv` builds build/vllm-venv" in err, err


def test_a_gpu_that_is_not_there_is_one_line(capsys, checkpoint, tmp_path, monkeypatch):
    """Only torch's device query is faked (this machine has no GPU either way)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = _run(
        capsys,
        "dispatch",
        "--model",
        checkpoint,
        "--prefill-tokens",
        32,
        "--device",
        "cuda",
        "--out",
        tmp_path / "x.json",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--device cuda: this process sees no CUDA GPU" in err, err


def test_agreement_passes_only_the_same_answers():
    """The check each dispatch run makes before timing: within verify's tolerance, same argmax everywhere."""
    from types import SimpleNamespace

    import torch

    from expertmesh.bench.dispatch import _agreement

    logits = torch.tensor([[[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]]])  # [1, P=2, V=3]
    model = lambda shifted: lambda input_ids: SimpleNamespace(logits=logits + shifted)  # noqa: E731
    ids = torch.zeros(1, 2, dtype=torch.long)
    same = _agreement(model(0.0), model(0.0), ids, "float32")
    assert same == {
        "max_abs_logit_diff": 0.0,
        "tolerance": 1e-4,
        "positions": 2,
        "argmax_differs_at": 0,
        "passed": True,
    }
    near = _agreement(model(0.0), model(torch.tensor([0.0, 0.0, 2e-4])), ids, "float32")
    assert (
        not near["passed"]
        and near["argmax_differs_at"] == 0
        and near["max_abs_logit_diff"] == pytest.approx(2e-4, rel=1e-3)
    )
    flipped = _agreement(model(0.0), model(torch.tensor([0.0, 0.0, 0.6])), ids, "bfloat16")  # row 0: 1.1 > 1.0
    assert not flipped["passed"] and flipped["argmax_differs_at"] == 1


def test_serve_agreement_names_the_prompts_whose_tokens_differ():
    from expertmesh.bench.serve import same_tokens

    reference = {"token_ids": [[5, 6], [7, 8], [9, 9]]}
    assert same_tokens({"token_ids": [[5, 6], [7, 8], [9, 9]]}, reference) == {
        "requests": 3,
        "differ": [],
        "passed": True,
    }
    assert same_tokens({"token_ids": [[5, 6], [7, 1], [9, 9]]}, reference) == {
        "requests": 3,
        "differ": [1],
        "passed": False,
    }
    assert not same_tokens({"token_ids": [[5, 6], [7, 8]]}, reference)["passed"], "a missing request is no agreement"


def test_serve_figures_come_from_each_requests_timings():
    """``bench serve``'s figures on made-up timings: TTFT from sending, ITL per token of a chunk (2 tokens
    20 ms after the one before are 10 ms each), tokens/s over first send to last token, tokens by prompt."""
    from expertmesh.bench.serve.stats import TimedRequest, summary

    requests = [
        TimedRequest(sent=1.00, prompt=1, arrivals=[(1.05, 1), (1.07, 2)], ids=[7, 8, 9]),
        TimedRequest(sent=1.01, prompt=0, arrivals=[(1.03, 1), (1.04, 1), (1.05, 1)], ids=[4, 5, 6]),
    ]
    figures = summary("platform: 2 streaming clients", 2, requests)
    assert (figures["requests"], figures["concurrency"], figures["tokens"]) == (2, 2, 6)
    assert figures["seconds"] == pytest.approx(0.07) and figures["tokens_per_s"] == pytest.approx(6 / 0.07)
    assert figures["ttft_ms"] == {"p50": pytest.approx(35.0), "p99": pytest.approx(49.7)}  # of 50 and 20 ms
    assert figures["itl_ms"] == {"p50": pytest.approx(10.0), "p99": pytest.approx(10.0), "mean": pytest.approx(10.0)}
    assert figures["token_ids"] == [[4, 5, 6], [7, 8, 9]]


def test_serve_repeats_report_the_median_and_thread_counts_the_best():
    from expertmesh.bench.serve.stats import best_of_threads, median_run

    runs = [{"name": "platform", "tokens_per_s": v} for v in (30.0, 10.0, 20.0, 40.0)]
    assert median_run(runs) == {  # the lower middle of an even count
        "name": "platform",
        "tokens_per_s": 20.0,
        "tokens_per_s_repeats": [30.0, 10.0, 20.0, 40.0],
    }
    by_count = {
        1: [{"name": "platform", "tokens_per_s": 5.0}, {"name": "generate", "tokens_per_s": 9.0}],
        2: [{"name": "platform", "tokens_per_s": 7.0}, {"name": "generate", "tokens_per_s": 8.0}],
    }
    assert best_of_threads(by_count) == [
        {"name": "platform", "tokens_per_s": 7.0, "threads": 2, "tokens_per_s_by_threads": {1: 5.0, 2: 7.0}},
        {"name": "generate", "tokens_per_s": 9.0, "threads": 1, "tokens_per_s_by_threads": {1: 9.0, 2: 8.0}},
    ]


def test_missing_checkpoint_exits_2(capsys, tmp_path):
    code, _, err = _run(capsys, "dispatch", "--model", tmp_path / "nope")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err


# -- slow: the real thing, tiny ---------------------------------------------------------------


@slow
def test_dispatch_reports_both_sides_and_consistent_wire_figures(capsys, checkpoint, ray_session, tmp_path):
    out_file = tmp_path / "dispatch.json"
    code, out, _ = _run(
        capsys,
        "dispatch",
        "--model",
        checkpoint,
        "--prefill-tokens",
        32,
        "--batches",
        "1,2",
        "--decode-steps",
        2,
        "--repeats",
        1,
        "--out",
        out_file,
    )
    assert code == 0
    result = json.loads(out_file.read_text())
    assert "phase" in out and "prefill 32" in out and "decode b=2" in out and f"wrote {out_file}" in out

    model, setup = result["model"], result["setup"]
    layers, hidden = model["moe_layers"], model["hidden_size"]
    assert layers == 2 and hidden == 32 and setup["groups"] == 2 and setup["dtype_bytes"] == 4
    assert setup["threads"] >= 1 and setup["machine"]["cpus"] >= 1
    assert setup["device"] == "cpu" and "gpu" not in setup  # --device auto, and this machine has no GPU
    agreement = result["agreement"]
    assert agreement["passed"] and agreement["positions"] == 32 and agreement["argmax_differs_at"] == 0
    assert agreement["max_abs_logit_diff"] <= 1e-4
    assert "same answers: PASS: prefill logits max |diff|" in out
    assert [p["name"] for p in result["phases"]] == ["prefill 32", "decode b=1", "decode b=2"]
    memory = result["memory"]
    assert 0 < memory["routed_expert_bytes"] < 4 * model["parameters"]  # float32: 4 bytes a parameter
    assert "the routed experts' weights" in out and "are in the monolithic model only" in out

    for phase, steps in zip(result["phases"], (1, 2, 2)):
        mono, plat, wire = phase["monolithic"], phase["platform"], phase["wire"]
        for side in (mono, plat):
            assert side["seconds"] > 0 and len(side["samples"]) == 1
            assert side["tokens_per_s"] == pytest.approx(phase["tokens_per_step"] / side["seconds"])
        assert phase["ratio"] == pytest.approx(plat["seconds"] / mono["seconds"])
        assert phase["added_ms_per_moe_layer"] == pytest.approx(1e3 * (plat["seconds"] - mono["seconds"]) / layers)
        # Only the timed steps are counted: one experts call per MoE layer per step.
        assert wire["calls"] == layers * steps
        assert wire["tokens"] == layers * steps * phase["tokens_per_step"]
        assert 1 <= wire["groups_touched_per_token"] <= 2
        assert wire["token_group_pairs"] <= wire["tokens"] * 2
        assert wire["min_bytes_per_token_per_layer"] == pytest.approx(hidden * 4 * 2 * wire["groups_touched_per_token"])
        assert wire["bytes_per_token_per_layer"] >= wire["min_bytes_per_token_per_layer"]
        assert wire["bytes_per_token_per_layer"] == pytest.approx(
            (wire["bytes_sent"] + wire["bytes_received"]) / wire["tokens"]
        )
        assert wire["overhead_vs_min"] >= 1 and wire["dispatch_ms_per_layer"] > 0


@slow
def test_serve_reports_platform_both_generate_baselines_and_the_classifier_runs(
    capsys, checkpoint, ray_session, tmp_path
):
    """One platform start for both halves: the token-id runs against transformers, then (``--classifier``)
    the text-prompt runs with and without the router classifying."""
    out_file = tmp_path / "serve.json"
    code, out, _ = _run(
        capsys,
        "serve",
        "--model",
        checkpoint,
        "--clients",
        2,
        "--requests-per-client",
        2,
        "--max-new-tokens",
        3,
        "--prompt-tokens",
        24,
        "--classifier",
        "--out",
        out_file,
    )
    assert code == 0
    result = json.loads(out_file.read_text())
    assert "platform: 2 streaming clients" in out and "ITL p50 ms" in out
    names = [r["name"] for r in result["runs"]]
    assert names == [
        "platform: 2 streaming clients",
        "transformers generate, one at a time",
        "transformers generate, batched x2",
    ]
    assert [r["concurrency"] for r in result["runs"]] == [2, 1, 2]
    assert all(12 <= n <= 24 for n in result["setup"]["prompt_lengths"]) and len(result["setup"]["prompt_lengths"]) == 4
    c = result["classifier"]
    for r in result["runs"] + c["runs"]:
        assert r["requests"] == 4 and r["tokens"] == 12, (
            "every request, classified or not, streams exactly max_new_tokens"
        )
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert 0 <= r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    platform = result["runs"][0]
    for r in result["runs"][1:]:
        assert result["platform_vs"][r["name"]] == pytest.approx(platform["tokens_per_s"] / r["tokens_per_s"])
    assert result["agreement"] == {"requests": 4, "differ": [], "passed": True}
    assert platform["token_ids"] == result["runs"][1]["token_ids"] and all(len(t) == 3 for t in platform["token_ids"])
    kv = result["kv"]
    assert (
        0 < kv["blocks_used_peak"] <= kv["blocks_total"]
        and kv["usage_peak"] == kv["blocks_used_peak"] / kv["blocks_total"]
    )
    assert kv["preemptions"] == 0 and kv["prefix_cache_queries"] >= kv["prefix_cache_hits"] >= 0
    assert f"KV pool: peak {kv['blocks_used_peak']} of {kv['blocks_total']} blocks" in out
    # the model runner as it ran here: the seams a GPU run reports the same way (deploy/gpu-bench/run.sh)
    assert result["runner"] == {
        "device": "cpu",
        "batching": "packed",
        "attention_backend": "cpu-paged-decode",
        "capture": "eager",
        "input_buckets": result["runner"]["input_buckets"],
        "pinned_staging": False,
        "greedy_tokens_chosen": "on the device",
        "fused_decode_attention_layers": result["runner"]["fused_decode_attention_layers"],
    }
    # each attention layer's decode steps on the one op, where it builds (``cpu_decode_attention``)
    from expertmesh.serving import cpu_decode_attention

    assert result["runner"]["fused_decode_attention_layers"] == (2 if cpu_decode_attention.load() else 0)
    assert result["runner"]["input_buckets"][-1] == 1024, "the largest bucket is the step's token budget"
    assert "model runner: cpu, packed, attention cpu-paged-decode, capture eager" in out
    # decode steps: batched generate's 2 batches of 2 make 2 decode steps each; the engine's are its own count
    batched_decode = result["runs"][2]["decode_steps"]
    assert (batched_decode["steps"], batched_decode["tokens"]) == (4, 8) and batched_decode["ms_per_token"] > 0
    assert 0 < platform["decode_steps"]["tokens"] <= 8 and "decode_steps" not in result["runs"][1]
    assert "decode steps (every sequence feeding its newest token), wall time per token: platform" in out
    # The baseline's tokens are plain argmax decoding (end-of-sequence allowed, as stop_at_eos=False streams it).
    from tests.helpers import stock_greedy
    from transformers import AutoModelForCausalLM

    from expertmesh.bench.serve import Options, prompts

    stock = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    work = prompts(Options(model=checkpoint, clients=2, requests_per_client=2, prompt_tokens=24), 300)
    assert [stock_greedy(stock, p, 3) for p in work] == result["runs"][1]["token_ids"]
    assert (
        "same answers: PASS: each of the 4 requests streamed the tokens transformers generate gives its prompt alone"
        in out
    )

    assert result["setup"]["classifier"] is True
    text_runs = [r["name"] for r in c["runs"]]
    assert text_runs == [
        "text, exact: 2 clients",
        "text, prefer alpha=0, domain given: 2 clients",
        "text, prefer alpha=0, classified: 2 clients",
    ]
    assert all(name in out for name in text_runs) and "query classifier's added TTFT" in out
    assert c["policy"] == "prefer(alpha=0)" and len(c["prompts"]["domains"]) == 4
    assert all(16 <= n <= 24 for n in c["prompts"]["lengths"])
    exact, given, classified = c["runs"]
    for q in ("p50", "p99"):
        assert c["added_ttft_ms"][q] == pytest.approx(classified["ttft_ms"][q] - given["ttft_ms"][q])
        assert c["added_ttft_ms_vs_exact"][q] == pytest.approx(classified["ttft_ms"][q] - exact["ttft_ms"][q])
    assert c["classify_ms"]["calls"] == 4 and 0 < c["classify_ms"]["p50"] <= c["classify_ms"]["p99"]


@slow
def test_serve_against_a_running_target_checks_it_serves_the_checkpoint(capsys, checkpoint, ray_session, tmp_path):
    from expertmesh.config.settings import DataPlaneConfig, ServingConfig
    from expertmesh.platform.data_plane import DataPlane
    from expertmesh.platform.router_apis import serve_plane

    other = make_tiny_checkpoint("mixtral", tmp_path / "other", hidden_size=48, max_position_embeddings=CONTEXT)
    with DataPlane.start(DataPlaneConfig(model=checkpoint, groups=1)) as plane:
        server = serve_plane(plane, ServingConfig(port=0))
        target = f"127.0.0.1:{server.port}"
        try:
            code, _, err = _run(capsys, "serve", "--model", other, "--target", target, "--out", tmp_path / "bad.json")
            assert code == 2 and len(err.strip().splitlines()) == 1 and "pass --model with the served checkpoint" in err

            out_file = tmp_path / "serve.json"
            code, out, _ = _run(
                capsys,
                "serve",
                "--model",
                checkpoint,
                "--target",
                target,
                "--clients",
                2,
                "--requests-per-client",
                1,
                "--max-new-tokens",
                3,
                "--prompt-tokens",
                6,
                "--repeats",
                3,
                "--out",
                out_file,
            )
            assert code == 0 and "median of 3 interleaved repeats" in out
            result = json.loads(out_file.read_text())
            assert result["setup"]["platform"] == target and result["setup"]["repeats"] == 3
            assert [r["tokens"] for r in result["runs"]] == [6, 6, 6]
            for r in result["runs"]:  # each row is its median repeat
                assert len(r["tokens_per_s_repeats"]) == 3
                assert r["tokens_per_s"] == sorted(r["tokens_per_s_repeats"])[1]
            platform, *baselines = result["runs"]
            for r in baselines:
                assert result["platform_vs"][r["name"]] == pytest.approx(platform["tokens_per_s"] / r["tokens_per_s"])

            # a target holds no capability profiles unless built: prefer (alpha 0) is refused, in one line
            code, _, err = _run(
                capsys,
                "serve",
                "--model",
                checkpoint,
                "--target",
                target,
                "--classifier",
                "--clients",
                1,
                "--requests-per-client",
                1,
                "--max-new-tokens",
                2,
                "--prompt-tokens",
                24,
                "--out",
                tmp_path / "c.json",
            )
            *progress, line = err.strip().splitlines()  # after the runs before it, one error line
            assert (
                code == 2
                and line.startswith("expertmesh bench: error: ")
                and "domain: no capability profile for" in line
            )
            assert all(p.startswith("[expertmesh] bench serve:") for p in progress)
        finally:
            server.drain_and_stop()


def test_shapes_parse_as_prompt_and_answer_lengths_within_bounds():
    assert parse_shapes("480x96, 64X256,") == [(480, 96), (64, 256)]
    assert len(parse_shapes(",".join(f"{n}x1" for n in range(1, MAX_SHAPES + 1)))) == MAX_SHAPES
    with pytest.raises(BenchError, match=f"at most {MAX_SHAPES} shapes"):
        parse_shapes(",".join(f"{n}x1" for n in range(1, MAX_SHAPES + 2)))
    assert parse_shapes(" 480 x 96") == [(480, 96)]
    for bad in ("", ",", "x", "8x", "x8", "-8x4", "8x-4", "0x4", "8x4x2", "a x 4", "\u00b2x4", "8.5x4"):
        with pytest.raises(BenchError, match="--shapes takes PROMPTxNEW pairs"):
            parse_shapes(bad)


@slow
def test_serve_shapes_run_the_benchmark_at_each_prompt_and_answer_length(capsys, checkpoint, ray_session, tmp_path):
    """--shapes: one whole run per (prompt, answer) length, each point's requests streaming exactly its answer
    length over prompts of its prompt length, one table row each with the shape in it."""
    out_file = tmp_path / "shapes.json"
    code, out, _ = _run(
        capsys,
        "serve",
        "--model",
        checkpoint,
        "--shapes",
        "12x3,6x5",
        "--clients",
        2,
        "--requests-per-client",
        1,
        "--equal-prompts",
        "--threads",
        1,
        "--out",
        out_file,
    )
    assert code == 0
    result = json.loads(out_file.read_text())
    points = result["points"]
    assert result["benchmark"] == "serve-sweep" and len(points) == 2
    assert [(p["clients"], p["prompt_tokens"], p["max_new_tokens"]) for p in points] == [(2, 12, 3), (2, 6, 5)]
    for p in points:
        setup, platform = p["result"]["setup"], p["result"]["runs"][0]
        assert setup["prompt_lengths"] == [p["prompt_tokens"]] * 2
        assert platform["tokens"] == 2 * p["max_new_tokens"] and p["same_answers"] is True
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("clients"))
    assert head.split()[:3] == ["clients", "prompt", "new"] and "prompt and new tokens per row" in out
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [r[:3] for r in rows[:2]] == [["2", "12", "3"], ["2", "6", "5"]]


@slow
def test_serve_sweep_reports_one_row_per_client_count(capsys, checkpoint, ray_session, tmp_path):
    out_file = tmp_path / "sweep.json"
    code, out, _ = _run(
        capsys,
        "serve",
        "--model",
        checkpoint,
        "--sweep",
        "1,2",
        "--requests-per-client",
        1,
        "--max-new-tokens",
        3,
        "--prompt-tokens",
        16,
        "--equal-prompts",
        "--max-step-tokens",
        8,
        "--threads",
        "1,2",
        "--out",
        out_file,
    )
    assert code == 0
    result = json.loads(out_file.read_text())
    assert result["benchmark"] == "serve-sweep" and [p["clients"] for p in result["points"]] == [1, 2]
    assert "bench serve --sweep" in out and "generate batched tok/s" in out and "decode ms/token" in out
    assert "prompts of 16 tokens each" in out
    assert "each run at its best of 1, 2 torch threads" in out and "platform threads" in out
    for p in result["points"]:
        runs = p["result"]["runs"]
        for run in runs:  # each side at its best thread count, every count's figure beside it
            by_threads = {int(c): v for c, v in run["tokens_per_s_by_threads"].items()}
            assert set(by_threads) == {1, 2} and run["tokens_per_s"] == max(by_threads.values())
            assert by_threads[run["threads"]] == run["tokens_per_s"]
        assert (p["threads"]["platform"], p["threads"]["generate_batched"]) == (runs[0]["threads"], runs[-1]["threads"])
        assert (
            runs[0]["concurrency"] == p["clients"]
            and runs[-1]["name"] == f"transformers generate, batched x{p['clients']}"
        )
        assert p["ratio_to_batched"] == pytest.approx(p["platform_tokens_per_s"] / p["generate_batched_tokens_per_s"])
        assert p["same_answers"] and p["preemptions"] == 0 and 0 < p["kv_usage_peak"] <= 1
        assert set(p["result"]["setup"]["prompt_lengths"]) == {16}
        # decode steps: generate's are its streamer's calls after the first token, 2 steps of every sequence;
        # the engine's, those where every sequence fed its newest token (a later arrival's prefill is not one)
        generate_decode = runs[-1]["decode_steps"]
        assert (generate_decode["steps"], generate_decode["tokens"]) == (2, 2 * p["clients"])
        assert 0 < runs[0]["decode_steps"]["tokens"] <= 2 * p["clients"]
        assert all(ms > 0 for ms in p["decode_ms_per_token"].values())
        assert p["decode_ms_per_token"]["platform"] == runs[0]["decode_steps"]["ms_per_token"]
        # --max-step-tokens 8 reached the engine: no step fed more than 8 tokens, so the clients' 16-token
        # prompts took at least 2 steps each (at the default 512 they would all go in one)
        engine_steps = runs[0]["engine_steps"]
        assert all(s["tokens"] <= 8 * s["steps"] for s in engine_steps.values())
        prompt_steps = engine_steps["prefill"]["steps"] + engine_steps["mixed"]["steps"]
        assert prompt_steps >= 2 * p["clients"]
        assert sum(s["tokens"] for s in engine_steps.values()) == p["clients"] * (16 + 2)


def test_serve_engine_steps_count_the_last_step_of_a_run(capsys, checkpoint, tmp_path, monkeypatch):
    """The engine counts a step before its tokens go out and adds it to its step totals after the forward:
    a client that has its run's last token may read the totals a step short (and the warm-up's last step may
    land in the timed run's). Each record is delayed here so that window is wide, not a matter of luck on a
    busy machine; the run's steps must still hold exactly its tokens: 2 prompts of 16 and 2 fed tokens each."""
    import time

    from expertmesh.serving.step_tally import StepTally

    record = StepTally.record

    def late(self, kind, tokens, seconds):
        time.sleep(0.2)
        record(self, kind, tokens, seconds)

    monkeypatch.setattr(StepTally, "record", late)
    out_file = tmp_path / "steps.json"
    code, out, _ = _run(
        capsys, "serve", "--model", checkpoint, "--groups-as", "process", "--clients", 2, "--requests-per-client", 1,
        "--max-new-tokens", 3, "--prompt-tokens", 16, "--equal-prompts", "--out", out_file,
    )  # fmt: skip
    assert code == 0, out
    platform = json.loads(out_file.read_text())["runs"][0]
    assert sum(s["tokens"] for s in platform["engine_steps"].values()) == 2 * (16 + 2)
    assert platform["decode_steps"]["tokens"] == platform["engine_steps"]["decode"]["tokens"] > 0


def test_serve_redundant_places_experts_by_calibrated_load_and_keeps_the_answers(capsys, checkpoint, tmp_path):
    """--redundant 2: calibration prompts, the planner's placement with 2 more replicas per layer carried out
    by live migrations on plain group processes, then the timed runs: the same answers as transformers."""
    out_file = tmp_path / "placed.json"
    code, out, _ = _run(
        capsys, "serve", "--model", checkpoint, "--groups-as", "process", "--redundant", 2, "--clients", 2,
        "--requests-per-client", 1, "--max-new-tokens", 3, "--prompt-tokens", 16, "--out", out_file,
    )  # fmt: skip
    assert code == 0
    result = json.loads(out_file.read_text())
    placement = result["placement"]
    assert placement["redundant"] == 2 and placement["migrations"] >= 2
    assert 1 < placement["replicas_per_expert"] <= 1.5  # at most 2 more of 4 experts per layer
    assert placement["balancedness_after"] >= placement["balancedness_before"]
    assert placement["calibration_tokens"] >= 8 * (8 + 2)  # 8 prompts of 8-16 tokens and their new tokens
    assert result["setup"]["redundant"] == 2 and result["agreement"]["passed"]
    assert "placement: planned from" in out and "2 redundant replicas per layer" in out


def test_serve_shared_prefix_reports_cache_on_and_off_with_the_same_answers(capsys, checkpoint, ray_session, tmp_path):
    out_file = tmp_path / "prefix.json"
    code, out, _ = _run(
        capsys,
        "serve",
        "--model",
        checkpoint,
        "--shared-prefix",
        32,
        "--prompt-tokens",
        40,
        "--clients",
        3,
        "--max-new-tokens",
        3,
        "--out",
        out_file,
    )
    assert code == 0, out
    result = json.loads(out_file.read_text())
    on, off = result["runs"]
    assert (on["name"], off["name"]) == ("prefix caching on", "prefix caching off")
    assert result["same_answers"] and "same answers with and without the cache" in out
    for key in ("together", "one_at_a_time"):  # the later requests sent at once while the first streams; in turn
        # Both later requests find the first's two full 16-token blocks of the shared prefix (the cache emptied
        # before each arrangement, so no more than that); without the cache, none.
        assert on[key]["prefix_cache_hits"] == 2 * 32 and off[key]["prefix_cache_hits"] == 0, key
        assert len(on[key]["later_ttft_ms"]) == 2 and on[key]["later_over_first"] > 0
        assert on[key]["ids"] == off[key]["ids"] and all(len(ids) == 3 for ids in on[key]["ids"])
    assert "together while the first streams" in out and "one at a time" in out
    code, out, err = _run(capsys, "serve", "--model", checkpoint, "--shared-prefix", 40, "--prompt-tokens", 40)
    assert code == 2 and "must be below --prompt-tokens 40" in err


def test_serve_guard_measures_each_policy_without_and_with_the_guard_against_exact(
    capsys, checkpoint, ray_session, tmp_path, monkeypatch
):
    """The consistency guard at load on the tiny model (random weights: the figures mean nothing, their
    consistency does). Threshold 1 makes every scored token roll back (p / (p + p2) < 1), so the guarded run
    must report rollbacks; the bad-case rates must be what the runs' own tokens give against exact's."""
    from expertmesh.bench import guarded_serve
    from expertmesh.router.policy.quality import same_positions

    monkeypatch.setattr(guarded_serve, "PROFILE_QUERIES_PER_DOMAIN", 2)  # profiles from 18 queries, not 360
    out_file = tmp_path / "guard.json"
    code, out, _ = _run(capsys, "serve", "--model", checkpoint, "--guard", "self", "--guard-threshold", 1,
                        "--guard-policies", "delta_gap", "--clients", 2, "--requests-per-client", 2,
                        "--max-new-tokens", 3, "--prompt-tokens", 100, "--out", out_file)  # fmt: skip
    assert code == 0, out
    result = json.loads(out_file.read_text())
    exact, plain, guarded = result["runs"]
    assert [r["name"] for r in result["runs"]] == [
        "exact: 2 clients",
        "delta_gap: 2 clients",
        "delta_gap + guard self: 2 clients",
    ]
    assert result["setup"]["guard"] == {"scorer": "self", "threshold": 1, "recompute": "widened"}
    assert result["setup"]["profiles"]["queries"] == 18
    (policy,) = result["policies"]
    assert policy["positions"] == 4 * 3 and all(len(ids) == 3 for ids in guarded["token_ids"])
    assert policy["rollbacks"] > 0 and policy["checks"] >= policy["rollbacks"]
    for run, rate in ((plain, policy["bad_rate"]), (guarded, policy["bad_rate_guarded"])):
        same = sum(same_positions(a, b) for a, b in zip(exact["token_ids"], run["token_ids"]))
        assert rate == pytest.approx(1 - same / 12)
    assert policy["added_ms_per_token"] == pytest.approx(policy["itl_mean_ms_guarded"] - policy["itl_mean_ms"])
    assert "delta_gap" in out and "bad-case rate" in out
