"""Canaries end to end: `expertmesh up` (real Ray Serve expert groups, the router's engine, its gRPC and HTTP
APIs, /metrics) and `expertmesh policy canary start|status|promote|stop` as an operator runs them. Requests split
by key (sticky), each arm's figures in the status and in /metrics, sampled shadow recomputes that leave the arm's
answer as it was, a candidate that disagrees with exact stopped by itself, promotion, and bad input refused naming
the setting."""

import json
import re

import grpc
import httpx2
import pytest

from expertmesh.cli.main import main
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.router.policy.canary import BASELINE, CANDIDATE, arm_of
from expertmesh.serving.canary import CANARY_KEY
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc
from helpers import Up

pytestmark = pytest.mark.slow

#: one expert per token: a candidate whose answers differ from exact routing's on the tiny model
ONE_EXPERT = ["--policy", "decay_k", "--param", "k_start=1", "--param", "decay=1", "--param", "k_min=1"]
ONE_EXPERT_POLICY = pb.RoutingPolicy(name="decay_k", k_start=1, decay=1, k_min=1)
PROMPT = "Hello there"
TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_ray_address):
    # weights 25x the usual init's scale: the routed experts then decide the answer, so a policy changes it
    checkpoint = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("canary") / "model",
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=96,
        initializer_range=0.5,
    )
    up = Up("--model", str(checkpoint), "--http-port", "0", "--max-new-tokens-cap", "32",
            "--ray-address", shared_ray_address)  # fmt: skip
    channel = grpc.insecure_channel(up.target)
    try:
        url = up.wait_for_stderr(r"OpenAI-compatible HTTP API on (\S+)/v1").group(1)
        yield up, url, up.target, pb_grpc.InferenceStub(channel), "model"
    finally:
        channel.close()
        if up.proc.poll() is None:
            up.stop()


def _tokens(stub, key: str | None = None, prompt: str = PROMPT, policy: pb.RoutingPolicy | None = None) -> list[int]:
    request = pb.GenerateRequest(text=prompt, max_new_tokens=TOKENS, stop_at_eos=False)
    if policy is not None:
        request.routing_policy.CopyFrom(policy)
    metadata = [(CANARY_KEY, key)] if key is not None else []
    return [t for r in stub.Generate(request, timeout=120, metadata=metadata) for t in r.delta.token_ids]


