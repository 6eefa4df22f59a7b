"""The runs of ``bench serve``: the platform against its baselines, over repeats and thread counts; the sweep."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from expertmesh.bench.cost import per_million_tokens
from expertmesh.bench.platform import device_summary
from expertmesh.bench.report import machine, model_summary, options_summary, torch_threads
from expertmesh.bench.serve.baselines import BASELINES
from expertmesh.bench.serve.baselines.base import BaselineRun, BaselineSetup, Load
from expertmesh.bench.serve.classifier_runs import classifier_runs, classifier_summary
from expertmesh.bench.serve.options import Options, shaped, validate
from expertmesh.bench.serve.served import (
    RUNNERS,
    calibrate,
    check_target,
    platform_run,
    served_here,
    settled_step_totals,
)
from expertmesh.bench.serve.stats import (
    best_of_threads,
    decode_steps,
    kv_summary,
    median_run,
    same_tokens,
    summary,
    sweep_point,
)
from expertmesh.bench.serve.workload import prompts, text_prompts
from expertmesh.infra.console import progress

__all__ = ["run", "run_sweep"]


@dataclass(frozen=True)
class _Inputs:
    """What one run measures with, fixed before anything is timed."""

    options: Options
    checkpoint: object  # models.checkpoint.Checkpoint
    vocab_size: int
    work: list[list[int]]  # the token-id prompts, request i = prompt i
    queries: list[tuple[str, str, int]]  # the classifier runs' (text, domain, tokens); [] without --classifier
    baseline: BaselineSetup


@dataclass
class _Measured:
    platform: dict
    baselines: list[dict]
    classified: list[dict]  # the classifier runs (classifier_runs); [] without --classifier
    kv: dict | None = None  # the in-process platform's KV pool (kv_summary); None for a --target
    placement: dict = field(default_factory=dict)  # the planned placement's summary (--redundant)
    runner: dict = field(default_factory=dict)  # the in-process engine's model runner (ModelRunner.describe)
    #: what carried each group's calls at the end (group -> "in-process", "shm", ...; empty against a --target)
    transports: dict = field(default_factory=dict)


def run(options: Options) -> dict:
    """The benchmark once: the platform and its baselines (and the classifier's runs); its JSON result."""
    from expertmesh.infra.devices import router_device

    checkpoint = validate(options)
    device = router_device(options.device, "--device")
    text = checkpoint.config.get_text_config()
    inputs = _Inputs(
        options,
        checkpoint,
        text.vocab_size,
        prompts(options, text.vocab_size),
        text_prompts(options, checkpoint) if options.classifier else [],
        BaselineSetup(checkpoint.path, options.dtype, device, text.pad_token_id),
    )
    with torch_threads(options.threads[0] if options.threads else None) as threads:
        measured = _on_target(inputs) if options.target else _served_here(inputs)
    return _result(inputs, threads, measured)


def run_sweep(options: Options) -> dict:
    """The benchmark at each of ``options.shapes`` (prompt and answer lengths; none: the lengths given) and, for
    each, at each of ``options.sweep`` client counts (none: ``clients``); one summary row per point. Every shape is
    checked against the model before the first point starts."""
    validate(options)
    points = [
        sweep_point(n, run(dataclasses.replace(shape, clients=n, sweep=())))
        for shape in shaped(options)
        for n in options.sweep or (options.clients,)
    ]
    return {"benchmark": "serve-sweep", "model": points[0]["result"]["model"], "points": points}


def _on_target(inputs: _Inputs) -> _Measured:
    """Against a running ``expertmesh up`` (its prefix cache kept; its engine's steps unknown here)."""
    options, target = inputs.options, inputs.options.target
    check_target(target, inputs.checkpoint, inputs.vocab_size)
    # the classifier runs first: a target without capability profiles fails them before the baselines load
    classified = classifier_runs(target, options, inputs.queries)
    platform, baselines = _best_threads(options, lambda: _interleaved(target, inputs))
    return _Measured(platform, baselines, classified)


def _served_here(inputs: _Inputs) -> _Measured:
    """Against ``expertmesh up`` started here: with ``--redundant``, its experts placed by load first; its
    prefix cache emptied before each platform run, its engine's steps and KV pool reported."""
    options = inputs.options
    placement: dict = {}
    planes: list = []

    def ready(plane, target: str) -> None:
        planes.append(plane)
        if options.redundant is not None:
            from expertmesh.bench.planned_placement import place_by_load

            placement.update(
                place_by_load(plane, options.redundant, partial(calibrate, target, options, inputs.vocab_size))
            )

    device = inputs.baseline.device
    with served_here(options, inputs.checkpoint, device, ready=ready) as server:
        target = f"127.0.0.1:{server.port}"
        classified = classifier_runs(target, options, inputs.queries)
        fresh, steps = server.engine.reset_prefix_cache, partial(settled_step_totals, server.engine)
        platform, baselines = _best_threads(options, lambda: _interleaved(target, inputs, fresh, steps))
        kv = server.engine.kv_usage()
        runner = server.engine.runner.describe()
        transports = planes[0].dispatcher.transports()
    kv = None if kv is None else kv_summary(kv)
    return _Measured(platform, baselines, classified, kv, placement, runner, transports)


def _interleaved(
    target: str,
    inputs: _Inputs,
    fresh: Callable[[], object] | None = None,
    steps: Callable[[], dict] | None = None,
) -> tuple[dict, list[dict]]:
    """The platform run and the baseline runs, ``options.repeats`` times in turn; the median of each. ``fresh``
    empties the platform's prefix cache before each platform run's timed requests; ``steps`` reads its engine's
    step totals (see ``served.platform_run``)."""
    options, work = inputs.options, inputs.work
    load = Load(options.clients, options.requests_per_client, options.max_new_tokens)
    with ExitStack() as opened:
        baselines = [opened.enter_context(BASELINES[name](inputs.baseline)) for name in _ordered(options)]
        repeats = [
            (
                platform_run(target, options, work, fresh=fresh, steps=steps),
                *(
                    _figures(run, name)
                    for name, baseline in zip(_ordered(options), baselines)
                    for run in baseline.runs(work, load)
                ),
            )
            for _ in range(options.repeats)
        ]
    platform, *baselines = (median_run(list(runs)) for runs in zip(*repeats))
    return platform, baselines


def _ordered(options: Options) -> list[str]:
    """The chosen baselines in the registry's order: ``generate`` first, its first run the reference."""
    return sorted(options.baselines, key=list(BASELINES).index)


def _figures(run: BaselineRun, baseline: str) -> dict:
    """A baseline run's row: its figures, which baseline ran it, and its decode steps when it told them."""
    figures = {**summary(run.name, run.concurrency, run.requests), "baseline": baseline}
    if run.decode is not None:
        figures["decode_steps"] = decode_steps(*run.decode)
    return figures


def _best_threads(options: Options, measure: Callable[[], tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """``measure()`` (the platform run and the baselines) at each of ``options.threads`` when several: each run
    its best count's (most tokens/s), with every count's tokens/s beside it; else once, as it is."""
    if len(options.threads) <= 1:
        return measure()
    import torch

    by_count = {}
    previous = torch.get_num_threads()
    try:
        for count in options.threads:
            progress(f"bench serve: everything at {count} torch intra-op threads")
            torch.set_num_threads(count)
            platform, baselines = measure()
            by_count[count] = [platform, *baselines]
    finally:
        torch.set_num_threads(previous)
    best = best_of_threads(by_count)
    return best[0], best[1:]


def _result(inputs: _Inputs, threads: int, measured: _Measured) -> dict:
    """The run's JSON: the model, the setup, every run, the platform's ratios and whether it gave the
    baseline's answers."""
    options, platform, baselines = inputs.options, measured.platform, measured.baselines
    result = {
        "benchmark": "serve",
        "model": model_summary(inputs.checkpoint),
        "setup": {
            **options_summary(options),
            "threads": list(options.threads) if len(options.threads) > 1 else threads,
            "platform": options.target
            or f"in-process expertmesh up (local data plane, {RUNNERS[options.groups_as]}, gRPC on loopback)",
            **device_summary(inputs.baseline.device),
            "prompt_lengths": [len(p) for p in inputs.work],
            "machine": machine(),
        },
        "runs": [platform, *baselines],
        "platform_vs": {r["name"]: platform["tokens_per_s"] / r["tokens_per_s"] for r in baselines},
        # the reference: stock transformers, each prompt alone (vLLM's kernels are not token-identical)
        "agreement": same_tokens(platform, baselines[0]) if _ordered(options)[0] == "generate" else None,
    }
    if options.classifier:
        result["classifier"] = classifier_summary(measured.classified, inputs.queries)
    if measured.kv is not None:
        result["kv"] = measured.kv
    if measured.placement:
        result["placement"] = measured.placement
    if measured.runner:
        result["runner"] = measured.runner
    if measured.transports:
        result["setup"]["transports"] = measured.transports
    if options.price_per_hour is not None:
        for run in result["runs"]:
            run["usd_per_million_output_tokens"] = per_million_tokens(options.price_per_hour, run["tokens_per_s"])
    return result
