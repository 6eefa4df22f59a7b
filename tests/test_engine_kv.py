"""The engine's paged KV pool: requests wait until their prompt's blocks fit, a full pool preempts
the newest sequence (computed again later: the same tokens, its samples unchanged), equal prompt
prefixes share blocks (the same tokens with and without), a request the pool can never hold is
INVALID_ARGUMENT at submit, and finished and cancelled sequences give their blocks back.

The tiny checkpoints with a local experts implementation stand in for the router's model."""

import dataclasses
import threading
import time
from contextlib import contextmanager

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.models.tiny import MOE_ARCHITECTURES
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import ErrorEvent, Failure, TokenEvent
from expertmesh.serving.kv_cache import token_bytes
from expertmesh.serving.request import GenerationRequest, ScoreSpec
from expertmesh.serving.sampling import SamplingParams
from helpers import stock_greedy
from test_engine_batching import StepDispatcher, _serve, _tokens

BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints("qwen3_moe"), experts_implementation="batched_mm"
    ).eval()


def _engine(model, blocks, prefix_caching=True, max_active=8, max_step_tokens=16):
    limits = EngineLimits(
        max_active,
        8,
        max_step_tokens,
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


GREEDY = [
    GenerationRequest(f"g{i}", tuple(range(3 + i, 9 + i)), max_new_tokens=18, stop_at_eos=False) for i in range(4)
]
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
    requests = [
        GenerationRequest(f"p{i}", (*system, 30 + i, 31), max_new_tokens=6, stop_at_eos=False) for i in range(3)
    ]
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


def test_a_prefix_cache_reset_makes_the_next_request_prefill_its_whole_prompt(model):
    """What ``bench serve`` does between its runs: the same prompt again finds nothing cached after a reset,
    and its tokens stay stock's."""
    prompt = tuple(range(10, 23))  # three full blocks
    engine = _engine(model, 32).start()
    try:
        answers = []
        for reset in (False, True):
            if reset:
                assert engine.reset_prefix_cache() == 3  # the first request's three full blocks
            answers.append(
                _tokens(
                    list(engine.submit(GenerationRequest(f"r{reset}", prompt, max_new_tokens=4, stop_at_eos=False)))
                )
            )
        assert engine.drain(timeout=30)
        usage = engine.kv_usage()
    finally:
        engine.stop()
    assert usage.prefix_queries == 2 * 3 * BLOCK and usage.prefix_hits == 0, "the second found nothing cached"
    assert answers[0] == answers[1] == stock_greedy(model, prompt, 4)
    assert _engine(model, 8).reset_prefix_cache() == 0  # not started: done at once


EpochDispatcher = StepDispatcher  # a router whose quarantines change: its ``epoch`` and ``step_epoch``


def _one_by_one(engine, requests):
    """Each request served to its end before the next is submitted; the engine stopped after."""
    engine.start()
    try:
        return [_tokens(list(engine.submit(r))) for r in requests]
    finally:
        engine.stop()


PROMPT = tuple(range(10, 23))  # three full blocks


def test_blocks_computed_in_another_routing_epoch_are_never_reused(model):
    """The routing epoch moves on with every quarantine, repair or release: what an expert computes may differ
    from then on, so a prompt cached before is computed again, and cached anew for the epoch after."""
    dispatcher = EpochDispatcher()
    engine = Engine(model, None, dispatcher, _engine(model, 32).limits, max_context=64)
    ask = lambda name: GenerationRequest(name, PROMPT, max_new_tokens=3, stop_at_eos=False)  # noqa: E731
    engine.start()
    try:
        hits = []
        for name, epoch in (("first", 0), ("released", 1), ("again", 1)):
            dispatcher.epoch = epoch
            before = engine.kv_usage().prefix_hits
            assert _tokens(list(engine.submit(ask(name)))) == stock_greedy(model, PROMPT, 3)
            hits.append(engine.kv_usage().prefix_hits - before)
    finally:
        engine.stop()
    assert hits == [0, 0, 3 * BLOCK], "the blocks of epoch 0 are not reused in epoch 1; epoch 1's are"


def test_a_sequence_stepping_in_another_epoch_than_it_was_admitted_in_publishes_nothing(model):
    """Admitted in epoch 1, its step ran on a view of epoch 0 (the watcher's new view not yet swapped in): its
    blocks hold epoch 0's keys and values, so they are not offered under epoch 1's hashes."""
    dispatcher = EpochDispatcher()
    dispatcher.epoch, dispatcher.step_epoch = 1, 0
    engine = Engine(model, None, dispatcher, _engine(model, 32).limits, max_context=64)
    _one_by_one(engine, [GenerationRequest("straddling", PROMPT, max_new_tokens=2, stop_at_eos=False)])
    assert engine.kv.pool.cached() == 0


def test_requests_share_cached_blocks_only_under_the_same_cache_salt(model):
    """vLLM's ``cache_salt``: tenants that must share nothing salt their requests differently."""
    engine = _engine(model, 32)
    requests = [
        GenerationRequest(f"r{i}", PROMPT, max_new_tokens=2, stop_at_eos=False, cache_salt=salt)
        for i, salt in enumerate(["tenant-a", "tenant-b", "", "tenant-a"])
    ]
    tokens = _one_by_one(engine, requests)
    assert tokens == [stock_greedy(model, PROMPT, 2)] * 4
    usage = engine.kv_usage()
    assert usage.prefix_hits == 3 * BLOCK, "only the second tenant-a request found blocks"
    assert engine.kv.pool.cached() == 3 * 3, "three scopes, three blocks each"


def test_a_request_the_pool_can_never_hold_is_invalid(model):
    engine = _engine(model, 4)  # 16 tokens
    try:
        with pytest.raises(
            InvalidRequest, match=r"need 5 KV blocks of 4 tokens; the KV pool \(kv_cache_bytes\) holds 4"
        ) as err:
            engine.submit(GenerationRequest("big", tuple(range(3, 13)), max_new_tokens=10))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        engine.submit(GenerationRequest("score", tuple(range(3, 19)), score=ScoreSpec()))  # 16 tokens: fits
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
        assert isinstance(final, ErrorEvent) and final.failure == Failure.CANCELLED
        assert engine.drain(timeout=30)
        assert engine.kv.pool.used() == 0 and engine.kv.pool.available() == 16
    finally:
        engine.stop()


def test_the_kv_metrics_report_the_pool(model, monkeypatch):
    """What an exporter collects after a run that preempted (an SDK meter provider local to this test)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from expertmesh.serving import kv_metrics

    reader = InMemoryMetricReader()
    monkeypatch.setattr(kv_metrics, "meter", lambda: MeterProvider(metric_readers=[reader]).get_meter("expertmesh"))
    engine = _engine(model, 14)
    kv_metrics.register_kv_metrics(engine.kv_usage)
    _run(engine, [*GREEDY, SAMPLED])
    usage = engine.kv_usage()
    metrics = {
        metric.name: metric.data.data_points[0].value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }
    assert metrics == {
        "expertmesh.kv.blocks.capacity": 14,
        "expertmesh.kv.blocks.used": 0,
        "expertmesh.kv.usage": 0.0,
        "expertmesh.kv.fragmentation": 0.0,
        "expertmesh.kv.preemptions": usage.preemptions,
        "expertmesh.kv.prefix_cache.queries": usage.prefix_queries,
        "expertmesh.kv.prefix_cache.hits": usage.prefix_hits,
    }
    assert usage.preemptions > 0 and usage.prefix_queries > 0


class GatedDispatcher(StepDispatcher):
    """Holds the engine at the start of its second step until ``go`` is set."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()
        self.steps = 0

    @contextmanager
    def step(self, context):
        self.steps += 1
        if self.steps == 2:
            self.go.wait(30)
        context.epoch = 0
        yield context


def test_fragmentation_counts_the_unfilled_slots_of_held_blocks(model):
    """One sequence with a 6-token prompt, in blocks of 4: after its first step it holds 2 blocks
    (8 slots) and 6 are filled (its first generated token is fed by the next step), so 2/8 unfilled."""
    dispatcher = GatedDispatcher()
    limits = EngineLimits(4, 4, kv_cache_bytes=16 * BLOCK * token_bytes(model.config, model.dtype), kv_block_size=BLOCK)
    engine = Engine(model, None, dispatcher, limits, max_context=64).start()
    try:
        seq = engine.submit(GenerationRequest("f", tuple(range(3, 9)), max_new_tokens=30, stop_at_eos=False))
        events = iter(seq)
        next(events)
        while dispatcher.steps < 2:  # the engine is in its second step, past the boundary's snapshot
            time.sleep(0.01)
        usage = engine.kv_usage()
        seq.cancel()
        dispatcher.go.set()
        list(events)
    finally:
        dispatcher.go.set()
        engine.stop()
    assert usage.blocks_used == 2 and usage.fragmentation == pytest.approx(2 / 8)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1)):
    """flash-attn's ``flash_attn_varlen_func`` as documented, in torch: q [T, H, d], k/v [ΣL, h, d]
    (h divides H), sequence i's rows cu_q[i]..cu_q[i+1] and keys cu_k[i]..cu_k[i+1]; the causal mask
    aligned bottom-right; ``window_size[0]`` keys before each query at most (-1: all)."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)  # [H, n, d]
        ki, vi = (t[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))  # [H, L, d]
        n, length = qi.shape[1], ki.shape[1]
        assert n <= max_q and length <= max_k and causal
        queries, keys = torch.arange(length - n, length)[:, None], torch.arange(length)[None]
        allowed = keys <= queries
        if window_size[0] >= 0:
            allowed &= keys >= queries - window_size[0]
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=allowed, scale=softmax_scale
            ).transpose(0, 1)
        )
    return torch.cat(out)  # [T, H, d]


@pytest.mark.parametrize("kernel", ["per-sequence", "batched-decode", "cpu-paged-decode", "flash-varlen"])
@pytest.mark.parametrize(
    "arch, overrides",
    [("mixtral", {"sliding_window": 5}), ("qwen2_moe", {}), ("gpt_oss", {})],
    ids=["sliding", "full", "eager-sinks"],
)
def test_every_kernel_keeps_the_tokens_stock(tiny_checkpoints, monkeypatch, arch, overrides, kernel):
    """Each kernel on an sdpa model with and without a sliding window, and (not flash-varlen, which takes no
    attention sinks) on an eager model with sinks; flash-varlen's inputs (cu_seqlens, layouts, window) against a
    torch model of flash-attn's contract (flash-attn is not installed here). The requests' prompts differ in
    length, so the batched kernels' decode rows are padded (and masked, or cut at their lengths in place); on the
    eager model the in-place kernel's calls go the padded way (it computes sdpa's attention, not sinks)."""
    if kernel == "flash-varlen" and arch == "gpt_oss":
        pytest.skip("flash-varlen is chosen for sdpa models only (choose_backend); GPT-OSS's sinks need eager")

    from expertmesh.serving import cpu_paged_decode, paged_attention

    monkeypatch.setattr(paged_attention, "flash_varlen", lambda: _reference_varlen)
    if kernel == "cpu-paged-decode":
        assert cpu_paged_decode.load(), "the kernel builds on this host (g++ and ninja)"
    in_place = []
    kernel_call = cpu_paged_decode.paged_decode
    monkeypatch.setattr(
        cpu_paged_decode, "paged_decode", lambda q, *a: in_place.append(q.shape[0]) or kernel_call(q, *a)
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints(arch, **overrides), experts_implementation="batched_mm"
    ).eval()
    batches = []
    of = paged_attention.DecodeBatch.of
    monkeypatch.setattr(
        paged_attention.DecodeBatch, "of", classmethod(lambda cls, *a: batches.append(of(*a)) or batches[-1])
    )
    engine = _engine(model, 64, max_step_tokens=8)
    in_place.clear()  # the engine's own check of its decode attention op at start (``cpu_decode_attention.agrees``)
    engine.runner.mask_spec = dataclasses.replace(engine.runner.mask_spec, kernel=kernel)
    uneven = [
        GenerationRequest(f"u{n}", tuple(range(3 + n, 3 + 2 * n)), max_new_tokens=14, stop_at_eos=False)
        for n in (2, 5, 9, 12)
    ]
    tokens, _ = _run(engine, uneven)
    for r in uneven:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens), r.request_id
    if kernel in ("batched-decode", "cpu-paged-decode"):  # it ran, and on decode rows of different lengths
        assert any(b.mask is not None and len(b.sequences) > 1 for b in batches)
    sdpa_in_place = kernel == "cpu-paged-decode" and arch != "gpt_oss"
    assert bool(in_place) == sdpa_in_place, f"the in-place kernel ran {len(in_place)} times"
    if sdpa_in_place:  # a step with one decoding sequence (the others in their prompts) reads it in place too
        assert 1 in in_place and max(in_place) > 1, in_place


def test_each_kernel_only_where_it_computes_the_models_attention(monkeypatch):
    """The attention backend chosen for a model on its device: the device query faked (this host has no GPU)."""
    from expertmesh.serving import cpu_paged_decode, paged_attention
    from expertmesh.serving.attention_backends import choose_backend as choose_kernel

    cuda, cpu, half = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(paged_attention, "flash_varlen", lambda: _reference_varlen)
    assert choose_kernel(cuda, "sdpa", False, half) == "flash-varlen"
    assert choose_kernel(cpu, "sdpa", False, half) == "batched-decode", "the in-place kernel takes float32 only"
    assert choose_kernel(cpu, "sdpa", False, torch.float32) == "cpu-paged-decode"
    monkeypatch.setattr(cpu_paged_decode, "load", lambda: False)
    assert choose_kernel(cpu, "sdpa", False, torch.float32) == "batched-decode", "the kernel did not build"
    assert choose_kernel(cpu, "eager", False, torch.float32) == "batched-decode"
    assert choose_kernel(cuda, "eager", False, half) == "batched-decode", "eager models may have sinks (GPT-OSS)"
    assert choose_kernel(cuda, "sdpa", True, half) == "per-sequence", "MLA expands its latents"
    assert choose_kernel(cpu, "sdpa", True, torch.float32) == "per-sequence", "MLA expands its latents"
    assert choose_kernel(cuda, "sdpa", False, torch.float32) == "batched-decode", "flash-attn takes half precision only"
    monkeypatch.setattr(paged_attention, "flash_varlen", lambda: None)
    assert choose_kernel(cuda, "sdpa", False, half) == "batched-decode", "not installed"


def test_a_prompt_under_another_routing_policy_shares_no_blocks():
    """A routing policy changes the gates, so every later layer's keys and values: the same prompt
    under dynamic_k takes none of the blocks an exact request left in the prefix cache, and gets the
    tokens it gets with no cache at all."""
    from expertmesh.router.policy.gate_hook import GateBias
    from expertmesh.router.policy.routing_policy import RequestRouting, parse_policy
    from test_routing_policy import _LocalDispatcher, _model

    model = _model("mixtral")
    gate_bias = GateBias(model)
    k, e = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    prompt = tuple(range(10, 23))  # three full blocks
    exact = GenerationRequest("exact", prompt, max_new_tokens=6, stop_at_eos=False)
    widened = GenerationRequest(
        "dyn",
        prompt,
        max_new_tokens=6,
        stop_at_eos=False,
        routing=RequestRouting(parse_policy("dynamic_k", {"threshold": 1.0}, k, e)),
    )

    def serve(requests, prefix_caching):
        limits = EngineLimits(
            8,
            8,
            kv_cache_bytes=32 * BLOCK * token_bytes(model.config, model.dtype),
            kv_block_size=BLOCK,
            prefix_caching=prefix_caching,
        )
        engine = Engine(model, None, _LocalDispatcher(gate_bias), limits, max_context=64).start()
        try:
            tokens = [_tokens(list(engine.submit(r))) for r in requests]  # one after the other
            return tokens, engine.kv_usage()
        finally:
            engine.stop()

    (exact_tokens, widened_tokens), usage = serve([exact, widened], prefix_caching=True)
    [widened_alone], _ = serve([widened], prefix_caching=False)
    assert usage.prefix_hits == 0 and usage.prefix_queries == 3 * BLOCK, "only the exact request looked"
    assert widened_tokens == widened_alone and exact_tokens == stock_greedy(model, prompt, 6)


def test_a_failed_sequence_leaves_nothing_in_the_prefix_cache(model):
    """A request whose logits came out broken (as a broken expert's would) fails alone; its prompt's
    blocks, which that step computed, are not offered to later requests."""
    import math

    engine = _engine(model, 32)
    execute, vocab = engine.runner.execute, model.config.vocab_size

    def corrupting(plan, **kwargs):  # every row of the step's logits NaN (a token chosen on the device: its row broken)
        out = execute(plan, **kwargs)
        rows = [
            r if r is not None else torch.zeros(1, vocab) if t is not None else None
            for r, t in zip(out.logits, out.sampled)
        ]
        broken = [None if r is None else torch.full_like(r, math.nan) for r in rows]
        return dataclasses.replace(out, logits=broken, sampled=())

    engine.runner.execute = corrupting
    prompt = tuple(range(10, 23))  # three full blocks
    engine.start()
    try:
        (failed,) = [
            e for e in engine.submit(GenerationRequest("bad", prompt, max_new_tokens=4)) if isinstance(e, ErrorEvent)
        ]
        assert engine.drain(timeout=30)
        assert engine.kv.pool.cached() == 0 and engine.kv_usage().blocks_used == 0
    finally:
        engine.stop()
    assert failed.failure == Failure.INTERNAL


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_preempted_and_prefix_cached_sequences_match_stock_on_every_architecture(tiny_checkpoints, arch):
    """Three prompts with a shared two-block prefix, 25 tokens each (7 blocks) in a pool of 12: the
    newest are preempted and, computed again, take the cached prefix; every stream is stock greedy
    (DeepSeek-V3's latents and GPT-OSS's sliding window and sinks included). The pool allocated up front from
    the config is what every layer caches: none was allocated again."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(arch), experts_implementation="batched_mm").eval()
    shared = tuple(range(20, 28))
    requests = [
        GenerationRequest(f"r{i}", (*shared, 40 + i, 41, 42), max_new_tokens=14, stop_at_eos=False) for i in range(3)
    ]
    engine = _engine(model, 12, max_step_tokens=8)
    allocated = {layer: [t.data_ptr() for t in pair] for layer, pair in engine.kv.tensors._layers.items()}
    assert len(allocated) == model.config.get_text_config().num_hidden_layers, "every layer's, before any step"
    tokens, usage = _run(engine, requests)
    assert engine.kv.tensors.reallocated == set()
    assert {layer: [t.data_ptr() for t in pair] for layer, pair in engine.kv.tensors._layers.items()} == allocated
    assert usage.preemptions > 0 and usage.prefix_hits > 0
    for r in requests:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens), r.request_id


