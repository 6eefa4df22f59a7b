"""The engine's paged KV pool: requests wait until their prompt's blocks fit, a full pool preempts
the newest sequence (computed again later: the same tokens, its samples unchanged), equal prompt
prefixes share blocks (the same tokens with and without), a request the pool can never hold is
INVALID_ARGUMENT at submit, and finished and cancelled sequences give their blocks back.

The tiny checkpoints with a local experts implementation stand in for the router's model."""

import grpc
import pytest
from transformers import AutoModelForCausalLM

from expertmesh.errors import InvalidRequest
from expertmesh.serving.engine import Engine, EngineLimits, ErrorEvent, GenerationRequest, TokenEvent
from expertmesh.serving.kv_cache import token_bytes
from expertmesh.serving.sampling import SamplingParams
from helpers import stock_greedy
from test_engine_batching import StepDispatcher, _serve, _tokens

BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3_moe"), experts_implementation="batched_mm").eval()


def _engine(model, blocks, prefix_caching=True, max_active=8, max_step_tokens=16):
    limits = EngineLimits(
        max_active, 8, max_step_tokens,
        kv_cache_bytes=blocks * BLOCK * token_bytes(model.config, model.dtype),
        kv_block_size=BLOCK,
        prefix_caching=prefix_caching,
    )
    return Engine(model, None, StepDispatcher(), limits, max_context=64)


def _run(engine, requests):
    try:
        events = _serve(engine, requests)
        assert engine.drain(timeout=30)
        return {rid: _tokens(e) for rid, e in events.items()}, engine.kv_usage()
    finally:
        engine.stop()


GREEDY = [GenerationRequest(f"g{i}", tuple(range(3 + i, 9 + i)), max_new_tokens=18, stop_at_eos=False) for i in range(4)]
SAMPLED = GenerationRequest(
    "s", (7, 7, 8), max_new_tokens=18, stop_at_eos=False, sampling=SamplingParams(temperature=1.0, top_k=20, seed=5)
)


def test_a_full_pool_preempts_and_the_tokens_stay_the_same(model):
    """Five sequences of 21-24 tokens (6 blocks each) in 14 blocks: the newest are preempted and
    computed again, and every stream is what it is alone."""
    requests = [*GREEDY, SAMPLED]
    alone, _ = _run(_engine(model, 64), [SAMPLED])
    tokens, usage = _run(_engine(model, 14), requests)
    assert usage.preemptions > 0 and usage.blocks_used_peak <= 14
    assert usage.blocks_used == 0, "every block given back"
    for r in GREEDY:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens), r.request_id
    assert tokens["s"] == alone["s"], "a preempted sequence's sampler goes on where it was"


def test_requests_wait_for_blocks_rather_than_fail(model):
    """A pool that holds one sequence at a time serves them one after another, each exact."""
    tokens, usage = _run(_engine(model, 6), GREEDY[:3])
    assert usage.blocks_used_peak <= 6
    for r in GREEDY[:3]:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cached", "not-cached"])
def test_a_shared_prefix_is_computed_once_and_changes_no_token(model, prefix_caching):
    system = tuple(range(10, 22))  # three full blocks
    requests = [GenerationRequest(f"p{i}", (*system, 30 + i, 31), max_new_tokens=6, stop_at_eos=False) for i in range(3)]
    engine = _engine(model, 32, prefix_caching)
    first = engine.submit(requests[0])
    engine.start()
    try:
        head = list(first)  # the first prompt's blocks are in the cache before the others arrive
        tokens = {"p0": _tokens(head)}
        for seq, r in [(engine.submit(r), r) for r in requests[1:]]:
            tokens[r.request_id] = _tokens(list(seq))
        assert engine.drain(timeout=30)
        usage = engine.kv_usage()
    finally:
        engine.stop()
    for r in requests:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens)
    assert usage.prefix_queries == (3 * 3 * BLOCK if prefix_caching else 0)
    assert usage.prefix_hits == (2 * 3 * BLOCK if prefix_caching else 0), "the later two reuse all three blocks"


def test_a_request_the_pool_can_never_hold_is_invalid(model):
    engine = _engine(model, 4)  # 16 tokens
    try:
        with pytest.raises(InvalidRequest, match=r"need 5 KV blocks of 4 tokens; the KV pool \(kv_cache_bytes\) holds 4") as err:
            engine.submit(GenerationRequest("big", tuple(range(3, 13)), max_new_tokens=10))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        engine.submit(GenerationRequest("score", tuple(range(3, 19)), score_only=True))  # 16 tokens: fits
    finally:
        engine.stop()


def test_cancelling_gives_the_blocks_back(model):
    engine = _engine(model, 16, prefix_caching=False).start()
    try:
        seq = engine.submit(GenerationRequest("c", (5, 6, 7), max_new_tokens=40, stop_at_eos=False))
        events = iter(seq)
        assert isinstance(next(events), TokenEvent)
        assert engine.kv_usage().blocks_used > 0
        seq.cancel()
        final = list(events)[-1]
        assert isinstance(final, ErrorEvent) and final.code == grpc.StatusCode.CANCELLED
        assert engine.drain(timeout=30)
        assert engine._blocks.used() == 0 and engine._blocks.available() == 16
    finally:
        engine.stop()
