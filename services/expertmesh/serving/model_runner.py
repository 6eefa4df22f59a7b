"""The model runner: one step's plan through the router's model. The only serving code that knows the model and
its device: it packs the plan's chunks into the forward's inputs (``forward.pack``), begins the routing step with
the router's dispatcher and hands it the step's ``StepContext`` (positions, trace links, routing, deadline, the
collectors of degraded tokens and expert choices), runs the forward, and returns each chunk's logits rows
(``ModelRunnerOutput``). It decides nothing about tokens (the output processor does) or blocks (the scheduler).

Two ways to run a step, chosen once for the model (``Batching``): *packed*, one forward for every chunk of the
step (``forward.forward_packed``: each MoE layer dispatches once with all the step's tokens); or the *per-sequence*
fallback, each chunk's own forward on its own cache, for a model the packed step cannot take.

``warm_up`` runs a ``warmup.WarmUpPlan`` through the same packing, buffers, capture and forward before the
engine serves, with the experts calls answered by zeros (``router.model.ZeroExperts``) and KV blocks lent by the
pool for its while: no step counted, no group called, nothing recorded.

A step that fails (its forward raised: an expert group down, a deadline passed in a dispatch; the routing table
unreadable at its start) fails every chunk of it, each with the error; under the per-sequence fallback a chunk's
own forward fails that chunk alone.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
from opentelemetry import trace
from transformers import DynamicCache

from expertmesh.contracts.errors import ExpertMeshError, GroupUnavailable
from expertmesh.infra.cpu_threads import one_thread_while
from expertmesh.infra.finite import finite_rows
from expertmesh.infra.telemetry.setup import tracer
from expertmesh.router.dispatch.step_choices import StepChoices
from expertmesh.router.dispatch.step_context import StepContext
from expertmesh.router.model import ZeroExperts, experts_answered_by
from expertmesh.router.policy.routing_policy import StepRouting, step_routing
from expertmesh.router.policy.token_rules import QueueSignal
from expertmesh.serving.cpu_decode_attention import fuse_decode_attention
from expertmesh.serving.forward import Chunk, MaskSpec, forward_alone, forward_packed, pack
from expertmesh.serving.graph_capture import CAPTURES, choose_capture
from expertmesh.serving.input_buffers import InputBuffers, plan_for
from expertmesh.serving.kv_cache_manager import KVCacheManager
from expertmesh.serving.request import request_span
from expertmesh.serving.sampling import row_argmax
from expertmesh.serving.scheduler import Rows, ScheduledChunk, SchedulerOutput
from expertmesh.serving.warmup import WarmUpPlan

__all__ = ["Batching", "ModelRunner", "ModelRunnerOutput", "StepDispatcher", "batching_of"]

log = logging.getLogger(__name__)


class StepDispatcher(Protocol):
    """What the runner needs of the router's layer dispatcher (``LayerDispatcher``)."""

    def begin_step(self) -> None:
        """A step boundary: the routing view made current for the next step (may read the state store)."""

    def step(self, context: StepContext) -> AbstractContextManager[StepContext]:
        """Within: the model's forward is the step of ``context`` (its ``view`` set)."""

    def routing_epoch(self) -> int:
        """The newest routing epoch the router knows."""


