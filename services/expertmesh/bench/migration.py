"""``expertmesh bench migration``: what live moves cost the clients being served.

Workload: an in-process ``expertmesh up`` (local Ray, ``--groups`` groups, the
in-process store) with ``--clients`` N threads each streaming greedy requests of
``--max-new-tokens`` M tokens, one after another, for the whole run. After
``--quiet-seconds`` of traffic, ``--moves`` K moves run one after another through
the migration executor, each expert of a layer going from the group that holds
it to the next group and back; then another quiet period.

Figures, from the one run: inter-token latency (ITL, the gap between consecutive
streamed tokens of a request) p50/p99 of tokens that arrived *during* a move
against those that arrived *outside* any move (target: p99 during <= 1.2x
outside); time per move; bytes loaded per move; failed requests and completions
that differ from the same prompt served before any move (both must be 0).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from expertmesh.bench.looping import LoopingClients
from expertmesh.bench.report import (
    BenchError,
    add_load_arguments,
    check_positive,
    format_table,
    load_options,
    machine,
    model_summary,
    options_summary,
    percentile,
    print_and_write,
)
from expertmesh.infra.console import progress


@dataclass(frozen=True)
class Options:
    model: Path
    groups: int = 2
    clients: int = 8
    max_new_tokens: int = 16
    moves: int = 10
    quiet_seconds: float = 8.0
    heartbeat_s: float = 0.25


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "migration", help="streaming clients' latency during live expert moves vs outside them"
    )
    add_load_arguments(p, groups=2, groups_help="expert groups")
    p.add_argument("--moves", type=int, default=10, help="moves, one after another (default 10)")
    p.add_argument(
        "--quiet-seconds", type=float, default=8.0, help="traffic with no move, before and after (default 8)"
    )
    p.add_argument("--heartbeat", type=float, default=0.25, help="router heartbeat seconds (default 0.25)")
    p.add_argument("--out", default="bench-migration.json", help="JSON results (default bench-migration.json)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    if not args.quiet_seconds > 0 or not args.heartbeat > 0:
        raise BenchError("--quiet-seconds and --heartbeat must be > 0")
    options = Options(
        **load_options(args),
        moves=check_positive(args.moves, "--moves"),
        quiet_seconds=args.quiet_seconds,
        heartbeat_s=args.heartbeat,
    )
    if options.groups < 2:
        raise BenchError("--groups must be at least 2: a move needs somewhere to go")
    result = run(options)
    print_and_write(table(result), result, args.out)
    return 0


def _moves(spec, groups: list[str], placement, count: int) -> list[tuple[int, int, str, str]]:
    """(layer, expert, source, target) for ``count`` moves: each expert to the next group, then back."""
    owner = {pair: group for group, pairs in placement.groups.items() for pair in pairs}
    out = []
    for n in range(count):
        layer = spec.moe_layers[(n // 2) % len(spec.moe_layers)]
        expert = (n // 2) % spec.num_experts
        home = owner[(layer, expert)]
        away = groups[(groups.index(home) + 1) % len(groups)]
        out.append((layer, expert, home, away) if n % 2 == 0 else (layer, expert, away, home))
    return out


def run(options: Options) -> dict:
    import torch

    from expertmesh.client import Client
    from expertmesh.config.settings import DataPlaneConfig, ServingConfig
    from expertmesh.models.checkpoint import Checkpoint
    from expertmesh.orchestrator.migration.executor import MigrationExecutor
    from expertmesh.orchestrator.migration.state import Phase
    from expertmesh.platform.data_plane import DataPlane
    from expertmesh.platform.router_apis import serve_plane

    checkpoint = Checkpoint(options.model)
    spec = checkpoint.spec
    vocab = checkpoint.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (8 + i,), generator=gen).tolist() for i in range(options.clients)]

    config = DataPlaneConfig(model=checkpoint.path, groups=options.groups, heartbeat_s=options.heartbeat_s)
    plane = DataPlane.start(config)
    executor = MigrationExecutor(plane.store, poll_s=0.05)
    try:
        server = serve_plane(plane, ServingConfig(port=0, max_active_sequences=max(32, options.clients)))
        target = f"127.0.0.1:{server.port}"
        with Client(target, timeout=600) as client:
            reference = [
                [
                    t
                    for c in client.generate(p, max_new_tokens=options.max_new_tokens, stop_at_eos=False)
                    for t in c.token_ids
                ]
                for p in prompts
            ]
        traffic = LoopingClients(target, prompts, reference, options.max_new_tokens)
        progress(f"bench migration: {options.clients} streaming clients; {options.quiet_seconds:.0f}s with no move")
        traffic.grow(options.clients)
        time.sleep(options.quiet_seconds)
        windows, records = [], []
        for n, (layer, expert, source, target_group) in enumerate(
            _moves(spec, sorted(plane.placement.groups), plane.placement, options.moves)
        ):
            started = time.perf_counter()
            migration = executor.submit(layer, expert, target=target_group, source=source)
            final = executor.run(migration.id)
            windows.append((started, time.perf_counter()))
            records.append(final)
            if final.phase is not Phase.SUCCEEDED:
                raise BenchError(f"move {n + 1} ended {final.phase}: {final.reason}")
            progress(
                f"bench migration: move {n + 1}/{options.moves} "
                f"layer {layer} expert {expert} {source} -> {target_group}"
            )
        time.sleep(options.quiet_seconds)
        traffic.stop()
        server.drain_and_stop()
    finally:
        executor.close()
        progress("bench migration: stopping the platform")
        plane.close()

    def during(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    inside = [g for t, g in traffic.gaps if during(t)]
    outside = [g for t, g in traffic.gaps if not during(t)]
    seconds = [b - a for a, b in windows]

    def itl(values):
        return {"tokens": len(values), "p50": 1e3 * percentile(values, 50), "p99": 1e3 * percentile(values, 99)}

    return {
        "benchmark": "migration",
        "model": model_summary(checkpoint),
        "setup": {**options_summary(options), "machine": machine(), "platform": "in-process expertmesh up"},
        "itl_ms": {"outside_moves": itl(outside), "during_moves": itl(inside)},
        "p99_during_over_outside": percentile(inside, 99) / percentile(outside, 99) if inside and outside else None,
        "moves": {
            "count": len(records),
            "seconds_mean": sum(seconds) / len(seconds),
            "seconds_p50": percentile(seconds, 50),
            "seconds_max": max(seconds),
            "bytes_loaded_mean": sum(m.bytes_loaded for m in records) / len(records),
            "table_versions": [m.table_version for m in records],
        },
        "requests": traffic.request_figures("differing_from_reference"),
    }


def table(result: dict) -> str:
    model, itl, moves, requests = result["model"], result["itl_ms"], result["moves"], result["requests"]
    title = (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x {model['num_experts']} "
        f"experts; {result['setup']['clients']} streaming clients; {result['setup']['machine']['cpus']} CPUs"
    )
    body = format_table(
        ["tokens arrived", "count", "ITL p50 ms", "ITL p99 ms"],
        [[name.replace("_", " "), v["tokens"], v["p50"], v["p99"]] for name, v in itl.items()],
        ["", "d", ".2f", ".2f"],
    )
    ratio = result["p99_during_over_outside"]
    ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
    return (
        f"{title}\n{body}\n"
        f"ITL p99 during / outside moves: {ratio_text} (target <= 1.2x)\n"
        f"{moves['count']} moves: {moves['seconds_mean']:.2f} s each on average (p50 {moves['seconds_p50']:.2f}, "
        f"max {moves['seconds_max']:.2f}), {moves['bytes_loaded_mean'] / 1e3:.1f} kB loaded per move\n"
        f"requests: {requests['completed']} completed, {requests['failed']} failed, "
        f"{requests['differing_from_reference']} differing from the reference"
    )
