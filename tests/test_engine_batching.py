"""The engine's step: one packed forward for every active sequence, on every MoE
architecture we verify. Requests that join at different steps, with prompts
chunked across steps, get the very tokens stock transformers gives each of them
alone (greedy), the same seeded samples as when served alone, and Score gets the
stock prompt logits; the experts function runs once per MoE layer per step, on
the engine's one thread, with the positions and trace links of every token.

The tiny checkpoints of the fidelity tests, with a local experts implementation,
stand in for the router's model, so no expert group is needed."""

import dataclasses
import threading
import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from expertmesh.models.checkpoint import experts_modules
from expertmesh.models.tiny import MOE_ARCHITECTURES
from expertmesh.router.dispatch.experts_impl import IMPLEMENTATION
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import FinishEvent, ScoreEvent, TokenEvent
from expertmesh.serving.forward import FULL, SLIDING, Chunk, MaskSpec, Rows, pack
from expertmesh.serving.kv_cache import KVPool
from expertmesh.serving.request import GenerationRequest, ScoreSpec
from expertmesh.serving.sampling import SamplingParams
from helpers import StepDispatcher, bare_dispatcher, stock_greedy

RECORDING = "expertmesh_test_recording"
CALLS: list[tuple[int, int]] = []  # (thread id, tokens) of every experts call


def _recording_experts(module, hidden, top_k_index, top_k_weights):  # hidden [T, H]
    CALLS.append((threading.get_ident(), hidden.shape[0]))
    return ALL_EXPERTS_FUNCTIONS["batched_mm"](module, hidden, top_k_index, top_k_weights)


ExpertsInterface.register(RECORDING, _recording_experts)

THREADS = "expertmesh_test_threads"
THREADS_SEEN: list[tuple[int, int]] = []  # (tokens, the calling thread's intra-op threads) of every experts call


def _threads_experts(module, hidden, top_k_index, top_k_weights):
    THREADS_SEEN.append((hidden.shape[0], torch.get_num_threads()))
    return ALL_EXPERTS_FUNCTIONS["batched_mm"](module, hidden, top_k_index, top_k_weights)


ExpertsInterface.register(THREADS, _threads_experts)


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    """arch -> the tiny checkpoint (random biases and correction terms too) with the recording experts."""
    cache = {}

    def get(arch, experts=RECORDING):
        if (arch, experts) not in cache:
            path = tiny_checkpoints(arch)
            cache[arch, experts] = AutoModelForCausalLM.from_pretrained(path, experts_implementation=experts).eval()
        return cache[arch, experts]

    return get


def _tokens(events):
    assert isinstance(events[-1], FinishEvent), events[-1]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


#: (prompt, new tokens): a one-token prompt, prompts longer than a step's budget, a late joiner
REQUESTS = [((5, 6, 7), 10), (tuple(range(3, 24)), 6), ((9,), 12), ((4, 50, 42, 11, 12, 13, 14, 15, 16), 8)]


def _serve(engine, requests, late=()):
    """Submit ``requests``, start, and submit ``late`` once the first token of the first request is out."""
    seqs = [engine.submit(r) for r in requests]
    engine.start()
    first = iter(seqs[0])
    head = [next(first)]
    seqs += [engine.submit(r) for r in late]
    events = [head + list(first)] + [list(s) for s in seqs[1:]]
    return {r.request_id: e for r, e in zip([*requests, *late], events)}


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_packed_steps_match_stock_greedy_alone(models, arch):
    model = models(arch)
    expected = {f"r{i}": stock_greedy(model, p, n) for i, (p, n) in enumerate(REQUESTS)}
    engine = Engine(model, None, StepDispatcher(), EngineLimits(8, 8, max_step_tokens=8), max_context=64)
    assert engine.batching.packed, engine.batching.note
    requests = [GenerationRequest(f"r{i}", p, max_new_tokens=n, stop_at_eos=False) for i, (p, n) in enumerate(REQUESTS)]
    CALLS.clear()
    try:
        events = _serve(engine, requests[:3], late=requests[3:])
    finally:
        engine.stop()
    assert {rid: _tokens(e) for rid, e in events.items()} == expected
    moe_layers = len(experts_modules(model))
    assert len(CALLS) == engine.steps * moe_layers, "one experts call per MoE layer per step"
    assert {thread for thread, _ in CALLS} == {engine._thread.ident}, "all on the engine's thread"
    assert max(tokens for _, tokens in CALLS) == 8, "prompt chunks fill the step's budget"
    assert engine.steps < sum(n for _, n in REQUESTS) / 2


