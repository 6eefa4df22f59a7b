"""The printed report of ``bench serve``: a run's table and notes (``table``), the sweep's (``sweep_table``)."""

from __future__ import annotations

from pathlib import Path

from expertmesh.bench.report import format_table

__all__ = ["sweep_table", "table"]


def table(result: dict) -> str:
    """``drivers.run``'s result: a title, one row per run, the ratios, the agreement, and a line for each
    of decode steps, the planned placement, the KV pool and the classifier where the result has them."""
    ratios = "; ".join(f"{v:.2f}x {k}" for k, v in result["platform_vs"].items())
    lines = [
        _title(result["model"], result["setup"]),
        _runs(result),
        f"platform tok/s = {ratios}",
        _agreement_line(result["agreement"]),
    ]
    if any(r.get("baseline") == "vllm" for r in result["runs"]):
        lines.append("vLLM: its own kernels, not token-identical to transformers; compared for speed only")
    decode = [(r["name"], r["decode_steps"]) for r in result["runs"] if r.get("decode_steps", {}).get("steps")]
    if decode:
        lines.append(
            "decode steps (every sequence feeding its newest token), wall time per token: "
            + "; ".join(f"{name} {d['ms_per_token']:.2f} ms ({d['steps']} steps)" for name, d in decode)
        )
    if "placement" in result:
        from expertmesh.bench.planned_placement import placement_line

        lines.append(placement_line(result["placement"]))
    if "kv" in result:
        lines.append(_kv_line(result["kv"]))
    if "runner" in result:
        r = result["runner"]
        lines.append(
            f"model runner: {r['device']}, {r['batching']}, attention {r['attention_backend']}, "
            f"capture {r['capture']}, greedy tokens chosen {r['greedy_tokens_chosen']}"
        )
    if "classifier" in result:
        lines.append(_classifier_line(result["classifier"]))
    if result["setup"].get("price_per_hour") is not None:
        lines.append(_cost_line(result))
    return "\n".join(lines)


def _cost_line(result: dict) -> str:
    """Each run's US dollars per million output tokens at the machine's price (``--price-per-hour``)."""
    costs = "; ".join(
        f"{r['name']} "
        + ("-" if r["usd_per_million_output_tokens"] is None else f"${r['usd_per_million_output_tokens']:.2f}")
        for r in result["runs"]
    )
    return f"cost per million output tokens at ${result['setup']['price_per_hour']:.2f}/hour: {costs}"


def _title(model: dict, setup: dict) -> str:
    return (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x {model['num_experts']} "
        f"experts, hidden {model['hidden_size']}, {setup['dtype']}; {setup['max_new_tokens']} new tokens per request, "
        f"prompts {min(setup['prompt_lengths'])}-{max(setup['prompt_lengths'])} tokens; "
        f"{_threads_note(setup['threads'])}; {setup['machine']['cpus']} CPUs"
        + (f"; on {setup['gpu']}" if "gpu" in setup else "")
        + (f"; median of {setup['repeats']} interleaved repeats" if setup["repeats"] > 1 else "")
    )


def _runs(result: dict) -> str:
    """One row per run: the platform's, the baselines', then the classifier's."""
    rows = [
        [
            r["name"] + (f" ({r['threads']} threads)" if "threads" in r else ""),
            r["requests"],
            r["concurrency"],
            r["tokens"],
            r["seconds"],
            r["tokens_per_s"],
            r["itl_ms"]["p50"],
            r["itl_ms"]["p99"],
            r["ttft_ms"]["p50"],
            r["ttft_ms"]["p99"],
        ]
        for r in [*result["runs"], *result.get("classifier", {}).get("runs", [])]
    ]
    headers = ["run", "requests", "concurrent", "tokens", "seconds", "tok/s"]
    headers += ["ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms"]
    return format_table(headers, rows, ["", "d", "d", "d", ".2f", ".1f", ".2f", ".2f", ".1f", ".1f"])


def _agreement_line(agreement: dict | None) -> str:
    if agreement is None:
        return "same answers: not checked (no generate baseline in this run: --baseline generate adds it)"
    n, differ = agreement["requests"], agreement["differ"]
    if agreement["passed"]:
        return (
            f"same answers: PASS: each of the {n} requests streamed the tokens transformers generate "
            "gives its prompt alone"
        )
    return (
        f"same answers: FAIL: {len(differ)} of {n} requests streamed other tokens than generate alone "
        f"(prompts {differ[:10]})"
    )


def _kv_line(kv: dict) -> str:
    return (
        f"KV pool: peak {kv['blocks_used_peak']} of {kv['blocks_total']} blocks of {kv['block_size']} tokens "
        f"({kv['usage_peak']:.1%}); {kv['preemptions']} preemptions; prefix cache hits {kv['prefix_cache_hits']} "
        f"of {kv['prefix_cache_queries']} prompt tokens"
    )


