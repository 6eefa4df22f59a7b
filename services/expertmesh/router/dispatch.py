"""Remote experts: transformers' ExpertsInterface implementation ``"expertmesh"``.

Every MoE block of the router's model keeps its stock gate (and shared
experts); only the routed-experts call lands here. For one layer:

1. map each chosen (token, expert) slot to the group that holds the expert,
   from the cached routing table; a replicated expert's tokens are split across
   its replicas by share (``replica_split``);
2. send each group the hidden states of the tokens that need it (each token
   at most once per group), with only the expert ids and weights that group
   must apply (others are -1 / 0);
3. call every group of the layer concurrently and sum the returned weighted
   partials per token.

The routing table is re-read only at step boundaries (``refresh``, called from
a forward pre-hook on the whole model, or once per step by the serving engine),
so one forward pass never mixes two placements.

Under continuous batching a thread may be ``gathering`` into a StepGather: its
experts calls then meet those of the other sequences of the step and go out as
one dispatch per layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import grpc
import torch
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from expertmesh import wire
from expertmesh.errors import GroupUnavailable
from expertmesh.router.group_client import GroupClients
from expertmesh.router.load_window import LoadWindow
from expertmesh.router.replica_split import split_by_share
from expertmesh.router.step_gather import StepGather
from expertmesh.router.traffic import TrafficCounters
from expertmesh.routing_table import RoutingTable
from expertmesh.state import StateStore
from expertmesh.telemetry.setup import meter, tracer
from expertmesh.v1 import experts_pb2 as pb

log = logging.getLogger(__name__)

IMPLEMENTATION = "expertmesh"


class ExpertDispatcher:
    def __init__(
        self,
        store: StateStore,
        timeout_s: float = 30.0,
        load_window: LoadWindow | None = None,
        resolve_endpoints: Callable[[], dict[str, str]] | None = None,
    ):
        self._store = store
        #: fresh group -> address map when a group stops answering; default: what the store lists
        self._resolve_endpoints = resolve_endpoints or store.endpoints
        self.load_window = load_window
        self._timeout = timeout_s
        self._clients = GroupClients()
        self._lock = threading.Lock()
        self.table: RoutingTable | None = None
        #: layer -> [num_experts] int64 index into self._groups of the replica used, -1 if none
        self._owner: dict[int, torch.Tensor] = {}
        self._groups: list[str] = []
        #: layer -> [(expert, group indices of its replicas, their shares)] for replicated experts
        self._multi: dict[int, list[tuple[int, tuple[int, ...], tuple[float, ...]]]] = {}
        self._in_flight: Counter[int] = Counter()
        self._call_seconds = meter().create_histogram(
            "expertmesh.group.call.duration", unit="s", description="expert-group Dispatch round trip, by group"
        )
        self._local = threading.local()
        self.traffic = TrafficCounters()

    @contextmanager
    def gathering(self, gather: StepGather, positions: torch.Tensor | None = None) -> Iterator[None]:
        """Within this block, this thread's experts calls join ``gather``; it leaves at the end.

        ``positions`` [n]: the sequence positions of this forward's tokens, for the load statistics.
        """
        self._local.gather = gather
        self._local.positions = positions
        try:
            yield
        finally:
            self._local.gather = None
            self._local.positions = None
            gather.leave()

    def on_forward(self) -> None:
        """Forward pre-hook: a new step, unless the serving engine already refreshed for this one."""
        if getattr(self._local, "gather", None) is None:
            self.refresh()

    def refresh(self) -> None:
        """Switch to the newest routing table, if it changed. Cheap when it did not."""
        version = self._store.routing_table_version()
        if self.table is not None and version == self.table.version:
            return
        table = self._store.routing_table()
        if table is None:
            raise GroupUnavailable("no routing table in the state store; start the expert groups first")
        groups = table.groups()
        owner = {}
        multi: dict[int, list[tuple[int, tuple[int, ...], tuple[float, ...]]]] = {}
        for (layer, expert), replicas in table.replicas.items():
            row = owner.setdefault(layer, torch.full((table.num_experts,), -1, dtype=torch.long))
            row[expert] = groups.index(replicas[0])
            if len(replicas) > 1:
                indices = tuple(groups.index(g) for g in replicas)
                multi.setdefault(layer, []).append((expert, indices, table.shares_of((layer, expert))))
        with self._lock:
            self._clients.update({g: a for g, a in self._store.endpoints().items() if g in groups})
            self.table, self._groups, self._owner, self._multi = table, groups, owner, multi
        log.info("routing table version %d: %d groups", table.version, len(groups))

    def experts(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts call of one MoE layer: gathered with the step's other sequences, or sent now."""
        with tracer().start_as_current_span("expertmesh.moe_layer", attributes={"expertmesh.layer": layer}) as span:
            gather = getattr(self._local, "gather", None)
            if gather is not None:
                return gather.experts(
                    layer, hidden, top_k_index, top_k_weights, self._local.positions, span.get_span_context()
                )
            return self.dispatch(layer, hidden, top_k_index, top_k_weights)

    def dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        positions: torch.Tensor | None = None,
        links: Sequence[SpanContext] = (),
    ) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> weighted expert sum [T, H].

        positions [T] (optional): each token's position in its sequence, for the load statistics.
        links: trace contexts of the other sequences whose tokens ride in this dispatch.
        """
        started = time.perf_counter()
        if self.table is None:
            self.refresh()
        owner_row = self._owner.get(layer)
        if owner_row is None:
            raise GroupUnavailable(f"the routing table has no groups for MoE layer {layer}")
        num_experts = owner_row.shape[0]
        index = top_k_index.to("cpu", torch.long)
        if self.load_window is not None:
            self.load_window.record(layer, index, positions)
        # An index >= num_experts is transformers' expert-parallel sentinel: that slot is skipped.
        valid = index < num_experts
        owner = torch.where(valid, owner_row[index.clamp(max=num_experts - 1)], -1)  # [T, K]
        for expert, replicas, shares in self._multi.get(layer, ()):
            slots = (index == expert).nonzero()  # [n, 2] (token, k) of this expert's tokens
            if len(slots):
                counts = split_by_share(len(slots), shares, [self._in_flight[g] for g in replicas])
                owner[slots[:, 0], slots[:, 1]] = torch.repeat_interleave(torch.tensor(replicas), torch.tensor(counts))
        weights_cpu = top_k_weights.detach().to("cpu")
        hidden_cpu = hidden.detach().to("cpu")

        links = [Link(c) for c in links if c.is_valid]
        calls = []
        sent = received = pairs = 0
        group_tokens: dict[str, int] = {}
        for g in torch.unique(owner[owner >= 0]).tolist():
            group = self._groups[g]
            mine = owner == g  # [T, K]
            tokens = mine.any(dim=1).nonzero().squeeze(1)  # [Tg]
            request = pb.DispatchRequest(
                layer=layer,
                hidden_states=wire.encode(hidden_cpu[tokens]),  # [Tg, H]
                expert_ids=wire.encode(torch.where(mine, index, -1)[tokens].to(torch.int32)),  # [Tg, K]
                routing_weights=wire.encode(torch.where(mine, weights_cpu, 0)[tokens]),  # [Tg, K]
                routing_table_version=self.table.version,
            )
            stub = self._clients.stub(group)
            if stub is None:
                raise GroupUnavailable(f"expert group {group} has no registered endpoint")
            span = tracer().start_span(
                "expertmesh.group_call",
                links=links,
                attributes={
                    "expertmesh.layer": layer,
                    "expertmesh.group": group,
                    "expertmesh.tokens": tokens.numel(),
                    "expertmesh.bytes_sent": request.ByteSize(),
                },
            )
            if span.is_recording():
                span.set_attribute("expertmesh.experts_hit", torch.unique(index[mine]).tolist())
            with trace.use_span(span, end_on_exit=False):  # the gRPC client span nests under it
                future = stub.Dispatch.future(request, timeout=self._timeout)
            calls.append((g, tokens, request, future, span, time.perf_counter()))
            self._in_flight[g] += 1
            sent += request.ByteSize()
            pairs += tokens.numel()
            group_tokens[group] = tokens.numel()

        out = torch.zeros_like(hidden_cpu)  # [T, H]
        for g, tokens, request, future, span, sent_at in calls:
            group = self._groups[g]
            try:
                try:
                    response = future.result()
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    span.add_event("group unavailable; re-resolving its address", {"error": err.details() or ""})
                    response = self._retry_unavailable(group, request, sent_at)
                span.set_attribute("expertmesh.bytes_received", response.ByteSize())
            except grpc.RpcError as err:
                span.set_status(Status(StatusCode.ERROR, err.code().name))
                raise GroupUnavailable(
                    f"expert group {group} at {self._clients.address(group)} failed layer {layer}: "
                    f"{err.code().name}: {err.details()}"
                ) from None
            finally:
                self._in_flight[g] -= 1
                span.end()
            self._call_seconds.record(time.perf_counter() - sent_at, {"group": group})
            received += response.ByteSize()
            out.index_add_(0, tokens, wire.decode(response.partial_sums, f"partial sums from {group}").to(out.dtype))
        self.traffic.record(
            layer,
            calls=1,
            tokens=index.shape[0],
            group_calls=len(calls),
            token_group_pairs=pairs,
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.perf_counter() - started,
        )
        self.traffic.record_groups(layer, group_tokens)
        return out.to(hidden.device)

    def _retry_unavailable(self, group: str, request: pb.DispatchRequest, sent_at: float) -> pb.DispatchResponse:
        """A group that went away (a replica restarting, say): look its address up again and resend
        until the call's deadline. Dispatch computes a pure function of the request, so resending is safe."""
        delay = 0.1
        while True:
            with self._lock:
                self._clients.update(self._resolve_endpoints())
            stub = self._clients.stub(group)
            left = self._timeout - (time.perf_counter() - sent_at)
            try:
                if stub is None:
                    raise GroupUnavailable(f"expert group {group} has no registered endpoint")
                return stub.Dispatch(request, timeout=max(left, 0.001))
            except (grpc.RpcError, GroupUnavailable) as err:
                retryable = isinstance(err, GroupUnavailable) or err.code() == grpc.StatusCode.UNAVAILABLE
                if not retryable or left <= delay:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def queue_depths(self) -> dict[str, int]:
        """Dispatch calls in flight from this router, by group."""
        return {group: self._in_flight[g] for g, group in enumerate(self._groups)}

    def close(self) -> None:
        self._clients.close()


def _remote_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    return module._expertmesh_dispatcher.experts(module._expertmesh_layer, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _remote_experts_forward)
