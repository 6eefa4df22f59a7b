"""``bench serve --classifier``: the query classifier's added time to first token, from three text-prompt runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from expertmesh.bench.report import percentile
from expertmesh.bench.serve.served import platform_run
from expertmesh.bench.serve.workload import text_prompts_summary

if TYPE_CHECKING:
    from expertmesh.bench.serve.options import Options

__all__ = ["NEUTRAL_POLICY", "classifier_runs", "classifier_summary", "neutral_profiles"]

#: What the classifier runs send: ``prefer`` with no bias at all, so only the classification differs.
NEUTRAL_POLICY = {"name": "prefer", "alpha": 0.0}


def neutral_profiles(plane) -> None:
    """Capability profiles of lift 1 for every domain the default classifier assigns, in the plane's
    store: what ``prefer`` needs to serve, with a bias of 0 whatever its alpha."""
    import numpy as np

    from expertmesh.classifier import default_classifier
    from expertmesh.router.policy.profiles import build_profiles, save_profiles

    spec = plane.checkpoint.spec
    even = np.ones((len(spec.moe_layers), spec.num_experts))  # [L, E]: every expert chosen alike
    domains = {d.split("/")[0] for d in default_classifier().domains}  # trains it here if it is not cached yet
    save_profiles(plane.store, build_profiles({d: even for d in domains}, tuple(spec.moe_layers)))


def classifier_runs(target: str, options: Options, queries: list[tuple[str, str, int]]) -> list[dict]:
    """The three text-prompt runs: exact; prefer (alpha 0) with the domain given; prefer (alpha 0) classified."""
    if not options.classifier:
        return []
    from expertmesh.v1 import inference_pb2 as pb

    texts = [t for t, _, _ in queries]
    neutral = pb.RoutingPolicy(**NEUTRAL_POLICY)
    n = options.clients
    return [
        platform_run(target, options, texts, f"text, exact: {n} clients", [{"routing_policy": "exact"}] * len(texts)),
        platform_run(
            target,
            options,
            texts,
            f"text, prefer alpha=0, domain given: {n} clients",
            [{"routing_policy": neutral, "domain": d} for _, d, _ in queries],
        ),
        platform_run(
            target,
            options,
            texts,
            f"text, prefer alpha=0, classified: {n} clients",
            [{"routing_policy": neutral}] * len(texts),
        ),
    ]


def classifier_summary(runs: list[dict], queries: list[tuple[str, str, int]]) -> dict:
    """The JSON's ``classifier``: the runs, the classifier's added TTFT (against the domain given, and
    against exact), and its own time per call in this process on the same texts."""
    from expertmesh.classifier import default_classifier

    exact, given, classified = runs

    def added(than: dict) -> dict:
        return {q: classified["ttft_ms"][q] - than["ttft_ms"][q] for q in ("p50", "p99")}

    classifier = default_classifier()
    calls = [1e3 * classifier.classify(text).seconds for text, _, _ in queries]
    return {
        "policy": "prefer(alpha=0)",
        "prompts": text_prompts_summary(queries),
        "runs": runs,
        "added_ttft_ms": added(given),  # the classifier alone
        "added_ttft_ms_vs_exact": added(exact),  # and the policy's plumbing
        "classify_ms": {"p50": percentile(calls, 50), "p99": percentile(calls, 99), "calls": len(calls)},
    }
