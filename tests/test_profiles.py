"""Expert capability profiles (router/policy/profiles.py): built from counts by domain, stored, read back; the
load window's counts by domain; and a request's routing as the router resolves it (serving/
request_routing.py): biases from the profile, the trained default classifier called once, only when
the policy needs a domain, under a ``classify`` span; the profiles file (``profile build --out``, ``profile
show --file``, ``up --profiles``) and its checks. Serving a file's profiles end to end:
tests/test_policy_serving.py."""

import json

import numpy as np
import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.classifier import default_classifier
from expertmesh.cli.main import build_parser, main
from expertmesh.config.settings import ServingConfig, settings_from_args
from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.contracts.load_window import LoadSnapshot, LoadWindow
from expertmesh.router.policy.profiles import (
    ProfileFileError,
    build_profiles,
    fit_problem,
    load_profiles,
    lookup,
    read_profiles_file,
    save_profiles,
    write_profiles_file,
)
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.store import open_store
from expertmesh.v1 import inference_pb2 as pb

LAYERS = (1, 3)


def _loads():
    code = np.array([[30.0, 10, 0, 0], [5, 5, 20, 10]])  # [L, E]
    legal = np.array([[0.0, 10, 20, 10], [10, 10, 10, 10]])
    return {"code": code, "legal": legal, "empty": np.zeros((2, 4))}


def test_shares_and_lifts_over_the_overall_share():
    profiles = build_profiles(_loads(), LAYERS)
    assert set(profiles) == {"code", "legal"}  # a domain with no tokens gets no profile
    code = profiles["code"]
    assert np.allclose(code.share.sum(axis=1), 1) and code.choices.tolist() == [40, 40]
    assert code.share[0].tolist() == [0.75, 0.25, 0, 0]
    # overall layer-1 shares: [30, 20, 20, 10] / 80
    assert np.allclose(code.lift[0], [0.75 / 0.375, 0.25 / 0.25, 0, 0])
    assert np.allclose(
        profiles["legal"].lift[1], [0.25 / (15 / 80), 0.25 / (15 / 80), 0.25 / (30 / 80), 0.25 / (20 / 80)]
    )
    assert lookup(profiles, "legal/contract") is profiles["legal"] and lookup(profiles, "medical") is None
    store = open_store("memory://")
    save_profiles(store, profiles)
    back = load_profiles(store)
    assert (
        set(back) == {"code", "legal"}
        and np.array_equal(back["code"].lift, code.lift)
        and back["code"].moe_layers == LAYERS
    )
    assert build_profiles({}, LAYERS) == {}


def test_the_load_window_counts_by_domain_since_start():
    window = LoadWindow(LAYERS, num_experts=4, top_k=2)
    index = torch.tensor([[0, 1], [2, 4], [1, 3]])  # [T, K]; 4 is the skip sentinel
    window.record(1, index, domains=(torch.tensor([0, 0, 1]), ("code", "legal")))
    window.record(3, index)  # no domains: counted in load only
    snap = window.snapshot()
    assert snap.domain_load["code"][0].tolist() == [1, 1, 1, 0] and snap.domain_load["legal"][0].tolist() == [
        0,
        1,
        0,
        1,
    ]
    assert snap.domain_load["code"][1].sum() == 0
    back = LoadSnapshot.from_bytes(snap.to_bytes())
    assert set(back.domain_load) == {"code", "legal"} and np.array_equal(
        back.domain_load["legal"], snap.domain_load["legal"]
    )
    assert (back + back).domain_load["code"][0].tolist() == [2, 2, 2, 0]
    assert snap.to_stats_dict()["domain_load"]["legal"][0] == [0, 1, 0, 1]