@dataclass(frozen=True)
class Batching:
    """How the runner runs a step (reported by ListModels)."""

    packed: bool  # one forward for all chunks; else the per-sequence fallback
    note: str = ""  # why the fallback, when it is used


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's result: ``logits[i]`` [rows, V] float32 on the host of chunk ``i`` (None: it asked for none, or
    failed); ``errors[i]``: what failed chunk ``i``; the routing epoch the step ran in (None: unknown); the chunks
    a quarantine fallback served tokens of; whether it reached the model (a step refused at its start did not).

    Expert choices: ``choices[f]`` of the step's forward ``f`` (one packed forward, or one per chunk under the
    per-sequence fallback; None: nobody needed them), and ``forward_of[i]`` = (f, sequence of it) of chunk ``i``."""

    logits: list[torch.Tensor | None]
    errors: dict[int, Exception]
    #: chunk i's next token where the runner chose it on the device (greedy-only requests: ``Request.greedy_only``);
    #: its logits are then None
    sampled: tuple[int | None, ...] = ()
    step_epoch: int | None = None
    degraded: frozenset[int] = frozenset()
    choices: tuple[StepChoices | None, ...] = ()
    forward_of: tuple[tuple[int, int], ...] = ()
    reached_model: bool = True

    @classmethod
    def failed(cls, chunks: int, err: Exception, reached_model: bool) -> "ModelRunnerOutput":
        return cls([None] * chunks, {i: err for i in range(chunks)}, reached_model=reached_model)


def batching_of(mask_spec: MaskSpec, packed: bool = True) -> Batching:
    """How a model of ``mask_spec`` is served: packed when the packed step can take it (and ``packed``)."""
    unsupported = mask_spec.unsupported() if packed else "the packed step is switched off"
    return Batching(packed=unsupported is None, note=unsupported or "")


class ModelRunner:
    def __init__(
        self,
        model,
        dispatcher: StepDispatcher,
        kv: KVCacheManager,
        mask_spec: MaskSpec,
        batching: Batching,
        max_step_tokens: int = 1024,
        keep_choices: bool = False,
        serial_step_tokens: int = 0,
    ):
        """``batching``: packed (``kv`` is then a ``PagedKVCacheManager``) or the per-sequence fallback.
        ``max_step_tokens``: the scheduler's step budget (the input buckets'). ``keep_choices``: every step collects
        its expert choices (a load window keeps them). ``serial_step_tokens``: a step of at most this many tokens
        runs on one intra-op thread of the calling thread's (``infra.cpu_threads.one_thread_while``); 0: none."""
        self.model = model
        self._serial_step_tokens = serial_step_tokens
        self._dispatcher = dispatcher
        self._kv = kv
        self._keep_choices = keep_choices
        self.mask_spec = mask_spec
        self.batching = batching
        #: attention modules whose decode steps run as one native op (``cpu_decode_attention``)
        self.fused_attention = (
            fuse_decode_attention(model, mask_spec.kinds, mask_spec.window)
            if batching.packed and mask_spec.kernel == "cpu-paged-decode"
            else 0
        )
        #: the packed forward's inputs, preallocated by size bucket on the model's device
        self.buffers = InputBuffers(max_step_tokens, plan_for(model.device)) if batching.packed else None
        #: how a packed forward runs: eager, or (a GPU's) captured piecewise between the MoE layers
        self.capture = CAPTURES[choose_capture(model.device)]
        #: steps that reached the model
        self.steps = 0
        #: the scheduler's queue at the running step's start (adaptive_k reads it)
        self._queue = QueueSignal()
        #: the running step routes every token exactly (``execute``'s ``exact_routing``)
        self._exact = False
        log.info("model runner: %s", ", ".join(f"{k} {v}" for k, v in self.describe().items()))

    def describe(self) -> dict[str, object]:
        """How this runner runs a step, in words (the log, ``bench serve``'s JSON, the GPU run's record): the
        device, packed or per-sequence, the attention backend, the capture, the input buckets and where greedy
        tokens are chosen."""
        return {
            "device": str(self.model.device),
            "batching": "packed" if self.batching.packed else f"per-sequence ({self.batching.note})",
            "attention_backend": self.mask_spec.kernel,
            "capture": self.capture.mode,
            "input_buckets": list(self.buffers.buckets) if self.buffers is not None else [],
            "pinned_staging": bool(self.buffers is not None and self.buffers.plan.pinned_staging),
            "greedy_tokens_chosen": "on the device" if self.batching.packed else "on the host",
            "fused_decode_attention_layers": self.fused_attention,
        }

    def execute(self, plan: SchedulerOutput, exact_routing: bool = False) -> ModelRunnerOutput:
        """``exact_routing``: every token of the step takes the stock gate, whatever its request's policy (the
        anomaly monitor's fallback, ``router.reporting.anomaly_monitor``); the step spans of requests that asked
        for another policy say so (``expertmesh.routing.exact_fallback``)."""
        chunks = plan.chunks
        self._queue = plan.queue
        self._exact = exact_routing
        try:
            self._dispatcher.begin_step()
        except ExpertMeshError as err:
            return ModelRunnerOutput.failed(len(chunks), err, reached_model=False)
        except ConnectionError as err:  # the state store is unreachable: the groups may be fine, retry next step
            unreadable = GroupUnavailable(f"cannot read the routing table: {err}")
            return ModelRunnerOutput.failed(len(chunks), unreadable, reached_model=False)
        self.steps += 1  # before any of its tokens go out: whoever saw them sees the step counted
        with one_thread_while(plan.num_tokens <= self._serial_step_tokens):
            if self.batching.packed:
                return self._packed(chunks)
            return self._alone(chunks)

    # -- the warm-up ------------------------------------------------------------------------------

    def warm_up(self, plan: WarmUpPlan) -> None:
        """``plan``'s prompt chunk, then its decode step, through this runner's path (see the module); raises
        what a forward raises. The engine's thread, before it serves: the model's only user."""
        vocab = self.model.config.get_text_config().vocab_size
        prompt = tuple(i % vocab for i in range(plan.prefill_tokens))
        with experts_answered_by(self.model, ZeroExperts()), torch.no_grad():
            if self.batching.packed:
                self._warm_packed(plan, prompt)
            else:
                cache = DynamicCache(config=self.model.config)
                forward_alone(self.model, Chunk(cache, prompt, 0, Rows.LAST))
                forward_alone(self.model, Chunk(cache, prompt[:1], plan.prefill_tokens, Rows.LAST))
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _warm_packed(self, plan: WarmUpPlan, prompt: tuple[int, ...]) -> None:
        with self._kv.scratch(plan.blocks) as blocks:
            past, own = blocks[: plan.prefill_tokens // self._kv.block_size], blocks[-plan.decode_sequences :]
            self._warm_forward([Chunk(past, prompt, 0, Rows.LAST)])
            decode = [
                Chunk([*past, block], (prompt[i % len(prompt)],), len(prompt), Rows.LAST) for i, block in enumerate(own)
            ]
            self._warm_forward(decode)

    def _warm_forward(self, chunks: list[Chunk]) -> None:
        """One packed forward of ``chunks`` as ``_packed`` runs it, the logits' greedy tokens and rows to the host."""
        batch = pack(chunks, self.mask_spec, self._kv.tensors)
        inputs = self.buffers.load(batch.input_ids, batch.positions, batch.logit_rows)
        bucket = self.buffers.bucket(batch.positions.shape[0])
        rows = self.capture.run(bucket, lambda: forward_packed(self.model, batch, inputs))  # [R, V]
        rows.argmax(-1).cpu(), rows.float().cpu()

    # -- the step's context -----------------------------------------------------------------------

    def _context(self, chunks: list[ScheduledChunk], positions: torch.Tensor) -> StepContext:
        requests = [c.request for c in chunks]
        deadlines = [r.params.deadline for r in requests]
        detail = [r.params.routing_trace and c.rows is Rows.LAST for r, c in zip(requests, chunks)]
        tokens = [len(c.token_ids) for c in chunks]
        return StepContext(
            positions=positions,
            tokens_per_sequence=tokens,
            routing=self._routing(chunks),
            # the group calls need not outlive the last request that still wants their answer
            deadline=None if None in deadlines else max(deadlines),
            choices=StepChoices(tokens, detail) if self._keep_choices or any(detail) else None,
        )

    def _routing(self, chunks: list[ScheduledChunk]) -> StepRouting | None:
        return step_routing(
            [(c.request.params.routing, len(c.token_ids)) for c in chunks],
            # the answer index of each chunk's first token (what decay_k counts from; at most 0 in the prompt)
            [c.start + 1 - c.request.num_prompt_tokens for c in chunks],
            [c.request.widen for c in chunks],
            queue=self._queue,
            states=[c.request.routing_state for c in chunks],
            exact=self._exact,
        )

    def _span(self, chunk: ScheduledChunk, step_size: int) -> trace.Span:
        """This request's share of the step, in its request's trace."""
        attributes = {
            "expertmesh.step": self.steps,
            "expertmesh.tokens": len(chunk.token_ids),
            "expertmesh.batch": step_size,
        }
        routing = chunk.request.params.routing
        if self._exact and routing is not None and not routing.policy.is_exact:
            attributes["expertmesh.routing.exact_fallback"] = True  # its own policy set aside for this step
        return tracer().start_span("expertmesh.step", context=chunk.request.trace_context, attributes=attributes)

    def _chunk(self, chunk: ScheduledChunk) -> Chunk:
        return Chunk(self._kv.cache_of(chunk.request), chunk.token_ids, chunk.start, chunk.rows)

    # -- the two ways -------------------------------------------------------------------------------

    def _packed(self, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """One forward for all ``chunks``; if it fails, so do all of them (and no others)."""
        spans = [self._span(c, len(chunks)) for c in chunks]
        try:
            batch = pack([self._chunk(c) for c in chunks], self.mask_spec, self._kv.tensors)
            context = self._context(chunks, batch.positions)
            # The forward's spans nest under the first request's step; the other requests' steps are linked.
            context.links = tuple(span.get_span_context() for span in spans[1:])
            with trace.use_span(spans[0]), self._dispatcher.step(context), torch.no_grad():
                inputs = self.buffers.load(batch.input_ids, batch.positions, batch.logit_rows)
                bucket = self.buffers.bucket(batch.positions.shape[0])
                rows = self.capture.run(bucket, lambda: forward_packed(self.model, batch, inputs))  # [R, V]
                logits, sampled = split_logits(rows, batch.rows_per_chunk, chunks)
            context.degraded.mark([(span, request_span(c.request)) for span, c in zip(spans, chunks)])
        except Exception as err:
            log.log(
                logging.WARNING if isinstance(err, ExpertMeshError) else logging.ERROR,
                "step %d failed for its %d requests: %s",
                self.steps,
                len(chunks),
                err,
                exc_info=not isinstance(err, ExpertMeshError),
            )
            return ModelRunnerOutput.failed(len(chunks), err, reached_model=True)
        finally:
            for span in spans:
                span.end()
        return ModelRunnerOutput(
            logits,
            {},
            sampled,
            context.epoch,
            frozenset(context.degraded.sequences),
            (context.choices,),
            tuple((0, i) for i in range(len(chunks))),
        )

    def _alone(self, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """The per-sequence fallback: each chunk's own forward; one that fails fails its chunk alone. Its expert
        choices are kept per chunk (the load window's) and no prefix cache needs the epoch."""
        logits: list[torch.Tensor | None] = []
        errors: dict[int, Exception] = {}
        choices: list[StepChoices | None] = []
        for i, chunk in enumerate(chunks):
            span = self._span(chunk, len(chunks))
            context = self._context([chunk], torch.arange(chunk.start, chunk.end))
            choices.append(context.choices)
            try:
                with trace.use_span(span, end_on_exit=True), self._dispatcher.step(context), torch.no_grad():
                    logits.append(forward_alone(self.model, self._chunk(chunk)))
                    context.degraded.mark([(span, request_span(chunk.request))])
            except Exception as err:
                errors[i] = err
                logits.append(None)
        return ModelRunnerOutput(
            logits, errors, choices=tuple(choices), forward_of=tuple((i, 0) for i in range(len(chunks)))
        )


def split_logits(
    logits: torch.Tensor, rows_per_chunk: list[int], chunks: list[ScheduledChunk]
) -> tuple[list[torch.Tensor | None], tuple[int | None, ...]]:
    """logits [R, V] where the model computed them -> per chunk, its rows as float32 on the host (None: it asked
    for none, or its token was chosen here), and its next token where it was chosen here: the argmax of a
    greedy-only request's row (ties to the lowest id, as the host's choice), when that row is finite (else the
    row goes to the host, whose choice refuses it). Only what the host needs crosses to it."""
    parts = logits.split(rows_per_chunk)
    ends = [i for i, (c, n) in enumerate(zip(chunks, rows_per_chunk)) if n and c.rows is Rows.LAST]
    ends = [i for i in ends if chunks[i].request.greedy_only]
    chosen: dict[int, int] = {}
    if ends:
        # Each greedy chunk's last row, by one index (a decode step's G = R rows are all of them: no copy); the
        # rows' finiteness by their sums, element by element only when one is not (``finite_rows``): at 64
        # decoding sequences of a 32000-token vocabulary, isfinite over all rows cost 3.5 ms a step
        ends_at = list(accumulate(rows_per_chunk))
        last_rows = [ends_at[i] - 1 for i in ends]  # [G]
        last = logits if last_rows == list(range(logits.shape[0])) else logits[torch.tensor(last_rows)]
        last = last.float()  # [G, V]
        ids, finite = row_argmax(last), finite_rows(last).cpu().tolist()  # [G] each
        chosen = {i: token for i, token, ok in zip(ends, ids, finite) if ok}
    host = [
        None if not n or i in chosen else part.float().cpu() for i, (part, n) in enumerate(zip(parts, rows_per_chunk))
    ]
    return host, tuple(chosen.get(i) for i in range(len(chunks)))