def test_small_steps_run_on_one_intra_op_thread_and_the_rest_on_all(models):
    """A step of at most ``serial_step_tokens`` tokens runs on one of the engine thread's intra-op threads, a larger
    one on all of them (``infra.cpu_threads.one_thread_while``); the tokens stay stock's."""
    model = models("mixtral", THREADS)
    prompt = tuple(range(3, 9))  # 6 tokens: a prompt step of 6, then decode steps of 1
    expected = stock_greedy(model, prompt, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the engine's thread starts from the process's setting
    THREADS_SEEN.clear()
    engine = Engine(model, None, StepDispatcher(), EngineLimits(4, 4, serial_step_tokens=2), max_context=64)
    try:
        events = _serve(engine, [GenerationRequest("a", prompt, max_new_tokens=4, stop_at_eos=False)])
    finally:
        engine.stop()
        torch.set_num_threads(threads)
    assert _tokens(events["a"]) == expected
    by_size = {(tokens, n) for tokens, n in THREADS_SEEN}  # the warm-up's steps (a chunk, a decode step) too
    assert {(6, 2), (1, 1)} <= by_size, by_size
    assert all(n == (1 if tokens <= 2 else 2) for tokens, n in by_size), by_size


def test_a_narrowed_steps_decode_attention_takes_the_routers_threads_back(models, monkeypatch):
    """The engine's ``wide_threads`` reach the decode attention's kernel (``MaskSpec.threads`` -> the step's
    ``StepAttention.threads``): each call asks ``all_threads_for`` for them with its [B, H, dv] outputs as its work,
    or, where the decode step's attention half is one op (``cpu_decode_attention``), its widest product's [B, N]
    (the rule itself: ``test_cpu_threads``); the tokens stay stock's."""
    from expertmesh.serving import cpu_decode_attention, paged_attention

    asked: list[tuple[int, int]] = []
    real = paged_attention.all_threads_for

    def recording(work: int, threads: int):
        asked.append((work, threads))
        return real(work, threads)

    monkeypatch.setattr(paged_attention, "all_threads_for", recording)
    monkeypatch.setattr(cpu_decode_attention, "all_threads_for", recording)
    model = models("mixtral")
    prompt = tuple(range(3, 9))
    limits = EngineLimits(4, 4, serial_step_tokens=8, wide_threads=3)
    engine = Engine(model, None, StepDispatcher(), limits, max_context=64)
    if engine.runner.mask_spec.kernel != "cpu-paged-decode":
        engine.stop()
        pytest.skip("the paged-decode kernel did not build here (no C++ compiler)")
    try:
        events = _serve(engine, [GenerationRequest("a", prompt, max_new_tokens=4, stop_at_eos=False)])
    finally:
        engine.stop()
    assert _tokens(events["a"]) == stock_greedy(model, prompt, 4)
    assert engine.runner.mask_spec.threads == 3
    heads = model.config.num_attention_heads
    row_outputs = heads * (getattr(model.config, "head_dim", None) or model.config.hidden_size // heads)
    assert asked and all(threads == 3 and work % row_outputs == 0 for work, threads in asked), asked


def test_a_long_prompt_alone_is_read_in_chunks(models):
    """Steps that only read prompt need no logits at all; the first token comes with the last chunk."""
    model = models("olmoe")
    prompt = tuple(range(3, 25))  # 22 tokens: 6 steps of at most 4
    engine = Engine(model, None, StepDispatcher(), EngineLimits(4, 4, max_step_tokens=4), max_context=64).start()
    try:
        events = list(engine.submit(GenerationRequest("long", prompt, max_new_tokens=5, stop_at_eos=False)))
    finally:
        engine.stop()
    assert _tokens(events) == stock_greedy(model, prompt, 5)
    assert engine.steps == 6 + 4


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_score_matches_stock_prompt_logits_across_chunks(models, arch):
    model = models(arch)
    prompt = tuple(range(3, 23))
    with torch.no_grad():
        stock = model(input_ids=torch.tensor([prompt])).logits[0]  # [P, V]
    engine = Engine(model, None, StepDispatcher(), EngineLimits(4, 4, max_step_tokens=6), max_context=64).start()
    try:
        decoding = engine.submit(GenerationRequest("beside", (7, 8), max_new_tokens=6, stop_at_eos=False))
        (scored,) = list(engine.submit(GenerationRequest("score", prompt, score=ScoreSpec())))
        full = ScoreSpec(raw_logits=True, full_distribution=True)
        (raw,) = list(engine.submit(GenerationRequest("raw", prompt, score=full)))
        assert isinstance(list(decoding)[-1], FinishEvent)
    finally:
        engine.stop()
    assert isinstance(scored, ScoreEvent) and scored.distribution is None, "rows are reported only when asked for"
    expected = stock.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]  # [P - 1]
    torch.testing.assert_close(
        torch.tensor(scored.token_scores), torch.cat([torch.zeros(1), expected]), atol=1e-5, rtol=0
    )
    assert raw.distribution.shape == stock.shape
    torch.testing.assert_close(raw.distribution, stock, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.tensor(raw.token_scores[1:]), stock[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    )


def test_seeded_sampling_is_the_same_together_and_alone(models):
    model = models("qwen3_moe")
    sampled = [
        GenerationRequest(
            f"s{i}",
            (5 + i, 6, 7),
            max_new_tokens=10,
            stop_at_eos=False,
            sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=i),
        )
        for i in range(3)
    ]
    greedy = GenerationRequest("g", (9, 9), max_new_tokens=10, stop_at_eos=False)

    def serve(requests):
        engine = Engine(model, None, StepDispatcher(), EngineLimits(8, 8), max_context=64)
        try:
            return {rid: _tokens(e) for rid, e in _serve(engine, requests).items()}
        finally:
            engine.stop()

    together = serve([*sampled, greedy])
    for request in [*sampled, greedy]:
        assert serve([request])[request.request_id] == together[request.request_id]


def test_the_per_sequence_fallback_gives_the_same_tokens(models):
    model = models("gpt_oss")
    requests = [GenerationRequest(f"r{i}", p, max_new_tokens=n, stop_at_eos=False) for i, (p, n) in enumerate(REQUESTS)]
    engine = Engine(model, None, StepDispatcher(), EngineLimits(8, 8, max_step_tokens=8), max_context=64, packed=False)
    assert not engine.batching.packed and engine.batching.note == "the packed step is switched off"
    try:
        events = _serve(engine, requests)
    finally:
        engine.stop()
    assert {rid: _tokens(e) for rid, e in events.items()} == {
        f"r{i}": stock_greedy(model, p, n) for i, (p, n) in enumerate(REQUESTS)
    }


def test_models_the_packed_step_cannot_take_are_named(models):
    spec = MaskSpec.of(models("gpt_oss"))
    assert spec.unsupported() is None
    assert (
        "'flash_attention_2' is not one the step runs per sequence"
        in dataclasses.replace(spec, implementation="flash_attention_2").unsupported()
    )
    hybrid = dataclasses.replace(spec, kinds=("linear_attention", "full_attention"))
    assert hybrid.unsupported() == "layers of type linear_attention keep state outside the KV cache"


def test_each_layer_dispatch_carries_the_steps_positions_links_and_deadline(tiny_checkpoints):
    """The router's own LayerDispatcher.experts path (its remote dispatch replaced by a local one)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints("mixtral"), experts_implementation=IMPLEMENTATION
    ).eval()
    dispatcher = bare_dispatcher(types.SimpleNamespace(endpoints=dict), (0, 1))
    dispatcher.watcher.refresh = lambda: None
    seen = []

    def local_dispatch(layer, hidden, top_k_index, top_k_weights, step=None):
        seen.append((layer, step.positions.tolist(), len(step.links), step.deadline))
        module = experts_modules(model)[layer][1]
        return ALL_EXPERTS_FUNCTIONS["batched_mm"](module, hidden, top_k_index, top_k_weights)

    dispatcher.dispatch = local_dispatch
    for layer, (_, module) in experts_modules(model).items():
        module._expertmesh_layer = layer
        module._expertmesh_dispatcher = dispatcher
    engine = Engine(model, None, dispatcher, EngineLimits(4, 4), max_context=64)
    far = 1e12
    requests = [
        GenerationRequest("a", (5, 6, 7), max_new_tokens=2, stop_at_eos=False, deadline=far),
        GenerationRequest("b", (8, 9), max_new_tokens=2, stop_at_eos=False, deadline=far + 1),
    ]
    try:
        events = _serve(engine, requests)
    finally:
        engine.stop()
    assert all(isinstance(e[-1], FinishEvent) for e in events.values())
    assert seen == [
        (0, [0, 1, 2, 0, 1], 1, far + 1),
        (1, [0, 1, 2, 0, 1], 1, far + 1),  # both prompts
        (0, [3, 2], 1, far + 1),
        (1, [3, 2], 1, far + 1),  # one token each
    ]


@pytest.mark.parametrize("window", [None, 3])
def test_pack_lets_each_token_see_its_own_sequence_only(window):
    """pack's layout against the definition, token by token: a query at position p of sequence s
    sees keys 0..p of s (within the window on sliding layers), and no other sequence's."""
    chunks = [  # a decode token, a prompt chunk with more to come, a whole short prompt, a Score
        Chunk([5, 2], (7,), 5, Rows.LAST),  # blocks of 4 positions: position 5 is slot 2 * 4 + 1
        Chunk([0], (3, 4, 5, 6), 0, Rows.NONE),
        Chunk([3], (8, 9), 2, Rows.LAST),
        Chunk([1], (10, 11, 12), 0, Rows.ALL),
    ]
    kinds = (FULL, SLIDING) if window else (FULL,)
    batch = pack(chunks, MaskSpec("sdpa", kinds, window, torch.float32), KVPool(6, 4))
    assert batch.cache._write.tolist() == [9, 0, 1, 2, 3, 14, 15, 4, 5, 6]
    assert batch.cache._read.tolist() == [20, 21, 22, 23, 8, 9, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6]
    queries = [(s, c.start + i) for s, c in enumerate(chunks) for i in range(len(c.token_ids))]
    assert batch.positions.tolist() == [p for _, p in queries]
    assert batch.input_ids.tolist() == [[t for c in chunks for t in c.token_ids]]
    step = batch.attention
    for s, chunk in enumerate(chunks):
        rows = step.sequences[s]
        assert [queries[rows.offset + i] for i in range(rows.n)] == [
            (s, chunk.start + i) for i in range(len(chunk.token_ids))
        ]
        for kind in kinds:
            first, allowed = step.allowed(s, kind)
            end = chunk.start + len(chunk.token_ids)
            # every key the definition allows lies in the range read from the cache
            assert all(kind == FULL or p <= qp - window for qp in range(chunk.start, end) for p in range(first))
            expected = [
                [kp <= qp and (kind == FULL or kp > qp - window) for kp in range(first, end)]
                for qp in range(chunk.start, end)
            ]
            assert allowed.tolist() == expected
            _, mask = step.mask(s, kind)
            if mask is None:  # sdpa then sees all keys (one query) or applies its own causal flag (a whole chunk)
                n = len(chunk.token_ids)
                plain = [[True] * len(expected[0])] if n == 1 else torch.ones(n, n).tril().bool().tolist()
                assert expected == plain
            else:
                assert mask[0, 0].tolist() == expected
    assert batch.logit_rows.tolist() == [0, 6, 7, 8, 9] and batch.rows_per_chunk == [1, 0, 1, 3]


def test_prompts_attend_on_the_cpu_prefill_kernel_with_stock_tokens(tiny_checkpoints, monkeypatch):
    """With heads the CPU prefill kernel takes (32 wide), a prompt's chunks attend on it (``cpu_paged_decode_attend``
    -> ``cpu_prefill_attention``): the first chunk over its own keys, the next over the cached ones too; a prompt
    that joins while others decode, and the same prompt again; every request gets stock transformers' greedy
    tokens. A spy records the kernel's calls (nothing is faked)."""
    from expertmesh.serving import cpu_prefill_attention

    calls: list[tuple[int, int]] = []  # (queries, keys) of each call
    real = cpu_prefill_attention.causal_attention

    def recording(query, keys, values, scale):
        calls.append((query.shape[2], keys.shape[2]))
        return real(query, keys, values, scale)

    monkeypatch.setattr(cpu_prefill_attention, "causal_attention", recording)
    path = tiny_checkpoints("mixtral", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # heads of 32
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=RECORDING).eval()
    long_prompt = tuple(range(3, 73))  # 70 tokens: chunks of 40 and 30
    requests = [
        GenerationRequest("long", long_prompt, max_new_tokens=5, stop_at_eos=False),
        GenerationRequest("short", tuple(3 + i * 7 % 90 for i in range(35)), max_new_tokens=8, stop_at_eos=False),
    ]
    again = GenerationRequest("again", long_prompt, max_new_tokens=5, stop_at_eos=False)
    engine = Engine(model, None, StepDispatcher(), EngineLimits(8, 8, max_step_tokens=40), max_context=128)
    if engine.runner.mask_spec.kernel != "cpu-paged-decode" or not cpu_prefill_attention.load():
        engine.stop()
        pytest.skip("the CPU attention kernels did not build here (no C++ compiler)")
    try:
        events = _serve(engine, requests[:1], late=requests[1:])
        events["again"] = list(engine.submit(again))
    finally:
        engine.stop()
    assert _tokens(events["long"]) == _tokens(events["again"]) == stock_greedy(model, long_prompt, 5)
    assert _tokens(events["short"]) == stock_greedy(model, requests[1].prompt_ids, 8)
    assert (40, 40) in calls and (30, 70) in calls, calls  # a first chunk and a later one