def _classifier_line(c: dict) -> str:
    alone, vs_exact, calls = c["added_ttft_ms"], c["added_ttft_ms_vs_exact"], c["classify_ms"]
    return (
        f"query classifier's added TTFT (prefer alpha=0, classified - domain given): p50 {alone['p50']:+.1f} ms, "
        f"p99 {alone['p99']:+.1f} ms; classified - exact: p50 {vs_exact['p50']:+.1f} ms, "
        f"p99 {vs_exact['p99']:+.1f} ms; "
        f"one classify call here: p50 {calls['p50']:.2f} ms, p99 {calls['p99']:.2f} ms"
    )


def sweep_table(result: dict) -> str:
    """``drivers.run_sweep``'s result: a title, one row per point (client count, and prompt and answer lengths when
    they vary), and each point's placement."""
    setup = result["points"][0]["result"]["setup"]
    best_of = isinstance(setup["threads"], list)
    with_vllm = any(p.get("vllm_tokens_per_s") is not None for p in result["points"])
    priced = setup.get("price_per_hour") is not None
    shaped = len({(p.get("prompt_tokens"), p.get("max_new_tokens")) for p in result["points"]}) > 1
    rows = [
        [
            p["clients"],
            *((p["prompt_tokens"], p["max_new_tokens"]) if shaped else ()),
            p["platform_tokens_per_s"],
            p["generate_batched_tokens_per_s"],
            p["ratio_to_batched"],
            p["itl_p50_ms"]["platform"],
            p["itl_p50_ms"]["generate_batched"],
            p["decode_ms_per_token"]["platform"],
            p["decode_ms_per_token"]["generate_batched"],
            None if p["kv_usage_peak"] is None else 100 * p["kv_usage_peak"],
            p["preemptions"],
            {True: "PASS", False: "FAIL", None: "-"}[p["same_answers"]],
            *((p["threads"]["platform"], p["threads"]["generate_batched"]) if best_of else ()),
            *(
                (
                    p["itl_p99_ms"]["platform"],
                    p["itl_p50_ms"]["vllm"],
                    p["itl_p99_ms"]["vllm"],
                    p["vllm_tokens_per_s"],
                    p["ratio_to_vllm"],
                    p["ttft_p50_ms"]["platform"],
                    p["ttft_p50_ms"]["vllm"],
                )
                if with_vllm
                else ()
            ),
            *((p["usd_per_million_output_tokens"]["platform"],) if priced else ()),
            *((p["usd_per_million_output_tokens"]["vllm"],) if priced and with_vllm else ()),
        ]
        for p in result["points"]
    ]
    lengths = (
        f"prompt and new tokens per row (prompts {'exactly' if setup.get('equal_prompts') else 'half to'} that)"
        if shaped
        else f"{setup['max_new_tokens']} new tokens, prompts {_prompts_note(setup)}"
    )
    title = (
        f"bench serve --sweep: {result['model']['model_type']} {Path(result['model']['path']).name}, {setup['dtype']}; "
        f"{lengths}, {setup['requests_per_client']} request(s) per client; {_threads_note(setup['threads'])}"
    )
    headers = ["clients", *(("prompt", "new") if shaped else ()), "platform tok/s", "generate batched tok/s", "ratio"]
    headers += ["ITL p50 ms", "generate ITL p50 ms"]
    headers += ["decode ms/token", "generate decode ms/token", "KV peak %", "preemptions", "same answers"]
    headers += ["platform threads", "generate threads"] if best_of else []
    if with_vllm:
        headers += ["ITL p99 ms", "vLLM ITL p50 ms", "vLLM ITL p99 ms"]
        headers += ["vLLM tok/s", "ratio to vLLM", "TTFT p50 ms", "vLLM TTFT p50 ms"]
    formats = ["d", *(("d", "d") if shaped else ()), ".1f", ".1f", ".2f", ".1f", ".1f", ".2f", ".2f", ".1f", "d", ""]
    formats += ["d", "d"] if best_of else []
    formats += [".1f", ".1f", ".1f", ".1f", ".2f", ".0f", ".0f"] if with_vllm else []
    if priced:
        headers += ["platform $/M tok"] + (["vLLM $/M tok"] if with_vllm else [])
        formats += [".2f"] + ([".2f"] if with_vllm else [])
    body = format_table(headers, rows, formats)
    placed = [(p["clients"], p["result"]["placement"]) for p in result["points"] if "placement" in p["result"]]
    if placed:
        from expertmesh.bench.planned_placement import placement_line

        body += "".join(f"\n{clients} clients: {placement_line(placement)}" for clients, placement in placed)
    return f"{title}\n{body}"


def _prompts_note(setup: dict) -> str:
    tokens = setup["prompt_tokens"]
    return f"of {tokens} tokens each" if setup.get("equal_prompts") else f"up to {tokens} tokens"


def _threads_note(threads) -> str:
    """The title's word on torch threads: a count, or the counts each run took its best of."""
    if isinstance(threads, list):
        return f"each run at its best of {', '.join(map(str, threads))} torch threads"
    return f"{threads} torch threads"
