"""The I/O of ``expertmesh probe`` and ``expertmesh heatmap``: what a router says
about its model (``ListModels``) and its routing (``GetLoadStats``), and the
probe's own traffic (``Generate``; with routing traces for the bias audit, ``Router.trace``).

The router's load counts are cumulative over its sliding window, so a command
that sends traffic reads the counts before and after and uses the difference
(``LoadDelta``); other clients' requests in the meantime are counted too.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import grpc
import numpy as np

from expertmesh.contracts.errors import ExpertMeshError, GroupUnavailable, InvalidRequest
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.observability.sparsity import ModelShape
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc

#: Prompts of different kinds, cycled through by the probe's traffic.
PROMPTS = (
    "The history of the Roman Empire begins with",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Solve for x: 3x + 7 = 22. First, subtract 7 from both sides",
    "Dear hiring manager, I am writing to apply for the position of",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "Photosynthesis converts light energy into chemical energy by",
    "Once upon a time, in a village at the edge of a dark forest,",
    "Translate into French: The weather is lovely today and",
    "The patient presented with a persistent cough and a fever of",
    "In 1969 the Apollo 11 mission landed on the Moon, and",
    "To configure a Kubernetes deployment, first write a YAML manifest that",
    "The stock market fell sharply on Monday after the central bank",
)


class RouterError(GroupUnavailable):
    """The router could not be reached or refused a call."""


def _rpc_error(target: str, what: str, err: grpc.RpcError) -> RouterError:
    details = " ".join(str(err.details() or "").split())  # one line
    return RouterError(f"cannot {what} from {target}: {err.code().name}: {details}")


@dataclass(frozen=True)
class LoadStats:
    """One ``GetLoadStats`` answer, as arrays."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    max_context: int
    load: np.ndarray  # [L, E] tokens per expert over the window
    position_load: np.ndarray  # [L, P, E] of those, by position bin
    #: [L, R, E] tokens of finished sequences by relative position bin (position / the sequence's final length)
    relative_load: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    #: [Q, H] tokens of finished sequences by query-length bucket and experts served over all MoE layers
    experts_per_token: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    query_length_edges: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, text: str) -> "LoadStats":
        stats = json.loads(text)
        L, E = stats["num_layers"], stats["num_experts"]
        load = np.asarray(stats["load"], dtype=np.float64).reshape(L, E)
        position = np.asarray(stats.get("position_load") or np.zeros((L, 0, E)), dtype=np.float64)
        # routers from before the per-sequence statistics send none
        relative = np.asarray(stats.get("relative_load") or np.zeros((L, 0, E)), dtype=np.float64)
        per_token = np.asarray(stats.get("experts_per_token") or np.zeros((0, 0)), dtype=np.float64)
        return cls(
            tuple(stats["moe_layers"]),
            E,
            stats["top_k"],
            int(stats.get("max_context") or 0),
            load,
            position.reshape(L, -1, E),
            relative.reshape(L, -1, E),
            per_token.reshape(per_token.shape[0], -1) if per_token.ndim == 2 else np.zeros((0, 0)),
            tuple(stats.get("query_length_edges") or ()),
        )

    def __sub__(self, before: "LoadStats") -> "LoadStats":
        """The counts added since ``before``; raises when the window dropped old counts in between."""
        load = self.load - before.load
        position = self.position_load - before.position_load
        relative = _minus(self.relative_load, before.relative_load)
        per_token = _minus(self.experts_per_token, before.experts_per_token)
        if any((a < -1e-6).any() for a in (load, position, relative, per_token)):
            raise ExpertMeshError(
                "the router's load window aged out old counts during the probe, so the difference is not this "
                "probe's traffic; run it again (or use --requests 0 to report the whole window)"
            )
        return LoadStats(
            self.moe_layers,
            self.num_experts,
            self.top_k,
            self.max_context,
            load.clip(0),
            position.clip(0),
            relative.clip(0),
            per_token.clip(0),
            self.query_length_edges,
        )


def _minus(after: np.ndarray, before: np.ndarray) -> np.ndarray:
    """after - before, where an array without entries (none recorded before) subtracts nothing."""
    return after - before if before.size else after


@dataclass(frozen=True)
class Traffic:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float