@pytest.fixture(scope="module")
def spans():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_a_request_is_classified_once_and_only_when_its_policy_needs_a_domain(spans):
    store = open_store("memory://")
    save_profiles(store, build_profiles(_loads(), LAYERS))
    classifier, texts = default_classifier(), []

    class Counted:  # the trained default classifier, counting its calls
        domains = classifier.domains

        def classify(self, text):
            texts.append(text)
            return classifier.classify(text)

    router = RequestRouter(2, 4, LAYERS, "exact", store, kl_bound=0.1, classifier=Counted)
    query = "Write a Python function that parses a JSON file and returns a dict"

    def resolve(routing_policy=None, domain=None):
        return router.resolve(routing_policy, domain, lambda: query)

    assert resolve() is None
    assert resolve(routing_policy=pb.RoutingPolicy(name="dynamic_k")).domain is None
    given = resolve(routing_policy=pb.RoutingPolicy(name="restrict", top_n=2), domain="legal")
    assert torch.isinf(given.biases[1]).tolist() == [True, False, False, True]  # legal's top 2 at layer 1: 2, then 1
    assert texts == [] and not [s for s in spans.get_finished_spans() if s.name == "classify"]

    classified = resolve(routing_policy=pb.RoutingPolicy(name="prefer", alpha=2))
    assert texts == [query] and classified.domain == "code"
    bias = classified.biases[1]
    assert torch.allclose(bias, torch.tensor([2 * 0.6, 0, -2, -2]), atol=1e-4)  # 2 tanh(log lift), lift [2, 1, 0, 0]
    (span,) = [s for s in spans.get_finished_spans() if s.name == "classify"]
    assert span.attributes["expertmesh.domain"] == "code" and 0 < span.attributes["expertmesh.confidence"] <= 1
    assert span.attributes["expertmesh.classify_ms"] > 0

    with pytest.raises(InvalidRequest, match="^domain: no capability profile for 'medical'"):
        resolve(routing_policy=pb.RoutingPolicy(name="prefer"), domain="medical")
    with pytest.raises(InvalidRequest, match="^domain: .*token-id prompt"):
        router.resolve(pb.RoutingPolicy(name="prefer"), None, lambda: None)


