"""The serving engine keeps serving through failures around a step: an unreachable
state store fails that step's requests with UNAVAILABLE, and the next step works;
one request whose logits or sampling break fails alone, and the others of its
steps get the very tokens they would have got alone. A real tiny model with
transformers' eager experts stands in for the router's model; the dispatcher is
faked, since no expert call leaves the process here."""

from contextlib import contextmanager

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from expertmesh.serving.engine import (
    Engine,
    EngineLimits,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    ScoreEvent,
    TokenEvent,
)
from expertmesh.serving.sampling import SamplingParams
from expertmesh.state._redis import RedisBackend
from expertmesh.tiny import CONFIG_BUILDERS


class FlakyStoreDispatcher:
    """Refreshes like ExpertDispatcher, but the store is down for the first ``down`` steps."""

    def __init__(self, down: int):
        self.down = down

    def refresh(self):
        if self.down:
            self.down -= 1
            raise ConnectionError("the Redis state store is unreachable: connection refused")

    @contextmanager
    def gathering(self, gather, positions=None):
        try:
            yield
        finally:
            gather.leave()

    def dispatch(self, *args, **kwargs):  # eager experts never call it
        raise AssertionError("unexpected dispatch")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_BUILDERS["mixtral"](), experts_implementation="eager").eval()


def test_unreachable_store_fails_the_step_and_the_engine_goes_on(model):
    engine = Engine(model, None, FlakyStoreDispatcher(down=1), EngineLimits(4, 4), max_context=64).start()
    try:
        first = list(engine.submit(GenerationRequest("a", (5, 6, 7), max_new_tokens=3, stop_at_eos=False)))
        assert isinstance(first[-1], ErrorEvent) and first[-1].code == grpc.StatusCode.UNAVAILABLE
        assert "unreachable" in first[-1].message
        second = list(engine.submit(GenerationRequest("b", (5, 6, 7), max_new_tokens=3, stop_at_eos=False)))
        assert isinstance(second[-1], FinishEvent) and second[-1].completion_tokens == 3
    finally:
        engine.stop()


GOOD = (
    GenerationRequest("greedy", (5, 6, 7), max_new_tokens=5, stop_at_eos=False),
    GenerationRequest("sampled", (9, 8), max_new_tokens=5, sampling=SamplingParams(temperature=0.8, seed=3), stop_at_eos=False),
)


def _run(model, requests, corrupt=None):
    """Serve ``requests`` together, from the first step on; ``corrupt`` rewrites the logits of
    request "bad" at its second step (its first, for a score) as a broken expert would.
    Returns (events by request id, steps taken)."""
    engine = Engine(model, None, FlakyStoreDispatcher(down=0), EngineLimits(4, 4), max_context=64)
    forward = engine._forward

    def corrupting(seq, gather):
        logits = forward(seq, gather)  # [n, V]
        at = 0 if seq.request.score_only else 1
        hit = corrupt is not None and seq.request.request_id == "bad" and len(seq.generated) == at
        return corrupt(logits) if hit else logits

    engine._forward = corrupting
    seqs = [engine.submit(r) for r in requests]  # queued before the loop starts, so all join step one
    engine.start()
    try:
        return {r.request_id: list(seq) for r, seq in zip(requests, seqs)}, engine.steps
    finally:
        engine.stop()


def _tokens(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


BAD_GREEDY = GenerationRequest("bad", (4, 4), max_new_tokens=5)
BAD_SAMPLED = GenerationRequest("bad", (4, 4), max_new_tokens=5, sampling=SamplingParams(temperature=1.0, seed=1))
BAD_SCORE = GenerationRequest("bad", (4, 4), score_only=True)


def _nan(logits):
    return torch.full_like(logits, float("nan"))


def _one_inf(logits):
    return logits.masked_fill(torch.arange(logits.shape[-1]) == 7, float("inf"))


def _no_vocab(logits):  # the sampler raises on them
    return logits[:, :0]


@pytest.mark.parametrize(
    "bad, corrupt, message",
    [
        (BAD_GREEDY, _nan, "request bad: the logits held"),
        (BAD_SAMPLED, _one_inf, "request bad: the logits held 0 NaN and 1 Inf"),
        (BAD_GREEDY, _no_vocab, "request bad: IndexError"),
        (BAD_SCORE, _nan, "request bad: the logits held"),
    ],
    ids=["nan-greedy", "inf-sampled", "sampler-raises", "nan-score"],
)
def test_one_bad_request_fails_alone(model, bad, corrupt, message):
    alone = {r.request_id: _tokens(_run(model, [r])[0][r.request_id]) for r in GOOD}
    events, steps = _run(model, [*GOOD, bad], corrupt)
    assert steps == 5  # all three shared the steps: none ran after another
    failed = events["bad"][-1]
    assert isinstance(failed, ErrorEvent) and failed.code == grpc.StatusCode.INTERNAL
    assert message in failed.message
    assert not any(isinstance(e, ScoreEvent) for e in events["bad"])
    if not bad.score_only:
        assert len(_tokens(events["bad"])) == 1  # its first token streamed before its logits broke
    for r in GOOD:
        assert isinstance(events[r.request_id][-1], FinishEvent)
        assert _tokens(events[r.request_id]) == alone[r.request_id]


def test_redis_errors_surface_as_connection_error(monkeypatch, redis_url):
    backend = RedisBackend(redis_url)

    def down(*args, **kwargs):
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(backend._client, "get", down)
    with pytest.raises(ConnectionError, match="the Redis state store is unreachable"):
        backend.get("k")
    backend.close()