class Router:
    """A router's Inference API, for the observability commands."""

    def __init__(self, target: str, timeout: float = 30.0):
        self.target = target
        self.timeout = timeout
        self._channel = secure_or_insecure_channel(target)
        self._stub = pb_grpc.InferenceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model(self) -> pb.ModelInfo:
        try:
            models = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout).models
        except grpc.RpcError as err:
            raise _rpc_error(self.target, "list models", err) from None
        if not models:
            raise RouterError(f"the router at {self.target} serves no model")
        return models[0]

    def load_stats(self) -> LoadStats:
        try:
            response = self._stub.GetLoadStats(pb.LoadStatsRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise _rpc_error(self.target, "read load stats", err) from None
        return LoadStats.from_json(response.stats_json)

    def send(
        self,
        requests: int,
        max_new_tokens: int,
        concurrency: int = 4,
        prompts: Sequence[str] = PROMPTS,
        vocab_size: int = 0,
        seed: int = 0,
    ) -> Traffic:
        """Send ``requests`` generations (prompts cycled, sampled with a per-request
        seed, no stop at EOS) and wait for all. A model without a tokenizer gets
        random token-id prompts instead of text."""
        as_ids = False

        def prompt(i: int):
            if as_ids:
                rng = np.random.default_rng(seed + i)
                return [int(t) for t in rng.integers(0, max(vocab_size, 1), size=8 + (i * 7) % 40)]
            return prompts[i % len(prompts)]

        def one(i: int) -> tuple[int, int]:
            request_prompt = prompt(i)
            try:
                last = None
                for response in self._stub.Generate(
                    _request(request_prompt, max_new_tokens, seed + i, f"probe-{seed}-{i}"), timeout=None
                ):
                    last = response
            except grpc.RpcError as err:
                raise _rpc_error(self.target, f"generate (probe request {i})", err) from None
            if last is None or last.WhichOneof("event") != "finished":
                raise RouterError(f"probe request {i} to {self.target} ended without a finish message")
            return last.finished.usage.prompt_tokens, last.finished.usage.completion_tokens

        start = time.monotonic()
        if requests <= 0:
            return Traffic(0, 0, 0, 0.0)
        try:
            first = [one(0)]
        except RouterError as err:
            if "tokenizer" not in str(err):
                raise
            as_ids = True  # this model takes token ids only
            first = [one(0)]
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            rest = list(pool.map(one, range(1, requests)))
        usage = first + rest
        return Traffic(requests, sum(p for p, _ in usage), sum(c for _, c in usage), time.monotonic() - start)

    def trace(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        policy: str = "exact",
        concurrency: int = 4,
        names: Sequence[str] = (),
    ) -> Iterator[list[list[tuple[int, list[int]]]]]:
        """Each prompt's routing under ``policy`` (forced past the router's quality guard): greedy, no stop at
        EOS, with its routing trace; per prompt, in order, per traced token, ``(decoder layer, experts that
        served it)`` per MoE layer (a slot no group served is left out). Yielded as they come, so a caller that
        counts them holds few at a time. ``names[i]`` names prompt i in errors."""
        from expertmesh.client import generate_request

        def one(i: int) -> list[list[tuple[int, list[int]]]]:
            request = generate_request(
                prompts[i],
                max_new_tokens=max_new_tokens,
                temperature=0.0,
                stop_at_eos=False,
                routing_trace=True,
                routing_policy=pb.RoutingPolicy(name=policy, force=policy != "exact"),
                request_id=f"probe-labels-{policy}-{i}",
            )
            tokens = []
            try:
                for response in self._stub.Generate(request, timeout=None):
                    event = response.WhichOneof("event")
                    routing = response.delta.routing if event == "delta" else ()
                    if event == "finished":
                        routing = response.finished.routing
                    for t in routing:
                        tokens.append([(r.layer, [e for e, g in zip(r.experts, r.groups) if g]) for r in t.layers])
            except grpc.RpcError as err:
                name = names[i] if i < len(names) else f"prompt {i + 1}"
                what = f"generate under routing policy {policy!r} ({name})"
                raise _rpc_error(self.target, what, err) from None
            return tokens

        pool = ThreadPoolExecutor(max(1, concurrency))
        try:
            yield from pool.map(one, range(len(prompts)))
        finally:  # on an error (or a caller that stops early) the prompts not yet sent are not sent
            pool.shutdown(wait=False, cancel_futures=True)


def _request(prompt, max_new_tokens: int, seed: int, request_id: str) -> pb.GenerateRequest:
    from expertmesh.client import generate_request

    return generate_request(
        prompt, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, stop_at_eos=False, request_id=request_id
    )


def model_shape(info: pb.ModelInfo) -> ModelShape:
    return ModelShape(
        name=info.name,
        moe_layers=tuple(info.moe_layers),
        num_experts=info.num_experts,
        top_k=info.top_k,
        total_parameters=info.total_parameters,
        dense_parameters=info.dense_parameters,
        parameters_per_expert=info.parameters_per_expert,
    )


def expert_groups(info: pb.ModelInfo, placement_file: Path | None) -> tuple[dict, str]:
    """(group name -> hosted (layer, expert) pairs, how they were obtained).

    ``ModelInfo`` does not say which group holds which expert: with a placement
    file we read it; otherwise we assume ``expertmesh.contracts.group_map.contiguous``
    over as many groups as the router reports (what ``--groups N`` starts)."""
    from expertmesh.contracts import group_map as placement
    from expertmesh.models.checkpoint import MoESpec

    spec = MoESpec(
        model_type=info.architecture,
        num_layers=info.num_layers,
        moe_layers=tuple(info.moe_layers),
        num_experts=info.num_experts,
        top_k=info.top_k,
        hidden_size=info.hidden_size,
        expert_params=(),
    )
    if placement_file is not None:
        groups = placement.load(placement_file, spec)
        placement.validate(groups, spec)
        return dict(groups.groups), f"from {placement_file}"
    names = list(info.groups) or ["g0"]
    groups = placement.contiguous(spec, len(names))
    note = ""
    if sorted(groups.groups) != sorted(names):
        note = f"; the router's groups are {', '.join(names)}, so it may use another placement"
    return (
        dict(groups.groups),
        f"assumed contiguous split over {len(names)} groups ({', '.join(groups.groups)}); "
        f"pass --placement FILE for the real one{note}",
    )


def check_not_empty(stats: LoadStats, target: str, source: str) -> None:
    if stats.load.sum() <= 0:
        raise InvalidRequest(f"no routed tokens in {source} of {target}: send traffic first or pass --requests N")


def domain_load(client) -> dict:
    """domain -> [L, E] expert choices of its tokens since the router behind ``client`` started."""
    try:
        stats = json.loads(client.load_stats())
    except grpc.RpcError as err:
        raise GroupUnavailable(f"cannot read load stats: {err.code().name}: {err.details()}") from None
    return {d: np.asarray(v, dtype=np.float64) for d, v in stats.get("domain_load", {}).items()}