def test_queue_time_is_recorded_once_per_request_even_when_preempted(model, monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from expertmesh.serving import engine as engine_module

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])  # one: a reader belongs to one provider
    monkeypatch.setattr(engine_module, "meter", lambda: provider.get_meter("expertmesh"))
    _, usage = _run(_engine(model, 14), [*GREEDY, SAMPLED])
    (histogram,) = [
        m.data.data_points[0]
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "expertmesh.request.queue_time"
    ]
    assert usage.preemptions > 0 and histogram.count == 5


def test_a_sliding_window_model_gives_back_the_blocks_behind_its_window(tiny_checkpoints):
    """Every layer sees 5 tokens: three sequences of 24 tokens (6 blocks each, 18 in all) run in 10
    blocks without a preemption, as each holds only the blocks its window reaches; the tokens are stock."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints("mixtral", sliding_window=5), experts_implementation="batched_mm"
    ).eval()
    tokens, usage = _run(_engine(model, 10, max_step_tokens=8), GREEDY[:3])
    assert usage.preemptions == 0 and usage.blocks_used_peak <= 10 and usage.blocks_used == 0
    for r in GREEDY[:3]:
        assert tokens[r.request_id] == stock_greedy(model, r.prompt_ids, r.max_new_tokens), r.request_id


def test_a_layer_caching_other_shapes_than_its_config_describes_is_allocated_again(caplog):
    from expertmesh.serving.kv_cache import KVPool

    pool = KVPool(4, 2)
    pool.allocate(1, ((2, 8), (2, 8)), torch.float32)
    new = torch.ones(1, 1, 3, 16)  # one head of 16: not what the config said
    with caplog.at_level("WARNING"):
        pool.write(0, new, new, torch.tensor([0, 1, 2]))
    assert pool.reallocated == {0} and "allocated again" in caplog.text
    first, _ = pool.read(0, torch.tensor([0, 1, 2]))
    assert torch.equal(first, new)


def test_the_device_chooses_greedy_only_tokens_and_sends_the_host_only_what_it_reads():
    """``model_runner.split_logits``: a greedy-only request's next token is its row's argmax (ties to the lowest
    id, as the host's choice), chosen where the logits are; a non-finite row goes to the host (whose choice
    refuses it); other requests' rows go to the host; a chunk that asked for no row gets none."""
    from expertmesh.serving.model_runner import split_logits
    from expertmesh.serving.request import Request
    from expertmesh.serving.sampling import SamplingParams
    from expertmesh.serving.scheduler import Rows, ScheduledChunk

    def chunk(name, rows, **params):
        return ScheduledChunk(Request(GenerationRequest(name, (1, 2), **params)), (1,), 1, rows)

    chunks = [
        chunk("greedy", Rows.LAST),
        chunk("sampled", Rows.LAST, sampling=SamplingParams(temperature=1.0)),
        chunk("prompt", Rows.NONE),
        chunk("broken", Rows.LAST),
        chunk("logprobs", Rows.LAST, logprobs=2),
    ]
    logits = torch.tensor(
        [[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 0.0, 0.0], [1.0, 2.0, float("nan"), 0.0], [0.0, 0.0, 9.0, 1.0]]
    )
    host, sampled = split_logits(logits, [1, 1, 0, 1, 1], chunks)
    assert sampled == (1, None, None, None, None), "the first of the tied maxima; nothing for the broken row"
    assert host[0] is None and host[2] is None
    assert torch.equal(host[1], logits[1:2]) and torch.equal(host[4], logits[3:4])
    assert torch.isnan(host[3]).any(), "the broken row went to the host, whose choice refuses it"

    # A decode step of greedy requests only (every row is a last row), one row of finite values whose sum
    # overflows: still chosen here (finite is isfinite's answer, not the sum's); an Inf row goes to the host
    decoding = [chunk(f"g{i}", Rows.LAST) for i in range(3)]
    huge = torch.finfo(torch.float32).max
    logits = torch.tensor([[huge, huge, 0.0, 1.0], [0.0, 1.0, 2.0, 2.0], [0.0, float("inf"), 0.0, 0.0]])
    host, sampled = split_logits(logits, [1, 1, 1], decoding)
    assert sampled == (0, 2, None) and host[:2] == [None, None]
    assert torch.equal(host[2], logits[2:3])


