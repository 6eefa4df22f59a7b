"""A run's figures from its requests' timings (pure): tokens/s, ITL, TTFT, decode steps, medians, best counts.

Glossary
--------
timed request
    ``TimedRequest``: one request as its caller saw it, whoever served it (the platform, a baseline):
    when it was sent, when each chunk of tokens arrived, and the tokens.
run figures
    ``summary``'s dict, one row of the report and of the JSON's ``runs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expertmesh.bench.report import percentile

__all__ = [
    "TimedRequest",
    "best_of_threads",
    "decode_steps",
    "kv_summary",
    "median_run",
    "same_tokens",
    "summary",
    "sweep_point",
]


@dataclass
class TimedRequest:
    """One request as its caller saw it: when it was sent, when each token arrived, and which.

    Example: ``TimedRequest(sent=0.0, prompt=3, arrivals=[(0.05, 1), (0.07, 2)], ids=[11, 12, 13])``,
    its first token 50 ms after sending, then two at once 20 ms later (10 ms each)."""

    sent: float  # time.perf_counter() when sent
    prompt: int  # its prompt's index in the run's work
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that chunk)
    ids: list[int] = field(default_factory=list)  # the tokens, in order

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


def decode_steps(steps: int, tokens: int, seconds: float) -> dict:
    """A run's decode steps (every sequence feeding its newest token): how many, and their mean time per
    token (a step's wall time over the sequences it advanced)."""
    return {"steps": steps, "tokens": tokens, "ms_per_token": 1e3 * seconds / tokens if tokens else None}


def summary(name: str, concurrency: int, requests: list[TimedRequest]) -> dict:
    """The run's figures: tokens/s over its wall time (first send to last token), ITL per token of a
    chunk, TTFT, and every request's tokens by prompt."""
    itl, ttft = [], []
    for r in requests:
        if r.arrivals:
            ttft.append(r.arrivals[0][0] - r.sent)
        for (before, _), (after, k) in zip(r.arrivals, r.arrivals[1:]):
            itl.append((after - before) / k)
    tokens = sum(r.tokens for r in requests)
    wall = max(t for r in requests for t, _ in r.arrivals) - min(r.sent for r in requests)

    def ms(values, q):
        return 1e3 * percentile(values, q)

    return {
        "name": name,
        "concurrency": concurrency,
        "requests": len(requests),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "itl_ms": {"p50": ms(itl, 50), "p99": ms(itl, 99), "mean": 1e3 * sum(itl) / len(itl) if itl else None},
        "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
        "token_ids": [r.ids for r in sorted(requests, key=lambda r: r.prompt)],  # by prompt
    }


def same_tokens(platform: dict, reference: dict) -> dict:
    """Whether the platform's run streamed, for every prompt, the tokens ``reference`` (transformers
    ``generate`` of that prompt alone, greedy) generated; a speed figure of other answers means nothing."""
    differ = [i for i, (a, b) in enumerate(zip(platform["token_ids"], reference["token_ids"])) if a != b]
    return {
        "requests": len(reference["token_ids"]),
        "differ": differ,
        "passed": not differ and len(platform["token_ids"]) == len(reference["token_ids"]),
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count), with every run's tokens/s."""
    median = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    return {**median, "tokens_per_s_repeats": [r["tokens_per_s"] for r in runs]}


def best_of_threads(by_count: dict[int, list[dict]]) -> list[dict]:
    """``by_count``: thread count -> the same runs measured at it, in the same order. Each run at its best
    count (most tokens/s), with that count and every count's tokens/s beside it."""
    best = []
    for same_run in zip(*by_count.values()):
        runs = dict(zip(by_count, same_run))
        count = max(runs, key=lambda c: runs[c]["tokens_per_s"])
        best.append(
            {
                **runs[count],
                "threads": count,
                "tokens_per_s_by_threads": {c: r["tokens_per_s"] for c, r in runs.items()},
            }
        )
    return best


def kv_summary(kv) -> dict:
    """The in-process platform's KV pool over all its runs (``Engine.kv_usage``)."""
    return {
        "blocks_total": kv.blocks_total,
        "block_size": kv.block_size,
        "blocks_used_peak": kv.blocks_used_peak,
        "usage_peak": kv.blocks_used_peak / kv.blocks_total,
        "preemptions": kv.preemptions,
        "prefix_cache_queries": kv.prefix_queries,
        "prefix_cache_hits": kv.prefix_hits,
    }


def sweep_point(clients: int, result: dict) -> dict:
    """One point of ``--sweep``: the platform (the first run) against batched ``generate`` (the generate
    baseline's last run) and vLLM, each where the run had it (else its figures are None), and that result."""
    platform = result["runs"][0]
    batched = next((r for r in reversed(result["runs"]) if r.get("baseline") == "generate"), {})
    vllm = next((r for r in result["runs"] if r.get("baseline") == "vllm"), {})
    kv = result.get("kv", {})

    def of(run: dict, *keys: str):
        for key in keys:
            run = run.get(key) if isinstance(run, dict) else None
        return run

    setup = result.get("setup", {})
    return {
        "clients": clients,
        "prompt_tokens": setup.get("prompt_tokens"),
        "max_new_tokens": setup.get("max_new_tokens"),
        "platform_tokens_per_s": platform["tokens_per_s"],
        "generate_batched_tokens_per_s": of(batched, "tokens_per_s"),
        "ratio_to_batched": batched and platform["tokens_per_s"] / batched["tokens_per_s"] or None,
        "vllm_tokens_per_s": of(vllm, "tokens_per_s"),
        "ratio_to_vllm": vllm and platform["tokens_per_s"] / vllm["tokens_per_s"] or None,
        "itl_p50_ms": {
            "platform": platform["itl_ms"]["p50"],
            "generate_batched": of(batched, "itl_ms", "p50"),
            "vllm": of(vllm, "itl_ms", "p50"),
        },
        "itl_p99_ms": {"platform": platform["itl_ms"]["p99"], "vllm": of(vllm, "itl_ms", "p99")},
        "ttft_p50_ms": {"platform": platform["ttft_ms"]["p50"], "vllm": of(vllm, "ttft_ms", "p50")},
        "decode_ms_per_token": {
            "platform": platform.get("decode_steps", {}).get("ms_per_token"),
            "generate_batched": of(batched, "decode_steps", "ms_per_token"),
        },
        "threads": {"platform": platform.get("threads"), "generate_batched": of(batched, "threads")},
        "kv_usage_peak": kv.get("usage_peak"),
        "preemptions": kv.get("preemptions"),
        "same_answers": None if result["agreement"] is None else result["agreement"]["passed"],
        # US dollars per million output tokens (--price-per-hour; None: not priced)
        "usd_per_million_output_tokens": {
            "platform": platform.get("usd_per_million_output_tokens"),
            "vllm": of(vllm, "usd_per_million_output_tokens"),
        },
        "result": result,
    }
