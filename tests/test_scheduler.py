"""The scheduler alone, driven with made-up runner outputs (``ChunkOutcome``s): no model, no tensor is written. Its
KV cache manager is the real paged one over a pool of a few 4-token blocks (its tensors are never allocated: no
forward runs). What it decides: admission by blocks and fairly between clients, the chunked-prefill budget,
preemption of the newest request when blocks run out, cancelled and expired requests, prefix-cache reuse within
one routing epoch, and what a step's outcome does to the computed tokens and the blocks."""

from __future__ import annotations

import pytest

from expertmesh.contracts.errors import Overloaded
from expertmesh.serving.events import Failure
from expertmesh.serving.kv_cache_manager import PagedKVCacheManager
from expertmesh.serving.request import GenerationRequest, Request, RequestStatus
from expertmesh.serving.scheduler import ChunkOutcome, Rows, Scheduler, SchedulerLimits
from expertmesh.serving.step_tally import StepKind

BLOCK = 4


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def scheduler(blocks=16, max_active=8, max_queued=8, max_step_tokens=16, prefix_caching=True, epoch=lambda: 0):
    kv = PagedKVCacheManager(blocks, BLOCK, prefix_caching=prefix_caching)
    clock = Clock()
    return Scheduler(kv, SchedulerLimits(max_active, max_queued, max_step_tokens), epoch, clock), clock


def request(name, prompt, new=4, client="", deadline=None, score=False):
    from expertmesh.serving.request import ScoreSpec

    params = GenerationRequest(
        name, tuple(prompt), max_new_tokens=new, client=client, deadline=deadline, score=ScoreSpec() if score else None
    )
    return Request(params)


def step(s, token=7, finish=()):
    """One schedule -> (made-up runner output) -> update: every chunk computed; a chunk that asked for its last
    row gets ``token`` as its next token, and the requests named in ``finish`` end with it."""
    plan = s.schedule()
    outcomes = []
    for chunk in plan.chunks:
        done = chunk.request.request_id in finish
        if chunk.rows is Rows.LAST and not done:
            chunk.request.output_token_ids.append(token)
        outcomes.append(ChunkOutcome(computed=True, finished=done))
    s.update_from_output(plan, outcomes, step_epoch=0, degraded=frozenset())
    return plan


def test_a_request_joins_when_its_prompt_fits_and_decodes_a_token_a_step():
    s, _ = scheduler(blocks=4)
    a = request("a", range(3, 9))  # 6 tokens: 2 blocks
    s.add_request(a)
    plan = step(s)
    ((chunk,),) = [plan.chunks]
    assert (chunk.start, chunk.token_ids, chunk.rows) == (0, tuple(range(3, 9)), Rows.LAST)
    assert plan.kind is StepKind.PREFILL and plan.first_scheduled == [a]
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 6 and a.output_token_ids == [7]
    plan = step(s)
    assert [(c.start, c.token_ids) for c in plan.chunks] == [(6, (7,))] and plan.kind is StepKind.DECODE
    assert s.kv.available() == 2, "7 tokens so far hold 2 blocks of the 4"


def test_a_long_prompt_is_chunked_behind_the_decoders_within_the_budget():
    s, _ = scheduler(max_step_tokens=8)
    short, long = request("short", [5, 6]), request("long", range(3, 23))  # 20 tokens
    s.add_request(short)
    step(s)  # short's prompt
    s.add_request(long)
    plan = step(s)
    assert [(c.request.request_id, len(c.token_ids), c.rows) for c in plan.chunks] == [
        ("short", 1, Rows.LAST),
        ("long", 7, Rows.NONE),  # the rest of the budget, its logits not needed yet
    ]
    assert plan.kind is StepKind.MIXED
    sizes = [len(step(s).chunks[-1].token_ids) for _ in range(2)]
    assert sizes == [7, 6] and long.num_computed_tokens == 20 and long.output_token_ids == [7]


def test_the_newest_request_is_preempted_when_blocks_run_out_and_computed_again_first():
    s, _ = scheduler(blocks=4)
    old, new = request("old", range(3, 11), new=8), request("new", range(20, 28), new=8)  # 8 tokens each: 2 blocks
    s.add_request(old)
    s.add_request(new)
    step(s)  # both prefilled, 16 tokens in all 4 blocks; each has its first output token now
    assert s.kv.available() == 0
    plan = s.schedule()  # old's 9th token needs a third block: new gives its back
    assert plan.preempted == [new] and new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert [c.request for c in plan.chunks] == [old] and s.waiting[0] is new
    s.update_from_output(plan, [ChunkOutcome(computed=True, finished=True)], 0, frozenset())  # old ends
    plan = step(s)
    assert [(c.request.request_id, c.start, len(c.token_ids)) for c in plan.chunks] == [("new", 0, 9)], (
        "its prompt and its output token computed again"
    )
    assert s.kv.counters.preemptions == 1 and plan.first_scheduled == [], "it joined before: no second queue time"