def test_a_steps_layout_in_the_pool_is_plain_data_from_the_block_tables():
    """``attention_backends.attention_metadata``: what a block-table backend (FlashInfer's plan) is given. Two
    sequences in blocks of 4: one decoding its 7th token (positions 0-5 computed), one feeding 3 prompt tokens from
    position 4, its first block given back (-1)."""
    import numpy as np

    from expertmesh.serving.attention_backends import attention_metadata

    md = attention_metadata([[5, 2], [-1, 9, 3]], starts=[6, 4], tokens=[1, 3], block_size=4)
    assert md.block_tables.tolist() == [[5, 2, -1], [-1, 9, 3]]
    assert md.num_computed_tokens.tolist() == [6, 4] and md.seq_lens.tolist() == [7, 7]
    assert md.query_start_loc.tolist() == [0, 1, 4] and md.positions.tolist() == [6, 4, 5, 6]
    # position 6 of the first: block 2, offset 2; positions 4, 5, 6 of the second: block 9, offsets 0-2
    assert np.array_equal(md.slot_mapping, [2 * 4 + 2, 9 * 4, 9 * 4 + 1, 9 * 4 + 2])


def test_pack_reads_a_sequence_from_its_first_held_block():
    from expertmesh.serving.forward import Chunk, MaskSpec, Rows, pack
    from expertmesh.serving.kv_blocks import FREED
    from expertmesh.serving.kv_cache import KVPool

    spec = MaskSpec("sdpa", ("sliding_attention",), 3, torch.float32)
    batch = pack([Chunk([FREED, 2], (9,), 6, Rows.LAST), Chunk([1], (5, 6), 0, Rows.LAST)], spec, KVPool(4, 4))
    cache = batch.cache
    assert batch.positions.tolist() == [6, 0, 1]
    assert cache._write.tolist() == [10, 4, 5] and cache._read.tolist() == [8, 9, 10, 4, 5]
    assert cache.past_offsets() == [0, 3, 5] and cache._bases == [4, 0]
    assert batch.attention.first_key(batch.attention.sequences[0], "sliding_attention") == 4
    with pytest.raises(ValueError, match="position 3 of step sequence 0 is in a block it gave back"):
        cache.past(0, 0, 3)


