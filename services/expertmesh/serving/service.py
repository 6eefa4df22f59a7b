"""The ``expertmesh.v1.Inference`` gRPC service, with ``grpc.health.v1`` and
server reflection so standard tools (grpcurl, grpc_health_probe, Kubernetes
gRPC probes) work without the .proto files.

Requests are built and bounded by the request builder both APIs share
(``serving.request_builder``) before they reach the engine; a bad one gets
INVALID_ARGUMENT with a message naming the field, a full server
RESOURCE_EXHAUSTED, and everyone else keeps streaming. Generate and Score take
raw request bytes and parse them here, so a prompt that is not valid UTF-8 is
an INVALID_ARGUMENT too rather than gRPC's generic deserialisation failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from expertmesh.config.settings import ServingConfig
from expertmesh.contracts import wire
from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.infra.grpc_server import GrpcServer
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.serving.canary import CANARY_KEY, CanaryStatus
from expertmesh.serving.consistency_guard import GuardError, GuardSpec
from expertmesh.serving.engine import Engine
from expertmesh.serving.events import FINAL_EVENTS, ErrorEvent, Event, FinishEvent, ScoreEvent, TokenEvent
from expertmesh.serving.grammar import GrammarSpec
from expertmesh.serving.request import GenerationRequest, ScoreSpec
from expertmesh.serving.request_builder import ModelBounds, RequestBuilder, RequestSpec, ScoreRequestSpec
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.serving.routing_trace import TokenRouting
from expertmesh.serving.sampling import SamplingParams
from expertmesh.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)


SERVICE_NAME = "expertmesh.v1.Inference"
#: the router's own admin calls (an admin identity, ``security.admin_auth``)
ADMIN_SERVICE_NAME = "expertmesh.v1.RouterAdmin"
_FINISH = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "context": pb.FINISH_REASON_CONTEXT,
}


class InferenceServicer:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        info: pb.ModelInfo,
        config: ServingConfig,
        table_version,
        load_window,
        group_transports: Callable[[], dict[str, str]] = dict,
        routing: RequestRouter | None = None,
    ):
        """``routing``: resolves each request's routing policy and domain (None: one without a state
        store, so policies that need a domain's profile are refused)."""
        self._load_window = load_window
        m = meter()
        self._duration = m.create_histogram(
            "expertmesh.request.duration", unit="s", description="Generate, first byte in to last out"
        )
        self._ttft = m.create_histogram(
            "expertmesh.time_to_first_token", unit="s", description="Generate request to first token"
        )
        self._itl = m.create_histogram(
            "expertmesh.inter_token_latency", unit="s", description="between streamed tokens"
        )
        self._errors = m.create_counter(
            "expertmesh.errors", description="requests answered with an error, by gRPC status"
        )
        self._engine = engine
        self._tokenizer = tokenizer
        self._info = info
        self._config = config
        self._table_version = table_version
        #: group -> what carries the router's calls to it (ListModels reports it)
        self._group_transports = group_transports
        self.routing = routing or RequestRouter(
            info.top_k,
            info.num_experts,
            tuple(info.moe_layers),
            config.routing_policy,
            None,
            config.policy_kl_bound,
            guard_default=guard_default(config, info.top_k),
            domain_policies=config.domain_routing_policies,
        )
        #: every bound of a request, shared with the HTTP API
        self.builder = RequestBuilder(
            ModelBounds(info.vocab_size, info.max_context, len(info.moe_layers)),
            config,
            engine.grammars,
            self.routing,
            tokenizer.decode if tokenizer is not None else None,
        )

    # -- requests --------------------------------------------------------------------

    @staticmethod
    def _parse(message_type, raw: bytes):
        try:
            return message_type.FromString(raw)
        except DecodeError as err:
            hint = " (the prompt text must be valid UTF-8)" if "UTF-8" in str(err) else ""
            raise InvalidRequest(f"cannot parse {message_type.DESCRIPTOR.name}: {err}{hint}") from None

    def _prompt(self, request: pb.GenerateRequest | pb.ScoreRequest) -> tuple[tuple[int, ...], str | None]:
        """The prompt's token ids, and its text when it came as text (the builder checks both)."""
        if request.WhichOneof("prompt") == "text" and request.text:
            if self._tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send the prompt as token_ids", field="prompt")
            return tuple(self._tokenizer(request.text)["input_ids"]), request.text
        return tuple(request.token_ids.ids), None

    def _generation_requests(self, request: pb.GenerateRequest, context) -> list[GenerationRequest]:
        """One GenerationRequest per choice (``n``), built and bounded by the request builder."""
        ids, text = self._prompt(request)
        s = request.sampling
        remaining = context.time_remaining()
        spec = RequestSpec(
            prompt_ids=ids,
            prompt_text=text,
            request_id=request.request_id,
            n=request.n if request.HasField("n") else 1,
            max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p if s.HasField("top_p") else 1.0,
                top_k=s.top_k,
                seed=s.seed if s.HasField("seed") else None,
                logit_bias=tuple(sorted(s.logit_bias.items())),
                min_tokens=s.min_tokens,
                repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
                frequency_penalty=s.frequency_penalty,
                presence_penalty=s.presence_penalty,
            ),
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            stop_at_eos=request.stop_at_eos if request.HasField("stop_at_eos") else True,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            grammar=self._grammar(request.structured_output) if request.HasField("structured_output") else None,
            routing_policy=request.routing_policy if request.HasField("routing_policy") else None,
            domain=request.domain if request.HasField("domain") else None,
            consistency_guard=request.consistency_guard if request.HasField("consistency_guard") else None,
            routing_trace=request.routing_trace,
            cache_salt=request.cache_salt,
            deadline=None if remaining is None else time.monotonic() + remaining,
            client=client_key(context),
            canary_key=dict(context.invocation_metadata() or ()).get(CANARY_KEY, ""),
        )
        return self.builder.build(spec)

    @staticmethod
    def _grammar(output: pb.StructuredOutput) -> GrammarSpec | None:
        """The request's grammar (the builder compiles it); GrammarError is INVALID_ARGUMENT naming it."""
        kind = output.WhichOneof("kind")
        field = f"structured_output.{kind}"
        if kind == "json_object":
            spec = GrammarSpec.json_object(field) if output.json_object else None
        elif kind == "json_schema":
            spec = GrammarSpec.json_schema(output.json_schema, field)
        elif kind == "regex":
            spec = GrammarSpec.regex(output.regex, field)
        else:
            spec = None
        return spec

    # -- handlers --------------------------------------------------------------------

    def Generate(self, raw: bytes, context):
        started = time.monotonic()
        # Not made current across yields (each resumes the generator anew); made current where children start.
        span = tracer().start_span("expertmesh.request")
        seqs: list = []
        try:
            with trace.use_span(span):
                try:
                    requests = self._generation_requests(self._parse(pb.GenerateRequest, raw), context)
                    seqs.append(self._engine.submit(requests[0]))  # captures this span as the parent of its steps
                except ExpertMeshError as err:
                    self._fail(span, context, err.code, str(err))
            request = requests[0]
            span.set_attributes(
                {
                    "expertmesh.request_id": request.request_id,
                    "expertmesh.prompt_tokens": len(request.prompt_ids),
                    "expertmesh.max_new_tokens": request.max_new_tokens,
                    "expertmesh.choices": len(requests),
                    "expertmesh.routing_policy": request.routing.policy.name if request.routing else "exact",
                    "expertmesh.domain": (request.routing.domain if request.routing else None) or "",
                }
            )
            context.add_callback(lambda: [seq.cancel() for seq in seqs])
            # the caller's id (or the one chosen for it): the choices' ids add -i
            rid = request.request_id.removesuffix("-0") if len(requests) > 1 else request.request_id
            last: dict[int, float] = {}
            for index, event in self._choice_events(seqs, requests[1:], span, context):
                now = time.monotonic()
                if isinstance(event, TokenEvent):
                    if index not in last:
                        self._ttft.record(now - started)
                    else:
                        self._itl.record(now - last[index])
                    last[index] = now
                    yield pb.GenerateResponse(request_id=rid, index=index, delta=_delta(event))
                elif isinstance(event, FinishEvent):
                    self._duration.record(now - started)
                    span.set_attributes(
                        {
                            "expertmesh.completion_tokens": event.completion_tokens,
                            "expertmesh.finish_reason": event.reason,
                        }
                    )
                    with trace.use_span(span):
                        log.info(
                            "request %s finished (%s): %d prompt + %d completion tokens in %.3fs",
                            requests[index].request_id,
                            event.reason,
                            event.prompt_tokens,
                            event.completion_tokens,
                            now - started,
                            extra={
                                "request_id": requests[index].request_id,
                                "finish_reason": event.reason,
                                "prompt_tokens": event.prompt_tokens,
                                "completion_tokens": event.completion_tokens,
                                "duration_s": round(now - started, 6),
                            },
                        )
                    yield pb.GenerateResponse(
                        request_id=rid,
                        index=index,
                        finished=pb.Finished(
                            reason=_FINISH[event.reason],
                            usage=pb.Usage(
                                prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                            ),
                            routing=[routing_message(r) for r in event.final_routing],
                        ),
                    )
                elif isinstance(event, ErrorEvent):
                    self._fail(span, context, grpc.StatusCode[event.failure.value], event.message)
        finally:
            for seq in seqs:
                seq.cancel()  # a no-op for the ones that ended; frees the others (an error in one fails all)
            span.end()

    def _choice_events(self, seqs: list, later: list[GenerationRequest], span, context) -> Iterator[tuple[int, Event]]:
        """(choice, event) of a request's choices until each one's final event. ``seqs`` holds the first
        choice's sequence; the ``later`` choices are submitted (and appended to ``seqs``) after its first
        event, whatever it is (a token, or its end: a first token that stops it): its prompt then went through
        its step, whose end offers the prompt's KV blocks to the prefix cache before the next step admits
        anyone, so they share them. An error ends them all (``Generate`` fails the RPC)."""
        first = iter(seqs[0])
        event = next(first)
        yield 0, event
        if isinstance(event, ErrorEvent) or not later:
            for event in first:
                yield 0, event
            return
        with trace.use_span(span):
            try:
                seqs.extend(self._engine.submit(request) for request in later)
            except ExpertMeshError as err:
                self._fail(span, context, err.code, str(err))
        merged: queue.Queue[tuple[int, Event]] = queue.Queue()

        def forward(index: int, events: Iterator[Event]) -> None:
            for event in events:
                merged.put((index, event))

        open_choices = len(seqs) - isinstance(event, FINAL_EVENTS)
        streams = [iter(seq) for seq in seqs[1:]]
        if not isinstance(event, FINAL_EVENTS):
            streams.insert(0, first)
        for index, events in zip(range(len(seqs) - len(streams), len(seqs)), streams):
            threading.Thread(target=forward, args=(index, events), name="expertmesh-choice", daemon=True).start()
        while open_choices:
            index, event = merged.get()
            open_choices -= isinstance(event, FINAL_EVENTS)
            yield index, event

    def _fail(self, span, context, code: grpc.StatusCode, message: str):
        """Count the error, mark the span, and abort the RPC with ``code``."""
        self._errors.add(1, {"code": code.name})
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        context.abort(code, message)

    def Score(self, raw: bytes, context) -> pb.ScoreResponse:
        try:
            request = self._parse(pb.ScoreRequest, raw)
            ids, text = self._prompt(request)
            remaining = context.time_remaining()
            seq = self._engine.submit(
                self.builder.build_score(
                    ScoreRequestSpec(
                        prompt_ids=ids,
                        prompt_text=text,
                        score=ScoreSpec(raw_logits=request.raw_logits, full_distribution=request.full_distribution),
                        routing_policy=request.routing_policy if request.HasField("routing_policy") else None,
                        domain=request.domain if request.HasField("domain") else None,
                        cache_salt=request.cache_salt,
                        deadline=None if remaining is None else time.monotonic() + remaining,
                        client=client_key(context),
                    )
                )
            )
        except ExpertMeshError as err:
            self._errors.add(1, {"code": err.code.name})
            context.abort(err.code, str(err))
        context.add_callback(seq.cancel)
        event = list(seq)[-1]
        if isinstance(event, ErrorEvent):
            self._errors.add(1, {"code": event.failure.value})
            context.abort(grpc.StatusCode[event.failure.value], event.message)
        assert isinstance(event, ScoreEvent)
        response = pb.ScoreResponse(token_ids=ids, token_scores=event.token_scores)
        if event.distribution is not None:
            response.distribution.CopyFrom(wire.encode(event.distribution))
        return response

    def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        info = pb.ModelInfo()
        info.CopyFrom(self._info)
        info.routing_table_version = self._table_version()
        info.group_transports.update(self._group_transports())
        kv = self._engine.kv_usage()
        if kv is not None:
            info.kv_pool.CopyFrom(
                pb.KVPool(
                    blocks_total=kv.blocks_total,
                    blocks_used=kv.blocks_used,
                    block_size=kv.block_size,
                    fragmentation=kv.fragmentation,
                    blocks_used_peak=kv.blocks_used_peak,
                    preemptions=kv.preemptions,
                )
            )
        return pb.ListModelsResponse(
            models=[info],
            routing_policies=self.routing.catalogue(),
            default_routing_policy=self.routing.default.name,
            default_routing_policy_spec=self.routing.default.spec,
            domain_routing_policies={d: p.spec for d, p in self.routing.domain_defaults.items()},
        )

    def GetLoadStats(self, request: pb.LoadStatsRequest, context) -> pb.LoadStatsResponse:
        """One page of MoE layers (rows) of the load window: every answer stays under a few MiB."""
        try:
            page, next_row = self._load_window.snapshot().stats_page(request.first_row, request.max_rows)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_row: {err}")
        return pb.LoadStatsResponse(stats_json=page, next_row=next_row)

    def Canary(self, request: pb.CanaryRequest, context) -> pb.CanaryStatus:
        """The RouterAdmin API: start, promote or stop the canary of the default policy, or its status."""
        try:
            if request.action == pb.CANARY_START:
                status = self.routing.start_canary(
                    request.candidate,
                    request.share,
                    request.min_agreement if request.HasField("min_agreement") else None,
                    request.min_samples if request.HasField("min_samples") else None,
                    request.sample_every if request.HasField("sample_every") else None,
                )
            elif request.action in (pb.CANARY_PROMOTE, pb.CANARY_STOP):
                status = self.routing.end_canary(promote=request.action == pb.CANARY_PROMOTE)
            else:
                status = self.routing.canary.status()
        except ExpertMeshError as err:
            context.abort(err.code, str(err))
        return canary_message(status)


