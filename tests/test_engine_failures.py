"""The serving engine keeps serving through failures around a step: an unreachable
state store fails that step's requests with UNAVAILABLE, and the next step works.
A real tiny model with transformers' eager experts stands in for the router's model;
the dispatcher is faked, since no expert call leaves the process here."""

from contextlib import contextmanager

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from expertmesh.serving.engine import Engine, EngineLimits, ErrorEvent, FinishEvent, GenerationRequest
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


def test_redis_errors_surface_as_connection_error(monkeypatch, redis_url):
    backend = RedisBackend(redis_url)

    def down(*args, **kwargs):
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(backend._client, "get", down)
    with pytest.raises(ConnectionError, match="the Redis state store is unreachable"):
        backend.get("k")
    backend.close()
