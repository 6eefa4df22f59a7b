"""The platform's side of ``bench serve``: ``expertmesh up`` started here or a running one, and N streaming clients."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable

from expertmesh.bench.platform import started
from expertmesh.bench.report import BenchError
from expertmesh.bench.serve.clients import stream_clients_async
from expertmesh.bench.serve.stats import TimedRequest, decode_steps, summary
from expertmesh.bench.serve.workload import prompts
from expertmesh.infra.console import bar, progress

if TYPE_CHECKING:
    from expertmesh.bench.serve.options import Options

__all__ = ["RUNNERS", "calibrate", "check_target", "platform_run", "served_here", "settled_step_totals"]

#: ``--groups-as`` in the report's words
RUNNERS = {"ray": "groups on Ray Serve", "process": "groups as plain processes", "in-process": "groups in its process"}

#: prompts of the run's shape that ``--redundant``'s calibration sends, and tokens each generates
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 8, 8


@contextmanager
def served_here(options: Options, checkpoint, device, ready: Callable | None = None, **serving) -> Iterator:
    """``expertmesh up`` in this process over a fresh data plane for ``options``: its gRPC server (``serving``:
    ServingConfig fields beside the benchmark's limits), drained and stopped at the end. ``ready(plane,
    target)`` runs once it serves, before the server is handed over."""
    from expertmesh.config.settings import DataPlaneConfig, ServingConfig
    from expertmesh.platform.router_apis import serve_plane

    config = DataPlaneConfig(
        model=checkpoint.path,
        groups=options.groups,
        dtype=options.dtype,
        ray_address=options.ray_address,
        router_device=str(device),
    )
    with started(config, options.groups_as, "serve") as plane:
        if options.classifier:
            from expertmesh.bench.serve.classifier_runs import neutral_profiles

            neutral_profiles(plane)
        server = serve_plane(
            plane,
            ServingConfig(
                port=0,
                max_active_sequences=max(32, options.clients),
                max_queued_requests=max(128, options.clients),
                max_new_tokens_cap=max(1024, options.max_new_tokens),
                **({"max_step_tokens": options.max_step_tokens} if options.max_step_tokens else {}),
                **serving,
            ),
        )
        try:
            if ready is not None:
                ready(plane, f"127.0.0.1:{server.port}")
            yield server
        finally:
            server.drain_and_stop()


def check_target(target: str, checkpoint, vocab_size: int) -> None:
    """The running ``expertmesh up`` at ``target`` answers and serves ``checkpoint`` (its shape), else
    ``BenchError`` saying what it serves."""
    import grpc

    from expertmesh.client import Client

    try:
        with Client(target, timeout=10) as client:
            models = client.models()
    except grpc.RpcError as err:
        raise BenchError(f"cannot reach `expertmesh up` at {target}: {err.code().name}: {err.details()}") from None
    spec = checkpoint.spec
    mine = (spec.num_layers, spec.hidden_size, spec.num_experts, vocab_size)
    if not any((m.num_layers, m.hidden_size, m.num_experts, m.vocab_size) == mine for m in models):
        served = ", ".join(f"{m.name} ({m.architecture}, hidden {m.hidden_size})" for m in models) or "nothing"
        raise BenchError(
            f"{target} serves {served}, not the checkpoint {checkpoint.path}; pass --model with the served checkpoint"
        )


def platform_run(
    target: str,
    options: Options,
    work: list,
    name: str | None = None,
    extras: list[dict] | None = None,
    fresh: Callable[[], object] | None = None,
    steps: Callable[[], dict] | None = None,
) -> dict:
    """N streaming clients send ``work`` (token ids or text), request i with ``extras[i]`` (routing policy,
    domain) when given. ``fresh()``, when given, runs after the warm-up: the platform's prefix cache emptied,
    so no timed prompt finds itself cached by the warm-up or an earlier run. ``steps()``, when given, is the
    in-process engine's step totals (``settled_step_totals``): the run's decode steps are reported from them."""
    n, m = options.clients, options.max_new_tokens
    name = name or f"platform: {n} streaming clients"
    extras = extras or [{}] * len(work)
    progress(f"bench serve: {name}, {options.requests_per_client} requests of {m} tokens each at {target}")
    _warm_up(target, work[0], extras[0])
    if fresh is not None:
        fresh()
    before = steps() if steps is not None else None
    figures = summary(name, n, _stream_all(target, options, work, extras))
    if before is not None:
        figures.update(_engine_steps(before, steps()))
    return figures


def _warm_up(target: str, prompt, extras: dict) -> None:
    """One untimed request of two tokens; a platform that refuses it is a one-line ``BenchError``."""
    import grpc

    from expertmesh.client import Client

    try:
        with Client(target, timeout=600) as client:
            list(client.generate(prompt, max_new_tokens=2, stop_at_eos=False, **extras))
    except grpc.RpcError as err:
        raise BenchError(f"a request to {target} failed: {err.code().name}: {err.details()}") from None


def _stream_all(target: str, options: Options, work: list, extras: list[dict]) -> list[TimedRequest]:
    """The timed requests, from a process of their own (spawned). The platform this command serves runs in this
    process, and N client threads beside its engine would share its interpreter, as no real load generator does
    (vLLM's server is another process than its clients too). On this project's 2-vCPU host the figures moved within
    run-to-run noise (the 214M Mixtral, 8 and 32 clients: 62.8 / 108.7 tok/s with the clients here, 59.0 / 114.4
    apart); the point is that neither side's server shares its interpreter with the load."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        return clients.submit(_stream_here, target, options, work, extras).result()


def _stream_here(target: str, options: Options, work: list, extras: list[dict]) -> list[TimedRequest]:
    """The timed requests from this process: ``clients.stream_clients_async`` with a ``grpc.aio`` client each, all on
    one loop (see ``clients``: N client threads would take twice the CPU a token from the cores the server runs on)."""
    import asyncio

    import grpc

    from expertmesh.client import AsyncClient

    async def stream(client: AsyncClient, i: int, timed: TimedRequest) -> None:
        try:
            async for chunk in client.generate(
                work[i], max_new_tokens=options.max_new_tokens, stop_at_eos=False, **extras[i]
            ):
                if chunk.token_ids:
                    timed.arrivals.append((time.perf_counter(), len(chunk.token_ids)))
                    timed.ids.extend(chunk.token_ids)
        except grpc.RpcError as err:  # grpc.aio's AioRpcError is one
            raise BenchError(f"a streaming request to {target} failed: {err.code().name}: {err.details()}") from None

    with bar(options.clients * options.requests_per_client, "bench serve: requests", unit="request") as done:
        return asyncio.run(
            stream_clients_async(
                options.clients,
                options.requests_per_client,
                stream,
                connect=lambda: AsyncClient(target, timeout=600),
                finished=done.update,
            )
        )


def _engine_steps(before: dict, after: dict) -> dict:
    """The run's share of the in-process engine's step totals (``StepTally.totals`` before and after): its
    decode steps, and its steps of every kind."""
    from expertmesh.serving.step_tally import StepKind

    run = {kind: after[kind].since(before[kind]) for kind in StepKind}
    decode = run[StepKind.DECODE]
    return {
        "decode_steps": decode_steps(decode.steps, decode.tokens, decode.seconds),
        "engine_steps": {
            kind.value: {"steps": t.steps, "tokens": t.tokens, "seconds": t.seconds} for kind, t in run.items()
        },
    }


#: how long a run's figures wait for the engine's step totals to hold every step it has counted
STEP_TOTALS_WAIT_S = 10.0


def settled_step_totals(engine) -> dict:
    """The in-process engine's step totals (``StepTally.totals``) once they hold every step it has counted.
    It counts a step (``Engine.steps``) before the step's tokens go out and adds the step to its totals after
    the forward, so a client that saw its run's last token can read the totals a step short; the engine is
    idle between runs, so they catch up at once (at most ``STEP_TOTALS_WAIT_S``, then as they are)."""
    deadline = time.monotonic() + STEP_TOTALS_WAIT_S
    while True:
        counted = engine.steps  # first: every step counted by now must be in the totals read next
        totals = engine.step_tally.totals()
        if sum(t.steps for t in totals.values()) >= counted or time.monotonic() >= deadline:
            return totals
        time.sleep(0.005)


def calibrate(target: str, options: Options, vocab_size: int) -> None:
    """``CALIBRATION_PROMPTS`` prompts of the run's shape from another seed through the platform, one after
    another: its router's load window counts their experts."""
    import dataclasses

    from expertmesh.client import Client

    shape = dataclasses.replace(options, seed=options.seed + 1, clients=CALIBRATION_PROMPTS, requests_per_client=1)
    progress(f"bench serve: {CALIBRATION_PROMPTS} calibration prompts for the planned placement")
    with Client(target, timeout=600) as client:
        for prompt in prompts(shape, vocab_size):
            list(
                client.generate(
                    prompt, max_new_tokens=min(CALIBRATION_TOKENS, options.max_new_tokens), stop_at_eos=False
                )
            )
