"""``expertmesh bench serve --guard SCORER``: the consistency guard at load.

What ``policy eval --guard`` measures one request at a time, with ``--clients`` N streaming clients at once,
so the guard's rollbacks and recomputations share packed steps with other sequences (as in production).

Workload: text prompts, the classifier's eval split (queries of at most ``--prompt-tokens`` tokens, seeded
order; ``--requests-per-client`` R each, N × R in all), each sent with its domain; greedy, exactly
``--max-new-tokens`` tokens each. One platform started here on the model (default: the trained domain model,
``domain-moe``), with capability profiles measured first through it (``profile build``'s measurement: exact
routing over up to ``PROFILE_QUERIES_PER_DOMAIN`` train-split queries of each domain), so ``restrict`` and
``prefer`` can serve. Runs, in order, all with the same clients and prompts:

- ``exact``: the reference answers;
- for each policy of ``--guard-policies`` (default ``delta_gap,restrict``; forced, past the router's quality
  guard): the policy without the consistency guard, then with it (``--guard`` scorer, ``--guard-threshold``,
  ``--guard-recompute``).

Figures per policy: the bad-case rate (the share of greedy positions whose token differs from exact's
answer to the same prompt) without and with the guard; the guard's checks and rollbacks (the engine's counts
over the guarded run); tokens/s, inter-token latency (mean and p50: the time per token a client sees) and
time to first token of each run, and the guard's added ms per token (mean ITL with minus without).
"""

from __future__ import annotations

import random
from collections import defaultdict

from expertmesh.bench.platform import device_summary
from expertmesh.bench.report import BenchError, format_table, machine, model_summary, options_summary, torch_threads
from expertmesh.infra.console import progress

#: train-split queries per domain the profiles are measured on (the README's policy figures used 40)
PROFILE_QUERIES_PER_DOMAIN = 40
#: tokens generated per profile query (``profile build``'s default)
PROFILE_TOKENS = 8


def run_guarded(options) -> dict:
    from expertmesh.bench.serve import platform_run, served_here, text_prompts, text_prompts_summary, validate
    from expertmesh.infra.devices import router_device
    from expertmesh.v1 import inference_pb2 as pb
    from expertmesh.verify.policy import guard_threshold

    checkpoint = validate(options)
    device = router_device(options.device, "--device")
    queries = text_prompts(options, checkpoint)
    texts = [t for t, _, _ in queries]
    guard = pb.ConsistencyGuard(scorer=options.guard, recompute=options.guard_recompute)
    if options.guard_threshold is not None:
        guard.threshold = options.guard_threshold
    off = pb.ConsistencyGuard(scorer="")  # not the server's default either

    def extras(routing, consistency_guard) -> list[dict]:
        return [{"routing_policy": routing, "domain": d, "consistency_guard": consistency_guard} for _, d, _ in queries]

    n = options.clients
    profiles: dict = {}
    ready = lambda plane, target: profiles.update(_measure_profiles(plane, target, options.seed))  # noqa: E731
    with (
        torch_threads(options.threads[0] if options.threads else None) as threads,
        served_here(options, checkpoint, device, ready) as server,
    ):
        target = f"127.0.0.1:{server.port}"
        requests = _requests(target, options.guard_policies)
        exact = platform_run(target, options, texts, f"exact: {n} clients", extras(requests["exact"], off))
        policies = []
        for name in options.guard_policies:
            plain = platform_run(target, options, texts, f"{name}: {n} clients", extras(requests[name], off))
            tally = []  # the engine's counts after the guarded run's warm-up: the timed requests' alone
            guarded = platform_run(
                target,
                options,
                texts,
                f"{name} + guard {options.guard}: {n} clients",
                extras(requests[name], guard),
                fresh=lambda: tally.append(server.engine.guard_tally()),
            )
            (checks, rollbacks), after = tally[0], server.engine.guard_tally()
            policies.append(_policy_figures(name, exact, plain, guarded, after[0] - checks, after[1] - rollbacks))
    return {
        "benchmark": "serve --guard",
        "model": model_summary(checkpoint),
        "setup": {
            **options_summary(options),
            "threads": threads,
            "platform": "in-process expertmesh up (local data plane, gRPC on loopback)",
            **device_summary(device),
            "prompts": text_prompts_summary(queries),
            "profiles": profiles,
            "guard": {
                "scorer": options.guard,
                "threshold": guard_threshold(guard),
                "recompute": options.guard_recompute,
            },
            "machine": machine(),
        },
        "runs": [exact, *(r for p in policies for r in (p.pop("plain_run"), p.pop("guarded_run")))],
        "policies": policies,
    }


