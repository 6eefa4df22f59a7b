"""The serving engine: continuous batching over the router's model, in vLLM v1's shape. One thread steps:

    plan = scheduler.schedule()            # who joins, with how many tokens, which blocks (no tensors)
    out = model_runner.execute(plan)       # one forward (the MoE layers dispatch to the expert groups)
    outcomes = output_processor.process(plan, out)   # tokens, stops, logprobs, the guard, events
    scheduler.update_from_output(plan, outcomes, ...) # computed tokens, the prefix cache, the finished

The parts (each module's docstring has its glossary): ``request`` (what was asked, how far it got),
``scheduler`` (queues, admission, chunked prefill, preemption), ``kv_cache_manager`` (the paged pool and the
prefix cache, or the per-sequence fallback's caches), ``model_runner`` (the model and its device, the step's
context for the router), ``output_processor`` (sampling and everything after it), ``events`` (what a caller
hears). This module only wires them and runs the loop: requests join and leave, and the routing table may switch
version, only at a step boundary. Before its first step the loop runs the warm-up (``warmup``: a prompt chunk and a
decode step through the model runner, nothing counted), unless switched off; ``warm_up_state`` says where it is.

The step's attention lets each query see only its own sequence's past, and every other layer works row by row,
so a request's tokens are what they would be if it were served alone: in float32 greedy output is
token-identical (checked on every architecture we verify); in bfloat16 a batch moves logits by a rounding step at
most, as batched expert dispatch always did, which can turn an exact near-tie. Sampling is the engine's own, per
request, with its own seeded generator.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from opentelemetry import context as otel_context

from expertmesh.contracts.errors import ShuttingDown
from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.reporting.anomaly_monitor import AnomalyMonitor
from expertmesh.serving.events import Failure
from expertmesh.serving.forward import SLIDING, MaskSpec
from expertmesh.serving.grammar import Grammars
from expertmesh.serving.kv_cache_manager import DynamicKVCacheManager, KVCacheManager, KVUsage, PagedKVCacheManager
from expertmesh.serving.model_runner import Batching, ModelRunner, StepDispatcher, batching_of
from expertmesh.serving.output_processor import OutputProcessor
from expertmesh.serving.request import GenerationRequest, Request
from expertmesh.serving.scheduler import Scheduler, SchedulerLimits
from expertmesh.serving.step_tally import StepTally
from expertmesh.serving.warmup import WarmUpState, plan_warm_up

__all__ = ["Engine", "EngineLimits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    max_active: int = 32
    max_queued: int = 128
    #: tokens one step feeds at most, decoding requests' tokens first; prompts beyond it are chunked
    max_step_tokens: int = 1024
    #: the KV pool's size (None: ``kv_cache.auto_cache_bytes``, at most what max_active requests of the whole
    #: context need); the packed step only
    kv_cache_bytes: int | None = None
    #: token positions per KV block
    kv_block_size: int = 16
    #: share the KV blocks of equal prompt prefixes between requests
    prefix_caching: bool = True
    #: a step of at most this many tokens runs on one intra-op thread of the engine's (``model_runner``); 0: none
    serial_step_tokens: int = 64
    #: the router's intra-op threads, which such a step's large products take back (``cpu_threads.all_threads_for``:
    #: the decode attention here, the dense products in the router's model); 0: none
    wide_threads: int = 0


@dataclass
class _PrefixResets:
    """Prefix-cache resets asked for and done (on the engine's thread, at a step boundary), and what the latest
    forgot."""

    asked: int = 0
    done: int = 0
    forgotten: int = 0


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        dispatcher: StepDispatcher,
        limits: EngineLimits,
        max_context: int,
        packed: bool = True,
        model_fingerprint: str = "",
        warm_up: bool = True,
        anomalies: AnomalyMonitor | None = None,
    ):
        """``packed=False`` runs the per-sequence fallback even for a model the packed step can take.
        ``model_fingerprint``: the checkpoint's, part of every prefix-cache key (``kv_blocks.PrefixScope``).
        ``warm_up``: run the warm-up before the first step (``warmup``). ``anomalies``: fed at every step boundary
        (gate confidence, KV fragmentation); while its ``exact_routing`` holds, steps route every token exactly."""
        self.limits = limits
        self.anomalies = anomalies
        self.max_context = max_context
        mask_spec = MaskSpec.of(model, limits.wide_threads)
        self.batching: Batching = batching_of(mask_spec, packed)
        if not self.batching.packed:
            log.warning("%s serves one forward per sequence: %s", type(model).__name__, self.batching.note)
        self.kv = self._kv_manager(model, mask_spec, self.batching, limits, max_context, model_fingerprint)
        self.scheduler = Scheduler(
            self.kv,
            SchedulerLimits(limits.max_active, limits.max_queued, limits.max_step_tokens),
            routing_epoch=getattr(dispatcher, "routing_epoch", lambda: 0),
        )
        load_window = getattr(dispatcher, "load_window", None)
        self.runner = ModelRunner(
            model,
            dispatcher,
            self.kv,
            mask_spec,
            self.batching,
            max_step_tokens=limits.max_step_tokens,
            serial_step_tokens=limits.serial_step_tokens,
            keep_choices=load_window is not None,
        )
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.outputs = OutputProcessor(tokenizer, eos_ids, max_context, load_window)
        #: structured output's compiler and cache, for the APIs to compile a request's grammar with
        self.grammars = Grammars(tokenizer, model.config.get_text_config().vocab_size, eos_ids)
        #: every step's kind, tokens and wall time: the step histograms, and totals for benchmarks in this process
        self.step_tally = StepTally()
        self._queue_time = meter().create_histogram(
            "expertmesh.request.queue_time",
            unit="s",
            description="submit to first joining a step (waiting for a slot or KV blocks)",
        )
        self._cond = threading.Condition()
        self._accepting, self._stopping = True, False
        self._resets = _PrefixResets()
        self._thread = threading.Thread(target=self._loop, name="expertmesh-engine", daemon=True)
        self._kv_usage = self.kv.usage([])  # the empty pool, reported before the first step
        #: where the warm-up stands; replaced whole (read by /health from other threads)
        self.warm_up_state = WarmUpState() if warm_up else WarmUpState("off", detail="switched off")
        #: set once the warm-up is over (done, failed or off)
        self.warmed = threading.Event()

    @staticmethod
    def _kv_manager(
        model, mask_spec: MaskSpec, batching: Batching, limits: EngineLimits, max_context: int, fingerprint: str
    ) -> KVCacheManager:
        if not batching.packed:
            return DynamicKVCacheManager(model.config)
        return PagedKVCacheManager.for_model(
            model,
            limits.kv_block_size,
            limits.kv_cache_bytes,
            limits.max_active,
            max_context,
            prefix_caching=limits.prefix_caching,
            # tokens every layer sees, when every layer is sliding-window (blocks behind them are given back)
            window=mask_spec.window if set(mask_spec.kinds) == {SLIDING} else None,
            model_fingerprint=fingerprint,
        )

    @property
    def steps(self) -> int:
        """Steps that reached the model so far."""
        return self.runner.steps

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let the in-flight ones finish. True if all did within ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._accepting = False
            while self.scheduler.has_work():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        with self._cond:
            self._accepting, self._stopping = False, True
            for request in self.scheduler.drop_all():
                self.outputs.fail(request, Failure.UNAVAILABLE, "the server is shutting down")
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # -- requests --------------------------------------------------------------------

    def submit(self, params: GenerationRequest) -> Request:
        """Queue ``params``, which the APIs' request builder (``serving.request_builder``) has checked against
        every bound; only what needs the engine's own state is checked here (the KV pool, the queue)."""
        self.kv.check_fits(params, self.max_context)
        request = Request(params, trace_context=otel_context.get_current())
        self.outputs.start(request)
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is draining and takes no new requests")
            self.scheduler.add_request(request)
            self._cond.notify_all()
        return request

    def kv_usage(self) -> KVUsage | None:
        """The KV pool's use at the latest step boundary (None under the per-sequence fallback, which has no pool)."""
        return self._kv_usage

    def guard_tally(self) -> tuple[int, int]:
        """(checks, rollbacks) of the consistency guard since the engine started."""
        stats = self.outputs.guard_stats
        return stats.checks, stats.rollbacks

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (vLLM's ``reset_prefix_cache``): later requests prefill their prompts
        again. Blocks that running requests hold stay theirs. Done at the next step boundary; returns the prefixes
        forgotten (0 under the per-sequence fallback, which caches none)."""
        with self._cond:
            if not self._thread.is_alive():  # not started (or stopped): no step runs, nothing to wait for
                return self.kv.reset_prefix_cache()
            self._resets.asked += 1
            asked = self._resets.asked
            self._cond.notify_all()
            while self._resets.done < asked and not self._stopping:
                self._cond.wait()
            return self._resets.forgotten

    def load(self) -> tuple[int, int]:
        """(active, queued) requests right now."""
        with self._cond:
            return len(self.scheduler.running), len(self.scheduler.waiting)

    # -- the loop ----------------------------------------------------------------------

    def _warm_up(self) -> None:
        """The warm-up, on the engine's thread before its first step (see ``warmup``); a failure is logged and
        reported, and the engine serves anyway (its first requests cold)."""
        if self.warm_up_state.status == "off":
            self.warmed.set()
            return
        limits = self.limits
        free = self.kv.available() if self.batching.packed else None
        plan = plan_warm_up(limits.max_step_tokens, limits.max_active, self.max_context, self.kv.block_size, free)
        if plan is None:
            self.warm_up_state = WarmUpState("done", 0.0, "none: no prompt chunk and decode step fit the KV pool")
            self.warmed.set()
            return
        n = plan.decode_sequences
        detail = f"a prompt chunk of {plan.prefill_tokens} tokens, a decode step of {n} sequence{'s' * (n > 1)}"
        self.warm_up_state = WarmUpState("running", detail=detail)
        started = time.perf_counter()
        try:
            self.runner.warm_up(plan)
        except Exception as err:
            seconds = time.perf_counter() - started
            log.exception("warm-up failed after %.3fs (%s); serving without it", seconds, detail)
            self.warm_up_state = WarmUpState("failed", seconds, detail, f"{type(err).__name__}: {err}")
        else:
            seconds = time.perf_counter() - started
            log.info("warm-up took %.3fs: %s", seconds, detail)
            self.warm_up_state = WarmUpState("done", seconds, detail)
        self.warmed.set()

    def _loop(self) -> None:
        self._warm_up()
        while True:
            with self._cond:
                resets = self._resets
                while not (self.scheduler.has_work() or self._stopping or resets.asked > resets.done):
                    self._cond.wait()
                if self._stopping:
                    self._cond.notify_all()  # a reset waiting for this loop waits no more
                    return
                if resets.asked > resets.done:  # at a step boundary, on this thread: no step holds a block
                    resets.forgotten, resets.done = self.kv.reset_prefix_cache(), resets.asked
                    self._cond.notify_all()
            try:
                self.step()
            except Exception as err:  # the loop must outlive any one step, or every later request hangs
                log.exception("step failed")
                with self._cond:
                    for request in list(self.scheduler.running):
                        self.outputs.fail(request, Failure.INTERNAL, f"step failed: {type(err).__name__}: {err}")
                        self.scheduler.finish(request)
            with self._cond:
                self._kv_usage = self.kv.usage(self.scheduler.running)
                self._cond.notify_all()

    def step(self) -> None:
        """One step: schedule -> execute -> update."""
        with self._cond:
            plan = self.scheduler.schedule()
            self._kv_usage = self.kv.usage(self.scheduler.running)
        for request, failure, message in plan.aborted:
            self.outputs.fail(request, failure, message)
            log.info(
                "request %s ended (%s) after %d tokens", request.request_id, failure, len(request.output_token_ids)
            )
        for request in plan.preempted:
            self.outputs.preempted(request)
        for request in plan.first_scheduled:
            self._queue_time.record(request.first_scheduled_time - request.arrival_time)
        if not plan.chunks:
            return
        started = time.perf_counter()
        anomalies = self.anomalies
        if anomalies is not None:
            anomalies.begin_step()
        out = self.runner.execute(plan, exact_routing=anomalies is not None and anomalies.exact_routing)
        if anomalies is not None and out.reached_model:  # judged before the step's tokens go out
            usage = self._kv_usage  # the pool as this step was scheduled (None: no pool)
            anomalies.end_step(usage.fragmentation if usage is not None else None)
        outcomes = self.outputs.process(plan, out)
        with self._cond:
            self.scheduler.update_from_output(plan, outcomes, out.step_epoch, out.degraded)
        if out.reached_model:
            self.step_tally.record(plan.kind, plan.num_tokens, time.perf_counter() - started)
