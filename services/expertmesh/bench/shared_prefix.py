"""``expertmesh bench serve --shared-prefix P``: what the prefix cache saves a shared prompt prefix.

Workload: ``--clients`` N requests whose prompts are one seeded ``P``-token prefix (a system prompt) and
each its own seeded suffix of ``--prompt-tokens`` - P tokens; greedy, exactly ``--max-new-tokens`` each.
The first request runs alone, then the other N - 1 follow, in two arrangements on the same platform (its
prefix cache emptied before each, and warmed up first by a prompt of the same length that shares no block
with theirs, so the first request's prefill is not the platform's first long one):

- *together while the first streams*: the later requests go at once when the first has streamed its first
  token (its prompt is then in the KV cache): they share steps, and wait out the first's decode step in
  flight;
- *one at a time*: each later request goes when the one before it has finished, so each meets an idle
  engine as the first did, and its TTFT differs from the first's by what the cache saves.

Two runs on fresh platforms, the same prompts: prefix caching on, and off (the baseline, in the same
command). Reported per arrangement: the first request's time to first token, the later ones' (median and
each), their ratio to the first's, and the prefix cache's hits; the later requests' tokens must equal
between the runs (the cache changes no answer).
"""

from __future__ import annotations

import statistics
import threading
import time

from expertmesh.bench.platform import device_summary
from expertmesh.bench.report import (
    BenchError,
    format_table,
    machine,
    model_summary,
    options_summary,
    torch_threads,
)
from expertmesh.infra.console import progress


