"""Control-plane commands: ``orchestrator``, ``migrate``, ``migrations``, ``drift``, ``experts``,
``quarantine``, ``release``, ``topology``, ``plan`` and ``bench placement|migration|chaos``.

``expertmesh.cli`` calls ``add_commands``; each command's ``run(args)`` returns
the exit code, and input errors raise PlacementError (the CLI prints one line and
exits 2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import yaml

from expertmesh.errors import PlacementError
from expertmesh.orchestrator.topology import Topology, topology_to_dict


def add_commands(commands, bench_commands) -> None:
    from expertmesh.orchestrator import bench_chaos, bench_migration, migrate_cli, process
    from expertmesh.orchestrator.drift import cli as drift_cli
    from expertmesh.orchestrator.health import cli as health_cli

    process.add_command(commands)
    migrate_cli.add_commands(commands)
    drift_cli.add_command(commands)
    health_cli.add_commands(commands)
    topo = commands.add_parser("topology", help="print the GPU topology tree (nodes, NUMA, NVLink islands, GPUs)")
    topo.add_argument("--source", choices=["nvml", "k8s", "file"], help="default: file when --file is given, else nvml")
    topo.add_argument("--file", help="topology YAML (--source file) or saved `kubectl get nodes -o json` (--source k8s)")
    topo.add_argument("--format", choices=["tree", "yaml"], default="tree", help="yaml: the topology file format")
    topo.set_defaults(run=run_topology)

    p = commands.add_parser("plan", help="plan expert placement from load stats and topology")
    p.add_argument("--stats", required=True, help="load stats JSON (num_layers, num_experts, top_k, load, coactivation)")
    p.add_argument("--topology", required=True, help="topology YAML")
    p.add_argument("--redundant", type=int, required=True, help="redundant replicas per layer beyond one per expert")
    p.add_argument("--slots-per-gpu", type=int, help="replicas one GPU holds per layer (default ceil((E+N)/GPUs))")
    p.add_argument("--current", help="current placement JSON: keep what is good enough, move few weights")
    p.add_argument("--min-gain", type=float, default=0.0, help="keep a current layer within this balancedness of the plan")
    p.add_argument("--balance-tolerance", type=float, default=0.0, help="relative max-load slack traded for island locality")
    p.add_argument("--eplb-groups", type=int, default=1, help="expert groups for the EPLB baseline (hierarchical policy)")
    affinity = p.add_mutually_exclusive_group()
    affinity.add_argument(
        "--profiles", help="capability profiles JSON (a list of `expertmesh profile` records): co-locate experts hot in one domain"
    )
    affinity.add_argument("--state-url", help="read the capability profiles from this state store instead (redis://...)")
    p.add_argument("--out", default="placement.json", help="placement JSON to write (default placement.json)")
    p.set_defaults(run=run_plan)

    bench_migration.add_command(bench_commands)
    bench_chaos.add_command(bench_commands)
    b = bench_commands.add_parser(
        "placement", help="placement planner vs DeepSeek EPLB on synthetic workloads, and with vs without domain affinity"
    )
    b.add_argument("--out", default="bench-placement.json", help="JSON results (default bench-placement.json)")
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic workloads")
    b.add_argument("--quick", action="store_true", help="two tiny cases (for tests)")
    b.set_defaults(run=run_bench_placement)


def load_topology(source: str | None, path: str | None) -> Topology:
    from expertmesh.orchestrator import topology_discovery as disc

    source = source or ("file" if path else "nvml")
    if source == "file":
        if not path:
            raise PlacementError("--source file needs --file PATH")
        return disc.load_topology_file(path)
    if source == "k8s":
        return disc.load_k8s_topology(path)
    return disc.discover_nvml()


def run_topology(args: argparse.Namespace) -> int:
    topo = load_topology(args.source, args.file)
    print(topo.render() if args.format == "tree" else yaml.safe_dump(topology_to_dict(topo), sort_keys=False), end="\n")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from expertmesh.orchestrator import topology_discovery as disc
    from expertmesh.orchestrator.placement.bench import format_rows
    from expertmesh.orchestrator.placement.metrics import summarize
    from expertmesh.orchestrator.placement.plan import parse_placement_json, placement_to_dict
    from expertmesh.orchestrator.placement.planner import PlanOptions, plan
    from expertmesh.orchestrator.placement.stats import parse_stats_json

    stats = parse_stats_json(disc.read_text(args.stats, "stats file"))
    topo = disc.load_topology_file(args.topology)
    sites = topo.sites()
    gpu_ids = tuple(s.gpu.id for s in sites)
    current = None
    if args.current:
        current = parse_placement_json(disc.read_text(args.current, "current placement"), gpu_ids, stats.num_layers, stats.num_experts)
    if not 0.0 <= args.min_gain <= 1.0:
        raise PlacementError(f"--min-gain must be between 0 and 1, got {args.min_gain}")
    if args.balance_tolerance < 0:
        raise PlacementError(f"--balance-tolerance must be >= 0, got {args.balance_tolerance}")
    options = PlanOptions(
        redundant=args.redundant,
        slots_per_gpu=args.slots_per_gpu,
        min_gain=args.min_gain,
        balance_tolerance=args.balance_tolerance,
        eplb_groups=max(1, args.eplb_groups),
    )
    affinity = _affinity(args)
    start = time.perf_counter()
    result = plan(stats, topo, options, current, affinity)
    seconds = time.perf_counter() - start
    result.placement.check(result.slots_per_gpu)
    try:
        Path(args.out).write_text(json.dumps(placement_to_dict(result.placement)) + "\n")
    except OSError as err:
        raise PlacementError(f"cannot write {args.out!r}: {err.strerror}") from None

    island = np.array([s.island for s in sites])
    node = np.array([s.node for s in sites])
    before = None if current is None else current.shares
    rows = [
        ("planner", summarize(stats.load, stats.coactivation, island, node, result.placement.shares, before, seconds)),
        ("eplb", summarize(stats.load, stats.coactivation, island, node, result.baseline.shares, before)),
    ]
    print(
        f"{stats.num_layers} layers x {stats.num_experts} experts onto {len(gpu_ids)} GPUs,"
        f" {args.redundant} redundant, {result.slots_per_gpu} slots per GPU"
        + (f", {result.layers_kept} layers kept as current" if current is not None else "")
    )
    print(format_rows(rows))
    if affinity is not None:
        from expertmesh.orchestrator.placement.affinity import groups_per_token

        touched = [groups_per_token(affinity, r.shares, stats.top_k).mean() for r in (result.placement, result.baseline)]
        print(
            f"domain affinity from {len(affinity.domains)} profiles ({', '.join(affinity.domains)}): expected GPUs touched"
            f" per token {touched[0]:.3f} (eplb {touched[1]:.3f})"
        )
    print(f"wrote {args.out}")
    return 0


def _affinity(args: argparse.Namespace):
    """The planner's domain affinity from ``--profiles`` or ``--state-url``, or None."""
    from expertmesh.orchestrator.placement.affinity import affinity_from_counts
    from expertmesh.router.profiles import load_profiles, read_profiles_file

    if args.profiles:
        profiles = list(read_profiles_file(args.profiles).values())
    elif args.state_url:
        from expertmesh.state import open_store

        store = open_store(args.state_url)
        try:
            profiles = list(load_profiles(store).values())
        finally:
            store.close()
    else:
        return None
    if not profiles:
        raise PlacementError("no capability profiles to plan with: build them with `expertmesh profile build`")
    if len({(p.moe_layers, p.share.shape) for p in profiles}) != 1:
        raise PlacementError("the capability profiles were built on different models: rebuild them with `expertmesh profile build`")
    profiles.sort(key=lambda p: p.domain)
    counts = np.stack([p.share * p.choices[:, None] for p in profiles], axis=1)  # [L, D, E] choices per domain
    return affinity_from_counts(tuple(p.domain for p in profiles), counts)


def run_bench_placement(args: argparse.Namespace) -> int:
    from expertmesh.orchestrator.placement.bench import (
        affinity_cases,
        affinity_table,
        results_json,
        results_table,
        run_affinity_case,
        run_bench,
    )

    results = run_bench(args.quick, args.seed)
    print(results_table(results))
    affinity = [run_affinity_case(case, args.seed) for case in affinity_cases(args.quick)]
    print()
    print(affinity_table(affinity))
    try:
        Path(args.out).write_text(results_json(results, args.seed, affinity) + "\n")
    except OSError as err:
        raise PlacementError(f"cannot write {args.out!r}: {err.strerror}") from None
    print(f"wrote {args.out}")
    return 0

