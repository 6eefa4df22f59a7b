"""The serving engine keeps serving through failures around a step: an unreachable
state store fails that step's requests with UNAVAILABLE, and the next step works;
one request whose logits or sampling break fails alone, and the others of its
steps get the very tokens they would have got alone. A real tiny model with
transformers' eager experts stands in for the router's model; the dispatcher is
faked, since no expert call leaves the process here."""

import dataclasses
from contextlib import contextmanager

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts.errors import GroupUnavailable
from expertmesh.models.tiny import CONFIG_BUILDERS
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import ErrorEvent, Failure, FinishEvent, ScoreEvent, TokenEvent
from expertmesh.serving.request import GenerationRequest, ScoreSpec
from expertmesh.serving.sampling import SamplingParams
from expertmesh.store._redis import RedisBackend


class FlakyStoreDispatcher:
    """Begins steps like an unwatched LayerDispatcher, but the store is down for the first ``down`` steps;
    the step numbers in ``failing_steps`` fail in their dispatch, as a group that went away would."""

    def __init__(self, down: int, failing_steps=()):
        self.down = down
        self.failing_steps = set(failing_steps)
        self.steps = 0

    def begin_step(self):
        if self.down:
            self.down -= 1
            raise ConnectionError("the Redis state store is unreachable: connection refused")

    def routing_epoch(self):
        return 0

    @contextmanager
    def step(self, context):
        step, self.steps = self.steps, self.steps + 1
        if step in self.failing_steps:
            raise GroupUnavailable(f"expert group g0 at 127.0.0.1:1 failed layer 0 (step {step})")
        context.epoch = 0
        yield context


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_BUILDERS["mixtral"](), experts_implementation="eager").eval()


def test_unreachable_store_fails_the_step_and_the_engine_goes_on(model):
    engine = Engine(model, None, FlakyStoreDispatcher(down=1), EngineLimits(4, 4), max_context=64).start()
    try:
        first = list(engine.submit(GenerationRequest("a", (5, 6, 7), max_new_tokens=3, stop_at_eos=False)))
        assert isinstance(first[-1], ErrorEvent) and first[-1].failure == Failure.UNAVAILABLE
        assert "unreachable" in first[-1].message
        second = list(engine.submit(GenerationRequest("b", (5, 6, 7), max_new_tokens=3, stop_at_eos=False)))
        assert isinstance(second[-1], FinishEvent) and second[-1].completion_tokens == 3
    finally:
        engine.stop()


GOOD = (
    GenerationRequest("greedy", (5, 6, 7), max_new_tokens=5, stop_at_eos=False),
    GenerationRequest(
        "sampled", (9, 8), max_new_tokens=5, sampling=SamplingParams(temperature=0.8, seed=3), stop_at_eos=False
    ),
)


def _run(model, requests, corrupt=None, packed=True):
    """Serve ``requests`` together, from the first step on; ``corrupt`` rewrites the logits of
    request "bad" at its second step (its first, for a score) as a broken expert would.
    Returns (events by request id, steps taken)."""
    engine = Engine(model, None, FlakyStoreDispatcher(down=0), EngineLimits(4, 4), max_context=64, packed=packed)
    execute, vocab = engine.runner.execute, model.config.vocab_size

    def corrupting(plan, **kwargs):  # the runner's output, as a broken expert's logits would make it
        out = execute(plan, **kwargs)
        logits, sampled = list(out.logits), list(out.sampled) or [None] * len(plan.chunks)
        for i, chunk in enumerate(plan.chunks):
            request = chunk.request
            at = 0 if request.params.score_only else 1
            hit = corrupt is not None and request.request_id == "bad" and len(request.output_token_ids) == at
            if hit and (logits[i] is not None or sampled[i] is not None):
                # a token the device chose was of a finite row: a broken row would have gone to the host
                rows = logits[i] if logits[i] is not None else torch.zeros(1, vocab)
                logits[i], sampled[i] = corrupt(rows), None
        return dataclasses.replace(out, logits=logits, sampled=tuple(sampled))

    engine.runner.execute = corrupting
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
BAD_SCORE = GenerationRequest("bad", (4, 4), score=ScoreSpec())


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
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-sequence"])
def test_one_bad_request_fails_alone(model, bad, corrupt, message, packed):
    alone = {r.request_id: _tokens(_run(model, [r])[0][r.request_id]) for r in GOOD}
    events, steps = _run(model, [*GOOD, bad], corrupt, packed)
    assert steps == 5  # all three shared the steps: none ran after another
    failed = events["bad"][-1]
    assert isinstance(failed, ErrorEvent) and failed.failure == Failure.INTERNAL
    assert message in failed.message
    assert not any(isinstance(e, ScoreEvent) for e in events["bad"])
    if not bad.score_only:
        assert len(_tokens(events["bad"])) == 1  # its first token streamed before its logits broke
    for r in GOOD:
        assert isinstance(events[r.request_id][-1], FinishEvent)
        assert _tokens(events[r.request_id]) == alone[r.request_id]


def test_a_failed_step_fails_its_own_requests_only(model):
    """Step 0 fails in its dispatch. With a budget of 3 tokens a step, only the first prompt
    is in it: that request fails UNAVAILABLE; the two waiting ones are untouched and get the
    tokens they get alone, and a request sent afterwards is served."""
    prompts = {"first": (5, 6, 7), "second": (9, 8, 7), "third": (4, 4, 4)}
    requests = [GenerationRequest(rid, p, max_new_tokens=3, stop_at_eos=False) for rid, p in prompts.items()]
    alone = {r.request_id: _tokens(_run(model, [r])[0][r.request_id]) for r in requests[1:]}
    engine = Engine(model, None, FlakyStoreDispatcher(0, failing_steps={0}), EngineLimits(4, 4, 3), max_context=64)
    seqs = [engine.submit(r) for r in requests]
    engine.start()
    try:
        events = {r.request_id: list(seq) for r, seq in zip(requests, seqs)}
        later = list(engine.submit(GenerationRequest("later", (5, 6, 7), max_new_tokens=2, stop_at_eos=False)))
    finally:
        engine.stop()
    failed = events["first"][-1]
    assert isinstance(failed, ErrorEvent) and failed.failure == Failure.UNAVAILABLE
    assert "request first: expert group g0" in failed.message
    for rid in ("second", "third"):
        assert isinstance(events[rid][-1], FinishEvent) and _tokens(events[rid]) == alone[rid]
    assert isinstance(later[-1], FinishEvent) and later[-1].completion_tokens == 2


def test_redis_errors_surface_as_connection_error(monkeypatch, redis_url):
    backend = RedisBackend(redis_url)

    def down(*args, **kwargs):
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(backend._client, "get", down)
    with pytest.raises(ConnectionError, match="the Redis state store is unreachable"):
        backend.get("k")
    backend.close()