def canary_message(status: CanaryStatus) -> pb.CanaryStatus:
    if status.state is None:
        return pb.CanaryStatus()
    spec = status.spec
    policies = {"baseline": status.baseline.spec, "candidate": spec.candidate.spec}
    return pb.CanaryStatus(
        state=status.state.value,
        reason=status.reason,
        candidate=spec.candidate.spec,
        baseline=status.baseline.spec,
        share=spec.share,
        min_agreement=spec.min_agreement,
        min_samples=spec.min_samples,
        sample_every=spec.sample_every,
        arms=[
            pb.CanaryArm(
                arm=arm,
                policy=policies[arm],
                requests=t.requests,
                finished=t.finished,
                mean_latency_s=t.mean_seconds or 0.0,
                sampled_tokens=t.samples,
                agreeing_tokens=t.agreeing,
            )
            for arm, t in status.tallies.items()  # baseline, then candidate
        ],
    )


class InferenceServer:
    """The gRPC server of a router: Inference + health + reflection."""

    def __init__(self, servicer: InferenceServicer, engine: Engine, config: ServingConfig):
        self.engine = engine
        self._config = config
        #: the servicer's resolver of routing policies, shared with the HTTP API
        self.routing = servicer.routing
        limits = engine.limits
        # Streams hold a thread each; past this many concurrent RPCs gRPC answers RESOURCE_EXHAUSTED itself.
        concurrent = limits.max_active + limits.max_queued + 8
        self._grpc = GrpcServer("rpc", config.host, config.port, workers=concurrent, maximum_concurrent_rpcs=concurrent)
        self._server = self._grpc.server
        self._server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    SERVICE_NAME,
                    {
                        "Generate": grpc.unary_stream_rpc_method_handler(
                            servicer.Generate, response_serializer=pb.GenerateResponse.SerializeToString
                        ),
                        "Score": grpc.unary_unary_rpc_method_handler(
                            servicer.Score, response_serializer=pb.ScoreResponse.SerializeToString
                        ),
                        "ListModels": grpc.unary_unary_rpc_method_handler(
                            servicer.ListModels,
                            request_deserializer=pb.ListModelsRequest.FromString,
                            response_serializer=pb.ListModelsResponse.SerializeToString,
                        ),
                        "GetLoadStats": grpc.unary_unary_rpc_method_handler(
                            servicer.GetLoadStats,
                            request_deserializer=pb.LoadStatsRequest.FromString,
                            response_serializer=pb.LoadStatsResponse.SerializeToString,
                        ),
                    },
                ),
                grpc.method_handlers_generic_handler(
                    ADMIN_SERVICE_NAME,
                    {
                        "Canary": grpc.unary_unary_rpc_method_handler(
                            servicer.Canary,
                            request_deserializer=pb.CanaryRequest.FromString,
                            response_serializer=pb.CanaryStatus.SerializeToString,
                        ),
                    },
                ),
            ]
        )
        reflection.enable_server_reflection(
            (SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = self._grpc.port
        self._serving_lock = threading.Lock()
        self._draining = False
        #: why grpc.health.v1 says NOT_SERVING besides warming up and draining (``set_unfit``): e.g. the router's
        #: weights changed since load
        self._unfit: str | None = None
        if config.health_port is not None:
            self._grpc.serve_plaintext_health(config.health_port)

    def start(self) -> "InferenceServer":
        """Serve; grpc.health.v1 says NOT_SERVING until the engine's warm-up is over (requests sent meanwhile
        wait for it in the queue), while ``set_unfit`` says so, and once draining."""
        self.engine.start()
        self._grpc.start((SERVICE_NAME,), serving=self._serving())
        if not self.engine.warmed.is_set():
            threading.Thread(target=self._serving_once_warm, name="expertmesh-warm-up-wait", daemon=True).start()
        return self

    def _serving(self) -> bool:
        return self.engine.warmed.is_set() and self._unfit is None and not self._draining

    def _update_serving(self) -> None:
        with self._serving_lock:
            self._grpc.set_serving(self._serving(), (SERVICE_NAME,))

    def _serving_once_warm(self) -> None:
        self.engine.warmed.wait()
        self._update_serving()

    def set_unfit(self, why: str | None) -> None:
        """grpc.health.v1 NOT_SERVING for ``why`` (None: no longer), as /health's reasons say it: the gRPC probes
        of a router without the HTTP API see what its readiness sees."""
        self._unfit = why
        self._update_serving()

    def drain_and_stop(self) -> bool:
        """Stop taking requests, let in-flight ones finish (up to the drain timeout), then stop."""
        self._draining = True
        self._update_serving()
        drained = self.engine.drain(self._config.drain_timeout_s)
        self._grpc.stop()
        self.engine.stop()
        return drained


def client_key(context) -> str:
    """Who a gRPC call is from, for the fair share of sequence slots: the TLS client certificate's name when the
    call came over mutual TLS, else the peer's address without its port ("" if gRPC knows neither). Behind one
    gateway every client shares one address: it is the gateway that keeps tenants apart there."""
    names = (context.auth_context() or {}).get("x509_common_name") or ()
    if names:
        return "tls:" + names[0].decode(errors="replace")[:128]
    peer = context.peer() or ""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return kind


def guard_default(config: ServingConfig, top_k: int) -> GuardSpec | None:
    """The server's consistency guard for non-exact requests that ask for none (``config.consistency_*``)."""
    if not config.consistency_guard:
        return None
    try:
        return GuardSpec.parse(
            config.consistency_guard,
            config.consistency_threshold,
            config.consistency_max_regenerations,
            top_k,
            "consistency_guard (--consistency-guard, EXPERTMESH_CONSISTENCY_GUARD)",
        )
    except GuardError as err:
        raise ExpertMeshError(f"the server's default {err}") from None


def _delta(event: TokenEvent) -> pb.TokenDelta:
    return pb.TokenDelta(
        token_ids=event.token_ids,
        text=event.text,
        logprobs=[
            pb.TokenLogprob(
                token_id=t.token_id,
                logprob=t.logprob,
                top=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top],
            )
            for t in event.logprobs
        ],
        routing=[routing_message(r) for r in event.routing],
    )


def routing_message(token: TokenRouting) -> pb.TokenRouting:
    return pb.TokenRouting(
        token_id=token.token_id,
        index=token.index,
        layers=[
            pb.LayerRouting(layer=r.layer, experts=r.experts, weights=r.weights, groups=r.groups) for r in token.layers
        ],
    )