def _measure_profiles(plane, target: str, seed: int) -> dict:
    """Capability profiles measured through the platform at ``target`` and saved in ``plane``'s store (where its
    router reads them); what was measured."""
    from expertmesh.classifier.corpus import load_examples, shipped
    from expertmesh.client import Client
    from expertmesh.router.policy.profiles import save_profiles
    from expertmesh.verify.profiles import measure_profiles

    by_domain = defaultdict(list)
    for example in load_examples(shipped("train")):
        by_domain[example.domain].append(example)
    rng = random.Random(seed)
    chosen = [
        e
        for d in sorted(by_domain)
        for e in rng.sample(by_domain[d], min(len(by_domain[d]), PROFILE_QUERIES_PER_DOMAIN))
    ]
    progress(f"bench serve --guard: capability profiles from {len(chosen)} train queries ({len(by_domain)} domains)")
    with Client(target, timeout=600) as client:
        profiles = measure_profiles(client, target, chosen, PROFILE_TOKENS, 4)
    save_profiles(plane.store, profiles)
    return {"queries": len(chosen), "domains": sorted(profiles), "tokens_per_query": PROFILE_TOKENS}


def _requests(target: str, names) -> dict:
    """Each policy as its requests send it (parsed against the served model; forced), and exact's."""
    from expertmesh.client import Client
    from expertmesh.contracts.errors import ExpertMeshError
    from expertmesh.verify.policy import EXACT, policy_request

    out = {"exact": EXACT}
    with Client(target, timeout=60) as client:
        for name in names:
            try:
                out[name] = policy_request(client, target, name, {})[2]
            except ExpertMeshError as err:
                raise BenchError(f"--guard-policies {name}: {err}") from None
    return out


def _bad_rate(reference: dict, run: dict) -> tuple[float, int]:
    """The share of greedy positions whose token differs from ``reference``'s answer to the same prompt, and
    the positions compared."""
    from expertmesh.router.policy.quality import same_positions

    same = positions = 0
    for a, b in zip(reference["token_ids"], run["token_ids"]):
        same += same_positions(a, b)
        positions += min(len(a), len(b))
    return 1 - same / max(positions, 1), positions


def _policy_figures(name: str, exact: dict, plain: dict, guarded: dict, checks: int, rollbacks: int) -> dict:
    bad, positions = _bad_rate(exact, plain)
    bad_guarded, _ = _bad_rate(exact, guarded)
    return {
        "policy": name,
        "positions": positions,
        "bad_rate": bad,
        "bad_rate_guarded": bad_guarded,
        "checks": checks,
        "rollbacks": rollbacks,
        "tokens_per_s": plain["tokens_per_s"],
        "tokens_per_s_guarded": guarded["tokens_per_s"],
        "itl_mean_ms": plain["itl_ms"]["mean"],
        "itl_mean_ms_guarded": guarded["itl_ms"]["mean"],
        "added_ms_per_token": guarded["itl_ms"]["mean"] - plain["itl_ms"]["mean"],
        "plain_run": plain,
        "guarded_run": guarded,
    }


def guarded_table(result: dict) -> str:
    model, setup, guard = result["model"], result["setup"], result["setup"]["guard"]
    lengths = setup["prompts"]["lengths"]
    title = (
        f"{model['model_type']} {model['path'].rsplit('/', 1)[-1]}: consistency guard {guard['scorer']} "
        f"(threshold {guard['threshold']:g}, recompute {guard['recompute']}) at {setup['clients']} streaming "
        f"clients; {len(lengths)} text prompts of {min(lengths)}-{max(lengths)} tokens, {setup['max_new_tokens']} "
        f"greedy tokens each; profiles from {setup['profiles']['queries']} train queries; {setup['threads']} torch "
        f"threads; {setup['machine']['cpus']} CPUs"
    )
    runs = format_table(
        ["run", "requests", "tok/s", "ITL mean ms", "ITL p50 ms", "TTFT p50 ms"],
        [
            [r["name"], r["requests"], r["tokens_per_s"], r["itl_ms"]["mean"], r["itl_ms"]["p50"], r["ttft_ms"]["p50"]]
            for r in result["runs"]
        ],
        ["", "d", ".1f", ".2f", ".2f", ".1f"],
    )
    policies = format_table(
        ["policy", "bad-case rate", "guarded", "checks", "rollbacks", "ms/token", "guarded", "added"],
        [
            [
                p["policy"],
                f"{p['bad_rate']:.1%}",
                f"{p['bad_rate_guarded']:.1%}",
                p["checks"],
                p["rollbacks"],
                p["itl_mean_ms"],
                p["itl_mean_ms_guarded"],
                p["added_ms_per_token"],
            ]
            for p in result["policies"]
        ],
        ["", "", "", "d", "d", ".2f", ".2f", "+.2f"],
    )
    positions = result["policies"][0]["positions"] if result["policies"] else 0
    return (
        f"{title}\n{runs}\n{policies}\n"
        f"bad-case rate: greedy tokens that differ from exact's answer to the same prompt, of {positions} positions; "
        "ms/token: mean inter-token latency a client sees"
    )