def test_a_steps_slots_are_each_sequences_own_computed_one_by_one():
    """The step's layout is computed for all sequences at once; the oracle is each sequence on its own: its new
    tokens' positions and slots, and the slots its past is read from (from its first held block to its end, or from
    any held position: alone, padded beside others, or as the block table a kernel reads), over random steps of
    many sequences with blocks given back behind a window and tables of different widths."""
    import numpy as np

    from expertmesh.serving.attention_backends import ATTENTION_BACKENDS, StepLayout, attention_metadata
    from expertmesh.serving.kv_cache import KVPool

    rng = np.random.default_rng(3)
    pool = KVPool(256, 4)
    pool.allocate(1, ((1, 1), (1, 1)), torch.float32)
    pool.tensors(0)[0].copy_(torch.arange(256 * 4.0)[:, None, None])  # each slot's key: its own number
    layout = StepLayout("sdpa", ("full_attention",), None, torch.float32)
    for _ in range(50):
        tables, starts, tokens = [], [], []
        for _ in range(int(rng.integers(1, 9))):
            start, count = int(rng.integers(0, 30)), int(rng.integers(1, 6))
            blocks = rng.choice(256, size=(start + count + 3) // 4, replace=False).tolist()
            gone = int(rng.integers(0, start // 4 + 1))  # blocks wholly behind the window, given back
            tables.append([-1] * gone + blocks[gone:])
            starts.append(start)
            tokens.append(count)
        md = attention_metadata(tables, starts, tokens, 4)
        cache, _ = ATTENTION_BACKENDS["batched-decode"].plan(md, pool, layout)
        positions, writes, reads, bases, firsts, own_reads = [], [], [], [], [], []
        for table, start, count in zip(tables, starts, tokens):
            mine = list(range(start, start + count))
            positions += mine
            writes += [table[p // 4] * 4 + p % 4 for p in mine]
            base = next(i for i, b in enumerate(table) if b >= 0) * 4
            bases.append(base)
            reads += [table[p // 4] * 4 + p % 4 for p in range(base, start + count)]
            firsts.append(int(rng.integers(base, start + count)))  # a key range from a held position
            own_reads.append([table[p // 4] * 4 + p % 4 for p in range(firsts[-1], start + count)])
        assert md.positions.tolist() == positions and md.slot_mapping.tolist() == writes
        assert cache._write.tolist() == writes and cache._read.tolist() == reads and cache._bases == bases
        # each sequence's own reads: one at a time (``past``), padded side by side, or through its block table
        for i, first in enumerate(firsts):
            keys, _ = cache.past(0, i, first)  # [1, h, L, d]: the slots' numbers
            assert keys.flatten().tolist() == own_reads[i]
        chosen = sorted(rng.choice(len(tables), size=int(rng.integers(1, len(tables) + 1)), replace=False).tolist())
        padded, lengths = cache.padded_slots(chosen, [firsts[i] for i in chosen])
        assert lengths == [len(own_reads[i]) for i in chosen]
        for row, i in zip(padded.tolist(), chosen):  # its own slots, then its last one again
            assert row == own_reads[i] + own_reads[i][-1:] * (padded.shape[1] - len(own_reads[i]))
        assert cache.block_tables(chosen).tolist() == md.block_tables[chosen].tolist()


def test_the_pool_is_reported_before_the_first_step(model):
    engine = _engine(model, 9)
    assert engine.kv_usage() == engine.kv_usage().__class__(9, 0, BLOCK, 0.0)
    fallback = Engine(model, None, StepDispatcher(), EngineLimits(4, 4), max_context=64, packed=False)
    assert fallback.kv_usage() is None


def test_one_clients_burst_does_not_hold_every_slot_while_another_waits(model):
    """Two slots; client a queues six requests (a burst of choices), then client b one. The second slot goes to
    b, which holds none, not to a's second request (first come, first served gave a both, and b the seventh)."""
    engine = _engine(model, 64, max_active=2)
    joined = []
    schedule = engine.scheduler.schedule

    def scheduling():
        plan = schedule()
        joined.extend(r.request_id for r in plan.first_scheduled)
        return plan

    engine.scheduler.schedule = scheduling
    burst = [GenerationRequest(f"a{i}", (5, 6, 7), max_new_tokens=4, stop_at_eos=False, client="a") for i in range(6)]
    other = GenerationRequest("b", (8, 9), max_new_tokens=4, stop_at_eos=False, client="b")
    tokens, _ = _run(engine, [*burst, other])
    assert joined[:3] == ["a0", "b", "a1"]
    assert tokens["b"] == stock_greedy(model, other.prompt_ids, 4)


def test_a_chunk_with_no_past_attends_to_the_steps_own_keys_and_the_others_read_the_cache():
    """``paged_attention``: a prompt's first chunk (no past before the step) attends to the new keys and values
    the module hands over, with no gather from the pool (they are the values the cache now holds); a sequence
    with a past reads it from the cache. Each sequence's output is torch SDPA over its own keys alone (causal
    for the chunk), placed at its rows, beside the decode rows of the batched kernel."""
    from torch import nn

    from expertmesh.serving.paged_attention import (
        FULL,
        LayerAttention,
        SequenceRows,
        StepAttention,
        batched_decode_attend,
        per_sequence_attend,
    )

    g = torch.Generator().manual_seed(0)
    heads, d = 2, 8
    fresh, decoding = (3, 0), [(1, 4), (1, 2)]  # (tokens this step, past before it)
    pasts = {1: torch.randn(2, 1, heads, 5, d, generator=g), 2: torch.randn(2, 1, heads, 3, d, generator=g)}
    new_keys, new_values = torch.randn(2, 1, heads, 5, d, generator=g)  # [1, h, T, d] each: 3 + 1 + 1 tokens
    for i, (n, start) in enumerate(decoding, start=1):  # the cache holds each decode row's own new key too
        pasts[i][:, :, :, start:] = torch.stack((new_keys, new_values))[:, :, :, 2 + i : 3 + i]
    query = torch.randn(1, heads, 5, d, generator=g)  # [1, H, T, d]
    read: list[int] = []

    class Cache:  # the pool's reader: only what a sequence with a past needs
        def past(self, layer, sequence, first):
            read.append(sequence)
            return pasts[sequence][0][:, :, first:], pasts[sequence][1][:, :, first:]

        def padded_slots(self, sequences, firsts):
            return torch.tensor([[s] * 5 for s in sequences]), [pasts[s].shape[3] for s in sequences]

        def padded_pasts(self, layer, slots):
            def padded(s, t):
                return torch.cat([t, t[:, :, -1:].expand(-1, -1, 5 - t.shape[2], -1)], dim=2)

            keys = torch.cat([padded(s, pasts[s][0]) for s in slots[:, 0].tolist()])
            values = torch.cat([padded(s, pasts[s][1]) for s in slots[:, 0].tolist()])
            return keys, values

    module = nn.Module()
    module.layer_idx, module.num_key_value_groups, module.is_causal = 0, 1, True
    sequences = [SequenceRows(0, fresh[0], fresh[1]), SequenceRows(3, 1, 4), SequenceRows(4, 1, 2)]
    step = StepAttention(sequences, Cache(), "sdpa", (FULL,), None, torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = torch.cat(
        [
            sdpa(query[:, :, :3], new_keys[:, :, :3], new_values[:, :, :3], is_causal=True),
            sdpa(query[:, :, 3:4], pasts[1][0], pasts[1][1]),
            sdpa(query[:, :, 4:5], pasts[2][0], pasts[2][1]),
        ],
        dim=2,
    ).transpose(1, 2)  # [1, T, H, d]
    for attend in (per_sequence_attend, batched_decode_attend):
        read.clear()
        out = attend(LayerAttention(module, query, new_keys, new_values, step, FULL, {}))
        assert 0 not in read, f"{attend.__name__}: the fresh chunk's keys were read back from the cache"
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert read == [], "the batched kernel reads the decode rows' pasts padded, side by side"