def _canary(capsys, target: str, action: str, *args: str) -> dict:
    """`expertmesh policy canary ACTION --json`'s status."""
    capsys.readouterr()
    assert main(["policy", "canary", action, "--target", target, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _refused(capsys, target: str, action: str, *args: str) -> str:
    """The one-line error of a canary command that exits 2."""
    capsys.readouterr()
    assert main(["policy", "canary", action, "--target", target, *args]) == 2
    return capsys.readouterr().err


def _arms(status: dict) -> dict[str, dict]:
    return {arm["arm"]: arm for arm in status["arms"]}


def _keys(arm: str, share: float, count: int) -> list[str]:
    return [k for k in (f"user-{i}" for i in range(1000)) if arm_of(k, share) == arm][:count]


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the series ``name`` with (at least) ``labels`` in a Prometheus exposition."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_a_canary_splits_default_traffic_by_key_and_reports_each_arm(served, capsys):
    up, url, target, stub, model = served
    exact = _tokens(stub, policy=pb.RoutingPolicy(name="exact"))
    one_expert = _tokens(stub, policy=ONE_EXPERT_POLICY)
    assert one_expert != exact, "the candidate must answer differently for the split to show"
    status = _canary(capsys, target, "start", *ONE_EXPERT, "--share", "0.5", "--sample-every", "1",
                     "--min-agreement", "0")  # fmt: skip
    assert status["state"] == "running" and status["candidate"] == "decay_k(k_start=1,decay=1,k_min=1)"
    assert status["baseline"] == "exact" and status["share"] == 0.5
    candidates, baselines = _keys(CANDIDATE, 0.5, 3), _keys(BASELINE, 0.5, 2)
    for _ in range(2):  # sticky: a key's second request lands where its first did
        for key in candidates:
            assert _tokens(stub, key) == one_expert, f"{key}: the candidate's answer, the shadow samples aside"
        for key in baselines:
            assert _tokens(stub, key) == exact, f"{key}: the default's answer"
    # a request that names its own policy is in neither arm, whatever its key
    assert _tokens(stub, candidates[0], policy=pb.RoutingPolicy(name="exact")) == exact
    # the HTTP API: the header's key, else the body's user
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS}
    by_header = httpx2.post(
        f"{url}/v1/completions", json={**body, "temperature": 0}, headers={CANARY_KEY: candidates[0]}, timeout=120
    )
    by_user = httpx2.post(f"{url}/v1/completions", json={**body, "temperature": 0, "user": baselines[0]}, timeout=120)
    assert by_header.status_code == by_user.status_code == 200, (by_header.text, by_user.text)

    arms = _arms(_canary(capsys, target, "status"))
    assert arms[CANDIDATE]["requests"] == arms[CANDIDATE]["finished"] == 2 * len(candidates) + 1
    assert arms[BASELINE]["requests"] == arms[BASELINE]["finished"] == 2 * len(baselines) + 1
    assert arms[CANDIDATE]["mean_latency_s"] > 0 and arms[BASELINE]["mean_latency_s"] > 0
    # every token of each candidate request sampled; the baseline (exact) agrees with itself: never sampled
    assert arms[CANDIDATE]["sampled_tokens"] == TOKENS * arms[CANDIDATE]["finished"]
    assert 0 <= arms[CANDIDATE]["agreeing_tokens"] < arms[CANDIDATE]["sampled_tokens"]  # the answers differ
    assert arms[BASELINE]["sampled_tokens"] == 0

    metrics = httpx2.get(f"{url}/metrics", timeout=30).text
    candidate, baseline = {"arm": CANDIDATE, "policy": "decay_k"}, {"arm": BASELINE, "policy": "exact"}
    assert _metric(metrics, "expertmesh_canary_requests_total", **candidate) == arms[CANDIDATE]["requests"]
    assert _metric(metrics, "expertmesh_canary_requests_total", **baseline) == arms[BASELINE]["requests"]
    assert (
        _metric(metrics, "expertmesh_canary_request_duration_seconds_count", **baseline) == arms[BASELINE]["finished"]
    )
    samples = _metric(metrics, "expertmesh_canary_sampled_tokens_total", **candidate)
    assert samples == arms[CANDIDATE]["sampled_tokens"]
    agreement = _metric(metrics, "expertmesh_canary_agreement", **candidate)
    assert agreement == pytest.approx(arms[CANDIDATE]["agreeing_tokens"] / samples)
    assert _metric(metrics, "expertmesh_canary_state", state="running") == 1

    stopped = _canary(capsys, target, "stop")
    assert stopped["state"] == "stopped" and _arms(stopped)[CANDIDATE]["requests"] == arms[CANDIDATE]["requests"]
    assert _tokens(stub, candidates[0]) == exact, "stopped: every key takes the default again"
    assert _canary(capsys, target, "status")["state"] == "stopped"


def test_a_candidate_below_its_agreement_bound_stops_by_itself(served, capsys):
    up, _, target, stub, _ = served
    exact = _tokens(stub, policy=pb.RoutingPolicy(name="exact"))
    _canary(capsys, target, "start", *ONE_EXPERT, "--share", "0.5", "--sample-every", "1",
            "--min-samples", "6", "--min-agreement", "1")  # fmt: skip
    key = _keys(CANDIDATE, 0.5, 1)[0]
    for i in range(8):  # 6 samples a request: judged from the first one's end on
        _tokens(stub, key, prompt=f"{PROMPT} {i}")
        if _canary(capsys, target, "status")["state"] != "running":
            break
    status = _canary(capsys, target, "status")
    candidate = _arms(status)[CANDIDATE]
    assert status["state"] == "auto_stopped", status
    assert candidate["sampled_tokens"] >= 6 and candidate["agreeing_tokens"] < candidate["sampled_tokens"]
    assert "below the bound of 100.0%" in status["reason"]
    assert status["reason"] in up.wait_for_stderr("canary auto-stopped: (.*); requests take").group(1)
    assert _tokens(stub, key) == exact, "auto-stopped: the candidate's keys take the default again"
    assert "FAILED_PRECONDITION: no canary is running (state: auto_stopped)" in _refused(capsys, target, "promote")


def test_bad_canary_input_is_refused_naming_the_setting(served, capsys):
    _, _, target, _, _ = served
    for args, words in (
        (["--policy", "bogus", "--share", "0.1"], "INVALID_ARGUMENT: candidate.name: unknown policy 'bogus'"),
        (["--policy", "delta_gap", "--share", "0.9"], "INVALID_ARGUMENT: share: must be in (0, 0.5], got 0.9"),
        (["--policy", "delta_gap", "--param", "delta=3", "--share", "0.1"], "INVALID_ARGUMENT: candidate.delta"),
        (["--policy", "delta_gap", "--param", "tau=1", "--share", "0.1"], "a parameter of gate_temperature"),
        (["--policy", "exact", "--share", "0.1"], "INVALID_ARGUMENT: candidate.name: the candidate must be"),
        (["--policy", "delta_gap", "--share", "0.1", "--min-agreement", "2"], "INVALID_ARGUMENT: min_agreement"),
        (["--policy", "delta_gap", "--param", "nope=1", "--share", "0.1"], "--param 'nope=1': expected K=V"),
        (["--policy", "delta_gap"], "canary start needs --policy and --share"),
    ):
        assert words in _refused(capsys, target, "start", *args), args
    _canary(capsys, target, "start", "--policy", "delta_gap", "--share", "0.1")
    again = _refused(capsys, target, "start", "--policy", "dynamic_k", "--share", "0.1")
    assert "FAILED_PRECONDITION: a canary of delta_gap(delta=0.18,weight_boost=1.2) is running" in again
    assert _canary(capsys, target, "stop")["state"] == "stopped"
    assert "FAILED_PRECONDITION: no canary is running (state: stopped)" in _refused(capsys, target, "stop")


def test_promote_makes_the_candidate_the_routers_default(served, capsys):
    """(Last: the router's default stays the candidate.)"""
    up, _, target, stub, _ = served
    one_expert = _tokens(stub, policy=ONE_EXPERT_POLICY)
    _canary(capsys, target, "start", *ONE_EXPERT, "--share", "0.1", "--min-agreement", "0")
    promoted = _canary(capsys, target, "promote")
    assert (
        promoted["state"] == "promoted" and "is the server's default routing policy (was exact)" in promoted["reason"]
    )
    assert _tokens(stub) == _tokens(stub, _keys(BASELINE, 0.1, 1)[0]) == one_expert
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert models.default_routing_policy_spec == "decay_k(k_start=1,decay=1,k_min=1)"