def shared_prompts(prefix_tokens: int, prompt_tokens: int, count: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` seeded prompts: one ``prefix_tokens`` prefix, each its own suffix up to ``prompt_tokens``."""
    import torch

    from expertmesh.bench.serve import FIRST_TOKEN_ID

    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(FIRST_TOKEN_ID, vocab_size, (prefix_tokens,), generator=gen).tolist()
    suffix = max(1, prompt_tokens - prefix_tokens)
    return [prefix + torch.randint(FIRST_TOKEN_ID, vocab_size, (suffix,), generator=gen).tolist() for _ in range(count)]


def _stream(target: str, prompt: list[int], new_tokens: int, first_token: threading.Event | None = None) -> dict:
    """One greedy request: its time to first token (s) and its tokens."""
    from expertmesh.client import Client

    sent, ttft, ids = time.perf_counter(), None, []
    with Client(target, timeout=600) as client:
        for chunk in client.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False):
            if chunk.token_ids and ttft is None:
                ttft = time.perf_counter() - sent
                if first_token is not None:
                    first_token.set()
            ids.extend(chunk.token_ids)
    return {"ttft_s": ttft, "ids": ids}


#: The two arrangements of the later requests (see the module's docstring): JSON key -> table label.
ARRANGEMENTS = {"together": "together while the first streams", "one_at_a_time": "one at a time"}


def _arrangement(target: str, work: list[list[int]], new_tokens: int, key: str) -> dict:
    """The first request alone, then the later ones as ``key`` arranges them. TTFTs in ms and every
    request's tokens."""
    first_token = threading.Event()
    results: list[dict | None] = [None] * len(work)

    def send(i: int) -> None:
        results[i] = _stream(target, work[i], new_tokens, first_token if i == 0 else None)

    if key == "one_at_a_time":
        for i in range(len(work)):
            send(i)
    else:
        first = threading.Thread(target=send, args=(0,))
        first.start()
        if not first_token.wait(600):
            raise BenchError("the first request streamed no token in 600 s")
        later = [threading.Thread(target=send, args=(i,)) for i in range(1, len(work))]
        for t in later:
            t.start()
        for t in [first, *later]:
            t.join()
    if any(r is None or r["ttft_s"] is None for r in results):
        raise BenchError(f"{ARRANGEMENTS[key]}: a request failed or streamed nothing")
    later_ttft = [r["ttft_s"] for r in results[1:]]
    return {
        "first_ttft_ms": results[0]["ttft_s"] * 1e3,
        "later_ttft_ms": [t * 1e3 for t in later_ttft],
        "later_ttft_median_ms": statistics.median(later_ttft) * 1e3,
        "later_over_first": statistics.median(later_ttft) / results[0]["ttft_s"],
        "ids": [r["ids"] for r in results],
    }


def _one_run(options, checkpoint, device, work: list[list[int]], warm_up: list[int], caching: bool) -> dict:
    from expertmesh.bench.serve import served_here

    name = f"prefix caching {'on' if caching else 'off'}"
    progress(f"bench serve --shared-prefix: {name}, 1 + {len(work) - 1} requests in each arrangement")
    run: dict = {"name": name}
    with served_here(options, checkpoint, device, prefix_caching=caching) as server:
        target = f"127.0.0.1:{server.port}"
        _stream(target, warm_up, 2)
        for key in ARRANGEMENTS:
            server.engine.reset_prefix_cache()  # each arrangement finds only what its own first request left
            before = server.engine.kv_usage()
            run[key] = _arrangement(target, work, options.max_new_tokens, key)
            after = server.engine.kv_usage()
            run[key]["prefix_cache_hits"] = (after.prefix_hits - before.prefix_hits) if after and before else 0
    return run


def run_shared_prefix(options) -> dict:
    from expertmesh.bench.serve import validate
    from expertmesh.infra.devices import router_device

    if options.target:
        raise BenchError("--shared-prefix starts its own platforms (caching on and off): drop --target")
    if options.clients < 2:
        raise BenchError("--shared-prefix needs --clients of at least 2: a first request and later ones")
    if options.shared_prefix >= options.prompt_tokens:
        raise BenchError(
            f"--shared-prefix {options.shared_prefix} must be below --prompt-tokens {options.prompt_tokens}: "
            "each prompt has its own suffix"
        )
    checkpoint = validate(options)
    device = router_device(options.device, "--device")
    text = checkpoint.config.get_text_config()
    work = shared_prompts(options.shared_prefix, options.prompt_tokens, options.clients, text.vocab_size, options.seed)
    # as long as theirs, of other seeded tokens: it shares no block with them
    (warm_up,) = shared_prompts(0, options.prompt_tokens, 1, text.vocab_size, options.seed + 1)
    with torch_threads(options.threads[0] if options.threads else None) as threads:
        cached = _one_run(options, checkpoint, device, work, warm_up, caching=True)
        uncached = _one_run(options, checkpoint, device, work, warm_up, caching=False)
    return {
        "benchmark": "serve-shared-prefix",
        "model": model_summary(checkpoint),
        "setup": {**options_summary(options), "threads": threads, **device_summary(device), "machine": machine()},
        "runs": [cached, uncached],
        "same_answers": all(cached[key]["ids"] == uncached[key]["ids"] for key in ARRANGEMENTS),
    }


def prefix_table(result: dict) -> str:
    setup = result["setup"]
    rows = [
        [
            r["name"],
            label,
            f"{r[key]['first_ttft_ms']:.0f}",
            f"{r[key]['later_ttft_median_ms']:.0f}",
            f"{r[key]['later_over_first']:.2f}",
            str(r[key]["prefix_cache_hits"]),
        ]
        for r in result["runs"]
        for key, label in ARRANGEMENTS.items()
    ]
    head = (
        f"{setup['clients']} requests, prompts of {setup['prompt_tokens']} tokens sharing the first "
        f"{setup['shared_prefix']}, {setup['max_new_tokens']} new tokens; "
        "the first alone, then the rest as each row sends them"
    )
    table = format_table(
        ["run", "the rest sent", "first TTFT ms", "later TTFT p50 ms", "later / first", "prefix hits (tokens)"], rows
    )
    agreement = "same answers with and without the cache" if result["same_answers"] else "ANSWERS DIFFER"
    return f"{head}\n{table}\n{agreement}"