def test_the_domain_heatmap_shows_each_domains_share_per_expert():
    from expertmesh.observability.domain_heatmap import domain_frequency, render_domain_heatmap

    domains, freq = domain_frequency(_loads(), top_k=2)
    assert domains == ["code", "legal"] and freq.shape == (2, 2, 4)  # [L, D, E]; the empty domain is left out
    assert np.allclose(freq.sum(axis=2), 2) and freq[0, 0].tolist() == [1.5, 0.5, 0, 0]
    assert render_domain_heatmap(_loads(), LAYERS, top_k=2, model_name="tiny")[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no tokens"):
        render_domain_heatmap({"code": np.zeros((2, 4))}, LAYERS, top_k=2)


# -- the profiles file ---------------------------------------------------------------------------


def test_a_profiles_file_round_trips_and_reads_as_plan_and_show_write_it(tmp_path, capsys):
    profiles = build_profiles(_loads(), LAYERS)
    path = tmp_path / "profiles.json"
    write_profiles_file(path, profiles)
    records = json.loads(path.read_text())
    assert [r["domain"] for r in records] == ["code", "legal"]  # the JSON list `plan --profiles` reads
    back = read_profiles_file(path)
    assert set(back) == {"code", "legal"} and back["legal"].moe_layers == LAYERS
    for domain, profile in profiles.items():
        for name in ("choices", "share", "lift"):
            assert np.array_equal(getattr(back[domain], name), getattr(profile, name)), (domain, name)
    assert fit_problem(back, LAYERS, 4) is None
    assert "MoE layers [1, 3] x 4 experts; this one has MoE layers [1, 3] x 8" in fit_problem(back, LAYERS, 8)
    assert "built on another model" in fit_problem(back, (0, 1), 4)

    capsys.readouterr()
    assert main(["profile", "show", "--file", str(path), "--json"]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown)["code"]["share"] == profiles["code"].share.tolist()
    keyed = tmp_path / "keyed.json"  # what `profile show --json` prints reads back too
    keyed.write_text(shown)
    assert set(read_profiles_file(keyed)) == {"code", "legal"}
    assert main(["profile", "show", "--file", str(path), "--domain", "legal", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("legal  (40 expert choices per layer)") and "layer   1: e2 50% (x2.00)  e1 25% (x1.00)" in out


def _record(**change):
    record = build_profiles(_loads(), LAYERS)["code"].to_dict()
    return {**record, **change}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file or directory"),
        ("{", "not JSON (Expecting property name enclosed in double quotes, line 1)"),
        ("[]", "expected a non-empty JSON list of profile records"),
        ('"code"', "expected a non-empty JSON list of profile records"),
        ([3], "record 1: expected an object with domain, moe_layers, choices, share, lift"),
        ([{"domain": "code", "share": []}], "profile 'code': missing moe_layers, choices, lift"),
        ([_record(domain="")], "record 1: domain must be a non-empty string"),
        ([_record(moe_layers=[1, 1])], "profile 'code': moe_layers must be a non-empty list of distinct layer numbers"),
        ([_record(share=[[1.0, 0.0], [0.5]])], "profile 'code': share must be a [2 x experts] array of numbers"),
        ([_record(share=[[1.0, 0, 0, 0]])], "profile 'code': share must be a [2 x experts] array of numbers"),
        ([_record(choices=[40])], "profile 'code': choices must be a [2] array of numbers"),
        ([_record(lift=[[1, "x", 1, 1], [1, 1, 1, 1]])], "profile 'code': lift must be a [2 x experts] array"),
        ([_record(lift=[[1, -1, 1, 1], [1, 1, 1, 1]])], "profile 'code': lift must hold finite numbers >= 0"),
        ([_record(lift=[[1, 1], [1, 1]])], "profile 'code': lift is 2 x 2, share 2 x 4"),
        ([_record(share=[[0.5, 0.1, 0, 0], [0.25] * 4])], "profile 'code': each row of share must sum to 1"),
        ([_record(), _record()], "two profiles of 'code'"),
        (
            [_record(), _record(domain="legal", moe_layers=[1, 2])],
            "the profiles of 'code' and 'legal' were built on different models",
        ),
    ],
)
def test_a_bad_profiles_file_is_one_line_naming_what_is_wrong(tmp_path, capsys, content, message):
    path = tmp_path / "profiles.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ProfileFileError) as err:
        read_profiles_file(path)
    assert str(err.value).startswith(f"profiles file {path}: ") and message in str(err.value), str(err.value)
    capsys.readouterr()
    assert main(["profile", "show", "--file", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line


def test_up_takes_a_profiles_file_from_each_source_and_checks_it_before_starting(tmp_path, capsys, monkeypatch):
    path = tmp_path / "profiles.json"
    write_profiles_file(path, build_profiles(_loads(), LAYERS))
    monkeypatch.delenv("EXPERTMESH_PROFILES", raising=False)

    def profiles_setting(*argv):
        return settings_from_args(ServingConfig, build_parser().parse_args(["up", *map(str, argv)])).profiles

    config = tmp_path / "up.yaml"
    config.write_text(f"profiles: {path}\n")
    assert profiles_setting() is None
    assert profiles_setting("--config", config) == path
    monkeypatch.setenv("EXPERTMESH_PROFILES", str(tmp_path / "env.json"))
    assert profiles_setting("--config", config) == tmp_path / "env.json"  # the environment beats the file
    assert profiles_setting("--profiles", path) == path  # and a flag beats both
    monkeypatch.delenv("EXPERTMESH_PROFILES")

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    # a bad file fails before anything starts: the model named here does not even exist
    assert main(["up", "--model", str(tmp_path / "absent"), "--profiles", str(bad)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"profiles file {bad}: expected a non-empty JSON list" in line


def test_profile_commands_say_what_to_use_instead_of_a_memory_store(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("EXPERTMESH_STATE_URL", raising=False)
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"text": "hello", "domain": "general"}) + "\n")
    for argv, flag in (
        (["profile", "build", "--queries", str(queries), "--target", "127.0.0.1:1"], "--out FILE.json"),
        (["profile", "show"], "--file FILE.json"),
    ):
        capsys.readouterr()
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "memory:// is private to the router's process; use " + flag in line and "up --profiles" in line
    out = tmp_path / "absent" / "p.json"
    assert main(["profile", "build", "--queries", str(queries), "--out", str(out)]) == 2
    assert f"--out: {out.parent} is not a directory" in capsys.readouterr().err


def test_one_unreadable_profile_record_leaves_the_others_served():
    """A malformed record used to fail every non-exact request with UNKNOWN; now it alone is left out."""
    store = open_store("memory://")
    save_profiles(store, build_profiles(_loads(), LAYERS))
    store.save_profile("medical", b'{"domain": "medical", "moe_layers": "nope"}')
    store.save_profile("finance", b"not json")
    router = RequestRouter(2, 4, LAYERS, "exact", store, kl_bound=0.1, classifier=default_classifier)
    query = "Summarise this contract"
    given = router.resolve(pb.RoutingPolicy(name="prefer"), "legal", lambda: query)
    assert given.domain == "legal" and set(given.biases) == set(LAYERS)
    with pytest.raises(InvalidRequest, match="^domain: no capability profile for 'medical'"):
        router.resolve(pb.RoutingPolicy(name="prefer"), "medical", lambda: query)


def test_domains_are_bounded_in_length_and_to_the_taxonomy():
    router = RequestRouter(2, 4, LAYERS, "exact", open_store("memory://"), kl_bound=0.1, classifier=default_classifier)
    ok = router.resolve(None, "code/python-3.12", lambda: "x")
    assert ok.domain == "code/python-3.12"
    for domain, message in (
        ("code/" + "y" * 100, r"^domain: 105 characters, at most 64 \('code/yyyyyyyyyyyyyyyyyyyyyyyyyyy'\.\.\.\)$"),
        ("astrology", "unknown domain 'astrology'"),
        ("code/a/b", "unknown domain 'code/a/b'"),
        ("code/", "unknown domain 'code/'"),
        ("", "unknown domain ''"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            router.resolve(None, domain, lambda: "x")


def test_a_load_window_counts_at_most_max_domains_apart():
    from expertmesh.contracts import load_window

    window = LoadWindow(LAYERS, 4, 2)
    names = tuple(f"code/{i}" for i in range(load_window.MAX_DOMAINS + 10))
    index = torch.tensor([[0, 1]] * len(names))
    window.record(1, index, None, (torch.arange(len(names)), names))
    snap = window.snapshot()
    assert len(snap.domain_load) == load_window.MAX_DOMAINS + 1  # the cap, and "code" for the rest
    assert snap.domain_load["code"][0].sum() == 10 * 2


def test_configured_defaults_carry_parameters_and_each_domain_may_have_its_own():
    store = open_store("memory://")
    save_profiles(store, build_profiles(_loads(), LAYERS))
    classifier, texts = default_classifier(), []

    class Counted:
        domains = classifier.domains

        def classify(self, text):
            texts.append(text)
            return classifier.classify(text)

    router = RequestRouter(
        2,
        4,
        LAYERS,
        "delta_gap(delta=0.3)",
        store,
        kl_bound=0.1,
        classifier=Counted,
        domain_policies={"legal": "restrict(top_n=2)", "code": "confidence_k(k_max=3)"},
    )
    assert router.default.spec == "delta_gap(delta=0.3,weight_boost=1.2)"
    assert {d: p.spec for d, p in router.domain_defaults.items()} == {
        "legal": "restrict(top_n=2)",
        "code": "confidence_k(k_min=1,k_max=3)",
    }
    query = "Write a Python function that parses a JSON file and returns a dict"

    def resolve(routing_policy=None, domain=None, text=query):
        return router.resolve(routing_policy, domain, lambda: text)

    code = resolve()  # no policy, no domain: classified (code), then code's default
    assert texts == [query] and code.domain == "code" and code.policy.key == "confidence_k(k_min=1,k_max=3)"
    legal = resolve(domain="legal/contract")  # a domain below legal: legal's default, not classified again
    assert legal.policy.name == "restrict" and legal.policy.top_n == 2 and len(texts) == 1
    assert resolve(domain="medical").policy.key == "delta_gap(delta=0.3,weight_boost=1.2)"  # the server's
    assert resolve(text=None).policy.key == "delta_gap(delta=0.3,weight_boost=1.2)"  # token ids: the server's
    # a policy without a name is the default with the parameters the request sets in place of the configured
    assert resolve(pb.RoutingPolicy(weight_boost=1.5), domain="medical").policy.key == (
        "delta_gap(delta=0.3,weight_boost=1.5)"
    )
    assert resolve(pb.RoutingPolicy(top_n=3), domain="legal").policy.top_n == 3
    with pytest.raises(InvalidRequest, match="^routing_policy.threshold: is a parameter of dynamic_k"):
        resolve(pb.RoutingPolicy(threshold=0.1), domain="legal")
    named = resolve(pb.RoutingPolicy(name="dynamic_k"))  # a named policy: no default to choose, no classifying
    assert named.domain is None and len(texts) == 1
    # a bad configured policy or domain stops the server at start, naming the setting and the field
    for default, domains, expected in (
        ("delta_gap(delta=2)", {}, r"--routing-policy.*routing_policy\.delta: must be a number in \[0, 1\]"),
        ("delta_gap(delta=)", {}, r"routing_policy\.delta: expected delta=NUMBER"),
        ("exact", {"legal": "bogus"}, r"--domain-routing-policies.*domain 'legal'.*routing_policy\.name"),
        ("exact", {"astrology": "exact"}, r"--domain-routing-policies.*unknown domain 'astrology'"),
    ):
        with pytest.raises(ExpertMeshError, match=expected):
            RequestRouter(2, 4, LAYERS, default, store, 0.1, classifier=Counted, domain_policies=domains)