def test_cancelled_and_expired_requests_end_at_the_boundary_with_their_blocks():
    s, clock = scheduler()
    a, b, c = request("a", [5, 6]), request("b", [7, 8], deadline=clock.now + 1), request("c", [9])
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    a.cancel()
    clock.now += 2
    plan = s.schedule()
    assert plan.aborted == [
        (a, Failure.CANCELLED, "the client cancelled the request"),
        (b, Failure.DEADLINE_EXCEEDED, "the request's deadline passed"),
    ]
    assert [ch.request for ch in plan.chunks] == [c] and a.finished and b.finished
    assert s.kv.available() == 16 - 1, "only c holds a block"


def test_slots_go_to_the_client_holding_fewest_and_the_queue_is_bounded():
    s, _ = scheduler(max_active=2, max_queued=3)
    burst = [request(f"a{i}", [5, 6], client="a") for i in range(4)]
    other = request("b", [7, 8], client="b")
    for r in burst:
        s.add_request(r)
    s.add_request(other)
    with pytest.raises(Overloaded, match="2 active sequences, 3 queued"):
        s.add_request(request("late", [1]))
    plan = step(s)
    assert [c.request.request_id for c in plan.chunks] == ["a0", "b"]


def test_a_prompt_cached_in_the_same_epoch_is_reused_and_not_across_epochs():
    epoch = [0]
    s, _ = scheduler(epoch=lambda: epoch[0])
    prompt = range(3, 16)  # 13 tokens: 3 full blocks
    first = request("first", prompt)
    s.add_request(first)
    step(s, finish=("first",))  # its prompt's blocks are offered as it ends
    assert s.kv.pool.cached() == 3
    second = request("second", prompt)
    s.add_request(second)
    plan = step(s, finish=("second",))
    assert plan.chunks[0].start == 12, "three cached blocks: only the last token is computed"
    epoch[0] = 1  # a quarantine changed what an expert computes
    third = request("third", prompt)
    s.add_request(third)
    plan = s.schedule()
    assert plan.chunks[0].start == 0, "nothing cached in another epoch is reused"


def test_a_step_that_ran_degraded_or_in_another_epoch_offers_nothing_to_the_cache():
    s, _ = scheduler()
    prompt = range(3, 16)
    for name, epoch, degraded in (("in another epoch", 5, frozenset()), ("degraded", 0, frozenset({0}))):
        r = request(name, prompt)
        s.add_request(r)
        plan = s.schedule()
        s.update_from_output(plan, [ChunkOutcome(computed=True, finished=True)], epoch, degraded)
        assert s.kv.pool.cached() == 0, name


def test_a_failed_chunk_frees_its_blocks_and_caches_nothing():
    s, _ = scheduler()
    r = request("r", range(3, 16))
    s.add_request(r)
    plan = s.schedule()
    s.update_from_output(plan, [ChunkOutcome(computed=True, finished=True, failed=True)], 0, frozenset())
    assert r.finished and s.kv.pool.cached() == 0 and s.kv.available() == 16 and not s.has_work()


def test_a_rolled_back_token_is_computed_again_the_next_step():
    s, _ = scheduler()
    r = request("r", [5, 6, 7])
    s.add_request(r)
    step(s)
    plan = s.schedule()  # decoding its first output token
    s.update_from_output(plan, [ChunkOutcome(computed=True, rolled_back=True)], 0, frozenset())
    assert r.num_computed_tokens == 3, "the position that predicted the discarded token goes again"
    plan = s.schedule()
    assert [(c.start, c.token_ids) for c in plan.chunks] == [(3, (7,))]


def test_a_score_request_asks_for_every_prompt_row_and_reuses_no_cached_block():
    s, _ = scheduler()
    prompt = range(3, 16)
    warm = request("warm", prompt)
    s.add_request(warm)
    step(s, finish=("warm",))
    scored = request("score", prompt, score=True)
    s.add_request(scored)
    plan = s.schedule()
    assert (plan.chunks[0].start, plan.chunks[0].rows) == (0, Rows.ALL)


def test_a_request_the_pool_can_never_hold_is_refused_before_it_queues():
    from expertmesh.contracts.errors import InvalidRequest

    s, _ = scheduler(blocks=2)
    with pytest.raises(InvalidRequest, match="need 3 KV blocks of 4 tokens; the KV pool"):
        s.kv.check_fits(GenerationRequest("big", tuple(range(8)), max_new_tokens=4), max_context=64)


def test_each_plan_carries_the_queue_left_after_admission_for_adaptive_k():
    s, clock = scheduler(max_active=1)
    a, b, c = request("a", [5, 6]), request("b", [7, 8]), request("c", [9])
    for r, arrived in ((a, 99.0), (b, 99.5), (c, 99.8)):
        r.arrival_time = arrived
        s.add_request(r)
    plan = step(s)
    assert plan.queue.queued == 2 and plan.queue.oldest_wait_s == pytest.approx(0.5)  # b waited since 99.5
    clock.now += 1.0
    assert step(s).queue.oldest_wait_s == pytest.approx(1.5)
    s.finish(a)
    s.finish(b)
    s.finish(c)
    assert step(s).queue == type(plan.queue)(0, 0.0)  # nothing waits
