"""Routing policies end to end: real Ray Serve expert groups, the router's engine, its gRPC server, a
real redis-server as the shared state store, `expertmesh profile build / show` and `heatmap --by
domain` as a user runs them, and the trained default query classifier; and the embedded default's
way to profiles: `profile build --out FILE`, then a router over an in-process store started with them."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2
import numpy as np
import pytest
from transformers import AutoTokenizer

from expertmesh.cli.main import main
from expertmesh.client import Client
from expertmesh.config.settings import DataPlaneConfig, ServingConfig
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.platform.data_plane import DataPlane
from expertmesh.platform.router_apis import serve_plane, start_apis
from expertmesh.router.policy.profiles import ProfileFileError, build_profiles, read_profiles_file, write_profiles_file
from expertmesh.router.policy.quality import PolicyQuality, QualityFigures
from expertmesh.store import open_store
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

QUERIES = [
    {"text": "Write a Python function that reverses a linked list in place.", "domain": "code"},
    {"text": "Fix the TypeError in this JavaScript: const x = undefined.length;", "domain": "code"},
    {"text": "Refactor this SQL query to use a join instead of a subquery.", "domain": "code"},
    {"text": "Is a verbal agreement to sell land enforceable under contract law?", "domain": "legal"},
    {"text": "Draft an indemnification clause for a software licence agreement.", "domain": "legal"},
    {"text": "What remedies does a tenant have if the landlord breaches the lease?", "domain": "legal"},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_url):
    checkpoint = make_tiny_checkpoint(
        "mixtral", tmp_path_factory.mktemp("ckpt"), with_tokenizer=True, vocab_size=300, max_position_embeddings=96
    )
    plane = DataPlane.start(DataPlaneConfig(model=checkpoint, groups=2, state_url=redis_url))
    apis = start_apis(plane, ServingConfig(port=0, http_port=0, max_new_tokens_cap=32, policy_kl_bound=0.5))
    try:
        yield plane, apis, f"127.0.0.1:{apis.grpc.port}", redis_url
    finally:
        apis.drain_and_stop()
        plane.close()


def _tokens(client, prompt, **kwargs):
    chunks = list(client.generate(prompt, max_new_tokens=6, stop_at_eos=False, **kwargs))
    assert chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids]


def _refused_once_read(client, policy, detail: str, never: str, timeout_s: float = 60.0) -> None:
    """``policy`` is refused (INVALID_ARGUMENT naming ``detail``) once the router has read a quality record just
    saved: routers re-read records every few seconds, so it is asked again until then, for ``timeout_s`` at most
    however fast a request is answered (``never`` if it never is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _tokens(client, "Hello", routing_policy=policy)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in err.details()
            return
        time.sleep(0.05)
    pytest.fail(never)


def _refused(client, prompt, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _tokens(client, prompt, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def test_list_models_lists_the_policies_with_their_ranges(served):
    _, _, target, _ = served
    with grpc.insecure_channel(target) as channel:
        response = pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
    assert response.default_routing_policy == "exact"
    policies = {p.name: p for p in response.routing_policies}
    assert {"exact", "prefer", "restrict", "delta_gap", "dynamic_k", "prefer+dynamic_k"} <= set(policies)
    assert (
        not policies["exact"].parameters and policies["prefer"].needs_domain and not policies["dynamic_k"].needs_domain
    )
    top_n = next(p for p in policies["restrict"].parameters if p.name == "top_n")
    assert (top_n.min, top_n.max, top_n.integer) == (2, 4, True)  # top-k 2 of 4 experts
    delta = next(p for p in policies["delta_gap"].parameters if p.name == "delta")
    assert delta.default_value == pytest.approx(0.18)


def test_bad_policies_and_domains_are_refused_naming_the_field(served):
    _, _, target, _ = served
    with Client(target, timeout=60) as client:
        cases = [
            ({"routing_policy": "bogus"}, "routing_policy.name"),
            ({"routing_policy": "prefer+restrict"}, "routing_policy.name"),
            ({"routing_policy": pb.RoutingPolicy(name="prefer", alpha=9)}, "routing_policy.alpha"),
            ({"routing_policy": pb.RoutingPolicy(name="delta_gap", delta=-1)}, "routing_policy.delta"),
            ({"routing_policy": pb.RoutingPolicy(name="dynamic_k", threshold=2)}, "routing_policy.threshold"),
            ({"routing_policy": pb.RoutingPolicy(name="restrict", top_n=1)}, "routing_policy.top_n"),
            ({"routing_policy": pb.RoutingPolicy(name="dynamic_k", alpha=1)}, "routing_policy.alpha"),
            ({"domain": "astrology"}, "domain"),
            ({"routing_policy": "prefer", "domain": "medical"}, "domain"),  # no profile for it
            # a client-chosen label under a known domain: unbounded, it grew every load window for good
            ({"domain": "code/" + "x" * 200_000}, "domain"),
            ({"routing_policy": "delta_gap", "domain": "code/" + "x" * 200_000}, "domain"),
            ({"domain": "code/a/b"}, "domain"),
            ({"domain": "code/<script>"}, "domain"),
        ]
        for kwargs, field in cases:
            details = _refused(client, "Hello there", **kwargs)
            assert details.startswith(field + ":") or f"{field}:" in details, (kwargs, details)
            assert len(details) < 400, f"the refusal echoes the label back: {len(details)} characters"
        assert len(_tokens(client, "Hello there")) == 6  # and the server serves on


def test_exact_with_a_domain_is_counted_and_routes_as_stock(served):
    _, _, target, _ = served
    with Client(target, timeout=60) as client:
        plain = _tokens(client, "The court held that")
        before = json.loads(client.load_stats()).get("domain_load", {}).get("legal")
        assert _tokens(client, "The court held that", domain="legal", routing_policy="exact") == plain
        after = json.loads(client.load_stats())["domain_load"]["legal"]
    added = sum(map(sum, after)) - (sum(map(sum, before)) if before else 0)
    assert added > 0


def test_profiles_build_show_heatmap_and_the_policies_that_use_them(served, tmp_path, capsys):
    plane, _, target, redis_url = served
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    assert main(["profile", "build", "--queries", str(queries), "--target", target, "--state-url", redis_url]) == 0
    stored = set(plane.store.profiles())
    assert {"code", "legal"} <= stored
    capsys.readouterr()
    assert main(["profile", "show", "--state-url", redis_url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    share = shown["code"]["share"]
    assert len(share) == 2 and all(abs(sum(row) - 1) < 1e-9 for row in share)
    png = tmp_path / "domains.png"
    assert main(["heatmap", "--by", "domain", "--target", target, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["profile", "show", "--state-url", "memory://"]) == 2

    with Client(target, timeout=120) as client:
        for kwargs in (
            {"routing_policy": "prefer", "domain": "code"},
            {"routing_policy": pb.RoutingPolicy(name="restrict", top_n=2), "domain": "legal/contract"},
            {"routing_policy": "delta_gap"},
            {"routing_policy": pb.RoutingPolicy(name="dynamic_k", threshold=1.0)},
            {"routing_policy": "prefer+dynamic_k", "domain": "legal"},
            {"routing_policy": "prefer"},  # no domain: the classifier labels it (code), which has a profile
        ):
            assert len(_tokens(client, "def reverse(items): return", **kwargs)) == 6, kwargs


def test_a_profiles_file_serves_prefer_on_an_in_process_store(served, tmp_path, capsys, monkeypatch):
    """`profile build --out` against a router, then what `expertmesh up --profiles FILE` does on the embedded
    default's memory:// store (ServingConfig.profiles, loaded by serve_plane): here a second router over
    the same expert groups, attached to a memory:// store of its own, so no second set of groups starts."""
    plane, _, target, _ = served
    monkeypatch.delenv("EXPERTMESH_STATE_URL", raising=False)
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    profiles = tmp_path / "profiles.json"
    argv = [
        "profile",
        "build",
        "--queries",
        str(queries),
        "--target",
        target,
        "--max-tokens",
        "2",
        "--out",
        str(profiles),
    ]
    assert main(argv) == 0
    assert f"in {profiles}" in capsys.readouterr().err
    assert set(read_profiles_file(profiles)) == {"code", "legal"}

    store = open_store("memory://")
    assert store.publish_routing_table(plane.store.routing_table())
    for group, address in plane.store.endpoints().items():
        store.set_endpoint(group, address)
    with DataPlane.attach(DataPlaneConfig(model=plane.checkpoint.path, state_url="memory://"), store=store) as embedded:
        other = tmp_path / "other.json"  # profiles of another model are refused at start, before serving
        write_profiles_file(other, build_profiles({"code": np.ones((1, 4))}, (0,)))
        with pytest.raises(
            ProfileFileError, match=r"built on another model \(MoE layers \[0\] x 4 experts; this one has"
        ):
            serve_plane(embedded, ServingConfig(port=0, profiles=other))
        server = serve_plane(embedded, ServingConfig(port=0, max_new_tokens_cap=32, profiles=profiles))
        try:
            assert set(embedded.store.profiles()) == {"code", "legal"}
            with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
                for kwargs in (
                    {"routing_policy": "prefer"},  # classified (code), biased by the file's profile
                    {"routing_policy": pb.RoutingPolicy(name="restrict", top_n=2), "domain": "legal"},
                ):
                    assert len(_tokens(client, "def reverse(items): return", **kwargs)) == 6, kwargs
                details = _refused(client, "Hello", routing_policy="prefer", domain="medical")
                assert "no capability profile for 'medical'" in details  # only the file's domains are there
        finally:
            server.drain_and_stop()


def test_the_quality_guard_refuses_a_recorded_bad_policy_unless_forced(served):
    plane, _, target, _ = served
    record = PolicyQuality("delta_gap(delta=0.3,weight_boost=1.2)", QualityFigures(2.0, 0.5, 0.5, 0.0, 10))
    plane.store.save_policy_quality(record.policy, record.to_json().encode())
    policy = pb.RoutingPolicy(name="delta_gap", delta=0.3)
    with Client(target, timeout=60) as client:
        _refused_once_read(client, policy, "routing_policy", "the recorded KL never made the router refuse the policy")
        forced = pb.RoutingPolicy(name="delta_gap", delta=0.3, force=True)
        assert len(_tokens(client, "Hello", routing_policy=forced)) == 6
        assert len(_tokens(client, "Hello", routing_policy=pb.RoutingPolicy(name="delta_gap", delta=0.2))) == 6


def test_policy_eval_reports_per_domain_and_records_for_the_guard(served, tmp_path, capsys):
    plane, _, target, redis_url = served
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    common = ["--queries", str(queries), "--target", target, "--max-tokens", "4", "--json"]

    capsys.readouterr()
    assert main(["policy", "eval", "--policy", "exact", *common]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["recorded"] is None and set(same["per_domain"]) == {"code", "legal"}
    assert (
        same["overall"]["kl"] == 0
        and same["overall"]["top1_agreement"] == 1
        and same["overall"]["greedy_agreement"] == 1
    )
    assert same["overall"]["saved_params_per_token"] == 0

    assert main(["policy", "eval", "--policy", "delta_gap", "--delta", "0", *common, "--state-url", redis_url]) == 0
    narrow = json.loads(capsys.readouterr().out)
    assert narrow["policy"] == "delta_gap(delta=0,weight_boost=1.2)" and narrow["recorded"] == redis_url
    assert narrow["overall"]["kl"] > 0 and narrow["overall"]["saved_params_per_token"] > 0  # top-1 instead of top-2
    assert PolicyQuality.from_json(plane.store.policy_quality()[narrow["policy"]]).overall.kl == pytest.approx(
        narrow["overall"]["kl"]
    )

    assert main(["policy", "eval", "--policy", "dynamic_k", "--threshold", "1", *common]) == 0
    wide = json.loads(capsys.readouterr().out)
    assert wide["overall"]["saved_params_per_token"] < 0  # top-3 instead of top-2 costs parameters

    assert main(["policy", "eval", "--policy", "delta_gap", "--alpha", "1", *common]) == 2  # not a delta_gap parameter

    # The consistency guard beside it: threshold 0 never rolls back, so the guarded answers are the plain ones.
    assert main(["policy", "eval", "--policy", "delta_gap", "--delta", "0", *common, "--guard", "self",
                 "--guard-threshold", "0"]) == 0  # fmt: skip
    guard = json.loads(capsys.readouterr().out)["consistency_guard"]
    assert guard["scorer"] == "self" and guard["threshold"] == 0 and guard["positions"] == 4 * len(QUERIES)
    assert guard["bad_rate_guarded"] == guard["bad_rate"] == pytest.approx(1 - narrow["overall"]["greedy_agreement"])
    assert guard["ms_per_token"] > 0 and guard["ms_per_token_guarded"] > 0


def test_the_http_api_takes_the_same_extras(served):
    plane, apis, _, _ = served
    name = plane.checkpoint.path.name
    url = f"{apis.http.url}/v1/completions"
    body = {"model": name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    ok = httpx2.post(
        url, json={**body, "routing_policy": {"name": "dynamic_k", "threshold": 0.5}, "domain": "code"}, timeout=60
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx2.post(url, json={**body, "routing_policy": "delta_gap"}, timeout=60).status_code == 200
    for extra, param in (
        ({"routing_policy": "bogus"}, "routing_policy.name"),
        ({"routing_policy": {"name": "prefer", "alpha": 7.0}, "domain": "code"}, "routing_policy.alpha"),
        ({"domain": "astrology"}, "domain"),
        ({"domain": "code/" + "x" * 1000}, "domain"),
        ({"routing_policy": {"name": "restrict", "top_n": 2**40}, "domain": "code"}, "routing_policy.top_n"),
        ({"routing_policy": {"name": "restrict", "top_n": -1}, "domain": "code"}, "routing_policy.top_n"),
    ):
        bad = httpx2.post(url, json={**body, **extra}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_the_consistency_guard_over_both_apis_rolls_back_and_refuses_what_it_cannot_take(served):
    """A guard that fails every check (threshold 1) computes its first two tokens again, over gRPC and HTTP alike
    (the same tokens); exact routing is never guarded; a bad guard is refused naming its field."""
    plane, apis, target, _ = served
    guard = pb.ConsistencyGuard(scorer="self", threshold=1.0, max_regenerations=2)
    with Client(target, timeout=120) as client:
        exact = _tokens(client, "Hello there")
        assert _tokens(client, "Hello there", consistency_guard=guard) == exact, "exact is never guarded"
        guarded = _tokens(client, "Hello there", routing_policy="delta_gap", consistency_guard=guard)
        assert "consistency_guard.scorer: unknown scorer 'cosine'" in _refused(
            client, "x", routing_policy="delta_gap", consistency_guard="cosine"
        )
    url = f"{apis.http.url}/v1/completions"
    body = {"model": plane.checkpoint.path.name, "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    answer = httpx2.post(
        url,
        json={
            **body,
            "ignore_eos": True,
            "routing_policy": "delta_gap",
            "consistency_guard": {"scorer": "self", "threshold": 1.0, "max_regenerations": 2},
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(plane.checkpoint.path).decode(guarded)
    bad = httpx2.post(
        url,
        json={**body, "routing_policy": "delta_gap", "consistency_guard": {"scorer": "self", "threshold": 3}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "consistency_guard.threshold", bad.text


#: confidence_k, adaptive_k, noisy_topk and sticky, alone and together, as a gRPC client sends them
NEW_RULES = [
    pb.RoutingPolicy(name="confidence_k", k_max=3),
    pb.RoutingPolicy(name="adaptive_k", queue_slo_ms=0),  # always at its floor: top-1
    pb.RoutingPolicy(name="adaptive_k"),  # nothing queued: top-k
    pb.RoutingPolicy(name="noisy_topk", noise_scale=1.0),
    pb.RoutingPolicy(name="sticky", sticky_strength=2.0, sticky_decay=0.3),
    pb.RoutingPolicy(name="confidence_k+noisy_topk+sticky", k_min=1, k_max=2),
]


def test_confidence_k_adaptive_k_noisy_topk_and_sticky_over_grpc(served):
    _, _, target, _ = served
    with grpc.insecure_channel(target) as channel:
        listed = pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).routing_policies
    policies = {p.name: {q.name: q for q in p.parameters} for p in listed}
    assert set(policies["confidence_k"]) == {"k_min", "k_max"}
    assert policies["confidence_k"]["k_min"].rule == "confidence_k"  # k_min is read by decay_k and adaptive_k too
    k_max = policies["confidence_k"]["k_max"]
    assert (k_max.default_value, k_max.min, k_max.max, k_max.integer) == (2, 1, 3, True)  # top-k 2 (+1) of 4
    assert set(policies["adaptive_k"]) == {"k_min", "queue_slo_ms"} and policies["adaptive_k"]["k_min"].max == 4
    assert set(policies["noisy_topk"]) == {"noise_scale"}
    assert set(policies["sticky"]) == {"sticky_strength", "sticky_decay"}
    assert "restrict+adaptive_k+capacity+noisy_topk+sticky" in policies
    with Client(target, timeout=120) as client:
        for policy in NEW_RULES:
            assert len(_tokens(client, "def reverse(items): return", routing_policy=policy, domain="code")) == 6, policy
        # noisy_topk is seeded per request: the sampling seed, else the request id; the same request, the same answer
        noisy = pb.RoutingPolicy(name="noisy_topk", noise_scale=3.0)
        sampled = {"routing_policy": noisy, "temperature": 0.8, "seed": 17}
        assert _tokens(client, "The court held that", **sampled) == _tokens(client, "The court held that", **sampled)
        named = {"routing_policy": noisy, "request_id": "noisy-1"}
        assert _tokens(client, "The court held that", **named) == _tokens(client, "The court held that", **named)
        for kwargs, field in (
            ({"routing_policy": pb.RoutingPolicy(name="confidence_k", k_max=5)}, "routing_policy.k_max"),
            ({"routing_policy": pb.RoutingPolicy(name="confidence_k", k_min=3)}, "routing_policy.k_min"),
            ({"routing_policy": pb.RoutingPolicy(name="adaptive_k", k_min=3)}, "routing_policy.k_min"),
            ({"routing_policy": pb.RoutingPolicy(name="adaptive_k", queue_slo_ms=-5)}, "routing_policy.queue_slo_ms"),
            ({"routing_policy": pb.RoutingPolicy(name="noisy_topk", noise_scale=9)}, "routing_policy.noise_scale"),
            ({"routing_policy": pb.RoutingPolicy(name="sticky", sticky_decay=1.5)}, "routing_policy.sticky_decay"),
            ({"routing_policy": pb.RoutingPolicy(name="sticky", k_max=2)}, "routing_policy.k_max"),
            ({"routing_policy": "adaptive_k+decay_k"}, "routing_policy.name"),
        ):
            details = _refused(client, "Hello there", **kwargs)
            assert details.startswith(field + ":"), (kwargs, details)


def test_confidence_k_adaptive_k_noisy_topk_and_sticky_over_http(served):
    plane, apis, _, _ = served
    url = f"{apis.http.url}/v1/completions"
    body = {"model": plane.checkpoint.path.name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    for policy in (
        {"name": "confidence_k", "k_max": 3},
        {"name": "adaptive_k", "queue_slo_ms": 0, "k_min": 1},
        {"name": "noisy_topk", "noise_scale": 1.0},
        {"name": "sticky", "sticky_strength": 2.0, "sticky_decay": 0.3},
        "confidence_k+noisy_topk+sticky",
    ):
        ok = httpx2.post(url, json={**body, "routing_policy": policy}, timeout=60)
        assert ok.status_code == 200, (policy, ok.text)
        assert ok.json()["usage"]["completion_tokens"] >= 1
    noisy = {**body, "routing_policy": {"name": "noisy_topk", "noise_scale": 3.0}, "temperature": 0.8, "seed": 5}
    first, second = (httpx2.post(url, json=noisy, timeout=60) for _ in range(2))
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    for policy, param in (
        ({"name": "confidence_k", "k_max": 2**40}, "routing_policy.k_max"),
        ({"name": "confidence_k", "k_max": 7}, "routing_policy.k_max"),
        ({"name": "sticky", "sticky_decay": 2.0}, "routing_policy.sticky_decay"),
        ({"name": "noisy_topk", "noise_scale": -1.0}, "routing_policy.noise_scale"),
        ({"name": "adaptive_k", "queue_slo_ms": "soon"}, "routing_policy.queue_slo_ms"),
    ):
        bad = httpx2.post(url, json={**body, "routing_policy": policy}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_policy_eval_measures_the_new_rules_and_adaptive_k_at_its_floor(served, tmp_path, capsys):
    plane, _, target, redis_url = served
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    common = ["--queries", str(queries), "--target", target, "--max-tokens", "4", "--json"]
    capsys.readouterr()
    # adaptive_k is measured at its floor (SLO 0: top-1 here) and recorded under a key without the SLO
    argv = ["policy", "eval", "--policy", "adaptive_k", "--queue-slo-ms", "800", *common, "--state-url", redis_url]
    assert main(argv) == 0
    floor = json.loads(capsys.readouterr().out)
    assert floor["policy"] == "adaptive_k(k_min=1)" and floor["recorded"] == redis_url
    assert floor["overall"]["kl"] > 0 and floor["overall"]["saved_params_per_token"] > 0
    for argv, key in (
        (["--policy", "confidence_k", "--k-max", "3"], "confidence_k(k_min=1,k_max=3)"),
        (["--policy", "noisy_topk", "--noise-scale", "1"], "noisy_topk(noise_scale=1)"),
        (["--policy", "sticky", "--sticky-strength", "2"], "sticky(sticky_strength=2,sticky_decay=0.5)"),
    ):
        assert main(["policy", "eval", *argv, *common]) == 0
        measured = json.loads(capsys.readouterr().out)
        assert measured["policy"] == key and measured["overall"]["positions"] > 0
        assert measured["overall"]["kl"] >= 0 and 0 <= measured["overall"]["top1_agreement"] <= 1
    # the KL guard holds adaptive_k by its floor's record, whatever SLO a request names
    record = PolicyQuality("adaptive_k(k_min=1)", QualityFigures(2.0, 0.5, 0.5, 0.0, 10))
    plane.store.save_policy_quality(record.policy, record.to_json().encode())
    lenient = pb.RoutingPolicy(name="adaptive_k", queue_slo_ms=60_000)
    with Client(target, timeout=60) as client:
        _refused_once_read(
            client, lenient, "adaptive_k(k_min=1)", "the floor's recorded KL never made the router refuse adaptive_k"
        )


def test_the_servers_default_policy_takes_parameters_and_each_domain_its_own_default(served, monkeypatch):
    """A router started with a default policy with parameters and per-domain defaults (what --routing-policy,
    --domain-routing-policies and the chart's values set): a request that names no policy gets its domain's
    default (its own, or classified), else the server's, with the configured parameters; ListModels says so."""
    plane, _, _, _ = served
    monkeypatch.delenv("EXPERTMESH_STATE_URL", raising=False)
    store = open_store("memory://")
    assert store.publish_routing_table(plane.store.routing_table())
    for group, address in plane.store.endpoints().items():
        store.set_endpoint(group, address)
    config = ServingConfig(
        port=0,
        http_port=0,
        max_new_tokens_cap=32,
        routing_policy="delta_gap(delta=0)",
        domain_routing_policies={"legal": "adaptive_k(queue_slo_ms=0)", "code": "confidence_k(k_max=3)"},
    )
    with DataPlane.attach(DataPlaneConfig(model=plane.checkpoint.path, state_url="memory://"), store=store) as embedded:
        apis = start_apis(embedded, config)
        try:
            target = f"127.0.0.1:{apis.grpc.port}"
            with grpc.insecure_channel(target) as channel:
                listed = pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
            assert listed.default_routing_policy == "delta_gap"
            assert listed.default_routing_policy_spec == "delta_gap(delta=0,weight_boost=1.2)"
            assert dict(listed.domain_routing_policies) == {
                "legal": "adaptive_k(k_min=1,queue_slo_ms=0)",
                "code": "confidence_k(k_min=1,k_max=3)",
            }
            prompt = "The court held that"
            with Client(target, timeout=120) as client:
                for domain, named in (
                    ("legal/contract", pb.RoutingPolicy(name="adaptive_k", queue_slo_ms=0)),
                    ("medical", pb.RoutingPolicy(name="delta_gap", delta=0)),
                    ("code", pb.RoutingPolicy(name="confidence_k", k_max=3)),
                ):
                    by_default = _tokens(client, prompt, domain=domain)
                    assert by_default == _tokens(client, prompt, routing_policy=named, domain=domain), domain
                # no domain: classified, then its domain's default
                assert len(_tokens(client, "def reverse(items): return")) == 6
            url = f"{apis.http.url}/v1/completions"
            body = {"model": plane.checkpoint.path.name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            answer = httpx2.post(url, json={**body, "domain": "legal", "ignore_eos": True}, timeout=60)
            assert answer.status_code == 200, answer.text
        finally:
            apis.drain_and_stop()


def test_decay_k_at_its_default_and_widest_is_served_by_the_groups_and_wider_is_refused(served):
    """decay_k's k_start is bounded by what an expert group takes per token (top-k + 1): its default and its
    widest are served by the real group processes, beside an exact request, and one wider is refused as the
    request's own INVALID_ARGUMENT. Before, the default (4 on this top-2 model) was sent to the groups, which
    refused the whole step's Dispatch: every request in that step failed."""
    _, _, target, _ = served
    with grpc.insecure_channel(target) as channel:
        listed = pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).routing_policies
    k_start = {q.name: q for p in listed if p.name == "decay_k" for q in p.parameters}["k_start"]
    assert (k_start.default_value, k_start.max) == (3, 3)  # top-k 2 + 1, of 4 experts
    with Client(target, timeout=120) as client:
        exact = _tokens(client, "The court held that")
        with ThreadPoolExecutor(2) as pool:
            beside = pool.submit(_tokens, client, "The court held that")
            assert len(_tokens(client, "def reverse(items): return", routing_policy="decay_k")) == 6
            assert beside.result() == exact
        widest = pb.RoutingPolicy(name="decay_k", k_start=3, decay=1.0)
        assert len(_tokens(client, "def reverse(items): return", routing_policy=widest)) == 6
        details = _refused(client, "Hello", routing_policy=pb.RoutingPolicy(name="decay_k", k_start=4))
        assert details.startswith("routing_policy.k_start:"), details


def test_the_health_round_action_wires_the_load_window_and_the_store(served, monkeypatch):
    """``anomaly_action: health_round`` as serve_plane wires it: the router's anomaly monitor reads its
    dispatcher's load window (the load-share signal) and hands anomaly records to a publisher that writes the
    router's store (a second router over the same groups, on a memory:// store of its own)."""
    from expertmesh.router.reporting.anomaly_monitor import AnomalyMonitor
    from expertmesh.store import AnomalyRecord

    plane, _, _, _ = served
    monkeypatch.delenv("EXPERTMESH_STATE_URL", raising=False)
    store = open_store("memory://")
    assert store.publish_routing_table(plane.store.routing_table())
    for group, address in plane.store.endpoints().items():
        store.set_endpoint(group, address)
    with DataPlane.attach(DataPlaneConfig(model=plane.checkpoint.path, state_url="memory://"), store=store) as embedded:
        server = serve_plane(embedded, ServingConfig(port=0, max_new_tokens_cap=32, anomaly_action="health_round"))
        try:
            monitor: AnomalyMonitor = server.engine.anomalies
            assert monitor._load is embedded.dispatcher.load_window and monitor._publish is not None
            with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
                assert len(_tokens(client, "def reverse(items): return")) == 6
            monitor._publish(AnomalyRecord("", 0, "load_share", 0, ((0, 1),), 1.0, 0.6, 0.25, 0.02, 3.0))
            deadline = time.monotonic() + 60
            while not store.anomalies():
                assert time.monotonic() < deadline, "the router's publisher never wrote the record"
                time.sleep(0.05)
            (record,) = store.anomalies()
            assert record.seq == 1 and record.pairs == ((0, 1),) and record.router_id
        finally:
            server.drain_and_stop()
