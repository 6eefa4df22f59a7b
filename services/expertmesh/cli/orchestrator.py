"""Control-plane commands: ``orchestrator``, ``migrate``, ``migrations``, ``drift``, ``experts``,
``quarantine``, ``release``, ``topology``, ``plan`` and ``bench placement|migration|chaos|scale``.

``expertmesh.cli.main`` calls ``add_commands``; each command's ``run(args)`` returns
the exit code, and input errors raise InputError (the CLI prints one line and
exits 2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import yaml

from expertmesh.contracts.errors import InputError, InvalidRequest
from expertmesh.contracts.topology import Topology, topology_to_dict
from expertmesh.orchestrator.placement.memory import DTYPE_BYTES


def add_commands(commands, bench_commands) -> None:
    from expertmesh.bench import elastic as bench_elastic
    from expertmesh.bench import migration as bench_migration
    from expertmesh.bench.chaos import suite as bench_chaos
    from expertmesh.bench.scale import suite as bench_scale
    from expertmesh.cli import drift as drift_cli
    from expertmesh.cli import experts as health_cli
    from expertmesh.cli import migrate as migrate_cli
    from expertmesh.platform import orchestrator_process as process

    process.add_command(commands)
    migrate_cli.add_commands(commands)
    drift_cli.add_command(commands)
    health_cli.add_commands(commands)
    topo = commands.add_parser("topology", help="print the GPU topology tree (nodes, NUMA, NVLink islands, GPUs)")
    topo.add_argument("--source", choices=["nvml", "k8s", "file"], help="default: file when --file is given, else nvml")
    topo.add_argument(
        "--file", help="topology YAML (--source file) or saved `kubectl get nodes -o json` (--source k8s)"
    )
    topo.add_argument("--format", choices=["tree", "yaml"], default="tree", help="yaml: the topology file format")
    topo.set_defaults(run=run_topology)

    p = commands.add_parser(
        "plan", help="plan expert placement from load stats and topology (`plan memory`: what a model needs where)"
    )
    # `plan --stats ... --topology ... --redundant N` plans; `plan memory ...` is the memory model. The planner's
    # three flags are required there, checked in run_plan (argparse cannot require them of one form only).
    p.add_argument("--stats", help="load stats JSON (num_layers, num_experts, top_k, load, coactivation); required")
    p.add_argument("--topology", help="topology YAML; required")
    p.add_argument("--redundant", type=int, help="redundant replicas per layer beyond one per expert; required")
    p.add_argument(
        "--model", help="checkpoint directory (config.json is enough): refuse a plan whose experts outgrow a GPU"
    )
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="with --model: the serving dtype")
    p.add_argument("--slots-per-gpu", type=int, help="replicas one GPU holds per layer (default ceil((E+N)/GPUs))")
    p.add_argument("--current", help="current placement JSON: keep what is good enough, move few weights")
    p.add_argument(
        "--min-gain", type=float, default=0.0, help="keep a current layer within this balancedness of the plan"
    )
    p.add_argument(
        "--incremental",
        action="store_true",
        help="with --current: start from it (its GPUs may differ from the topology's: GPUs added or removed), "
        "repair each layer with the fewest moves and re-plan only the layers still below the plan's balancedness",
    )
    p.add_argument(
        "--balance-tolerance", type=float, default=0.0, help="relative max-load slack traded for island locality"
    )
    p.add_argument(
        "--eplb-groups",
        type=int,
        default=1,
        help="gating groups (DeepSeek's n_group) for the EPLB baseline's hierarchical policy",
    )
    affinity = p.add_mutually_exclusive_group()
    affinity.add_argument(
        "--profiles",
        help="capability profiles JSON (a list of `expertmesh profile` records): co-locate experts hot in one domain",
    )
    affinity.add_argument(
        "--state-url", help="read the capability profiles from this state store instead (redis://...)"
    )
    p.add_argument("--out", default="placement.json", help="placement JSON to write (default placement.json)")
    p.set_defaults(run=run_plan)
    plan_sub = p.add_subparsers(dest="plan_command", metavar="[memory]")
    m = plan_sub.add_parser(
        "memory", help="memory per device: router (shared layers, KV cache), each group or GPU (experts)"
    )
    m.add_argument("--model", required=True, help="checkpoint directory (config.json is enough: no weights are read)")
    where = m.add_mutually_exclusive_group()
    where.add_argument("--placement", help="placement YAML (groups -> layer/expert pairs): one row per group")
    where.add_argument("--gpu-placement", help="placement JSON of `expertmesh plan` (with --topology): one row per GPU")
    m.add_argument(
        "--topology", help="topology YAML: each GPU's memory_gb (alone: every expert once, spread evenly over its GPUs)"
    )
    m.add_argument("--batch", type=int, required=True, help="concurrent sequences the router caches")
    m.add_argument("--seq", type=int, required=True, help="tokens per sequence (prompt + generated)")
    m.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="dtype of weights and cache")
    m.add_argument("--router-memory-gb", type=float, help="the router's device memory: say whether it fits")
    m.add_argument("--json", action="store_true", help="print JSON instead of the table")
    m.set_defaults(run=run_plan_memory)

    bench_migration.add_command(bench_commands)
    bench_elastic.add_command(bench_commands)
    bench_chaos.add_command(bench_commands)
    bench_scale.add_command(bench_commands)
    b = bench_commands.add_parser(
        "placement",
        help="placement planner vs DeepSeek EPLB on synthetic workloads, and with vs without domain affinity",
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
            raise InputError("--source file needs --file PATH")
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

    missing = [
        flag
        for flag, value in (("--stats", args.stats), ("--topology", args.topology), ("--redundant", args.redundant))
        if value is None
    ]
    if missing:
        raise InputError(f"plan needs {', '.join(missing)} (or `plan memory` for the memory model)")
    from expertmesh.bench.placement import format_rows
    from expertmesh.contracts.gpu_plan import parse_placement_json, placement_gpu_ids, placement_to_dict
    from expertmesh.orchestrator.placement.planner import PlanOptions, plan
    from expertmesh.orchestrator.placement.quality import summarize
    from expertmesh.orchestrator.placement.stats import parse_stats_json

    stats = parse_stats_json(disc.read_text(args.stats, "stats file"))
    topo = disc.load_topology_file(args.topology)
    sites = topo.sites()
    gpu_ids = tuple(s.gpu.id for s in sites)
    current = None
    if args.incremental and not args.current:
        raise InputError("--incremental re-plans from a placement: give it with --current")
    if args.current:
        text = disc.read_text(args.current, "current placement")
        # incremental: the current placement's own GPUs (some may have left the topology, some be new there)
        current_ids = placement_gpu_ids(text) if args.incremental else gpu_ids
        current = parse_placement_json(text, current_ids, stats.num_layers, stats.num_experts)
    if not 0.0 <= args.min_gain <= 1.0:
        raise InputError(f"--min-gain must be between 0 and 1, got {args.min_gain}")
    if args.balance_tolerance < 0:
        raise InputError(f"--balance-tolerance must be >= 0, got {args.balance_tolerance}")
    options = PlanOptions(
        redundant=args.redundant,
        slots_per_gpu=args.slots_per_gpu,
        min_gain=args.min_gain,
        balance_tolerance=args.balance_tolerance,
        eplb_groups=max(1, args.eplb_groups),
    )
    affinity = _affinity(args)
    start = time.perf_counter()
    if args.incremental:
        from expertmesh.orchestrator.placement.incremental import carry, replan

        result = replan(stats, topo, options, current, affinity)
        previous_shares = carry(current, gpu_ids)  # [L, E, G] on the topology's GPUs
    else:
        result = plan(stats, topo, options, current, affinity)
        previous_shares = None if current is None else current.shares
    seconds = time.perf_counter() - start
    result.placement.check(result.slots_per_gpu)
    if args.model:
        _check_gpu_memory(args.model, args.dtype, result.placement, sites)
    try:
        Path(args.out).write_text(json.dumps(placement_to_dict(result.placement)) + "\n")
    except OSError as err:
        raise InputError(f"cannot write {args.out!r}: {err.strerror}") from None

    island = np.array([s.island for s in sites])
    node = np.array([s.node for s in sites])
    before = previous_shares
    rows = [
        ("planner", summarize(stats.load, stats.coactivation, island, node, result.placement.shares, before, seconds)),
        ("eplb", summarize(stats.load, stats.coactivation, island, node, result.baseline.shares, before)),
    ]
    print(
        f"{stats.num_layers} layers x {stats.num_experts} experts onto {len(gpu_ids)} GPUs,"
        f" {args.redundant} redundant, {result.slots_per_gpu} slots per GPU"
        + (f", {result.layers_kept} layers kept as current" if current is not None and not args.incremental else "")
        + (
            f", incremental: {len(result.layers_replanned)} layers re-planned in full, "
            f"{int(result.moved.sum())} replicas copied to GPUs that did not hold them"
            if args.incremental
            else ""
        )
    )
    print(format_rows(rows))
    if affinity is not None:
        from expertmesh.orchestrator.placement.affinity import groups_per_token

        touched = [
            groups_per_token(affinity, r.shares, stats.top_k).mean() for r in (result.placement, result.baseline)
        ]
        print(
            f"domain affinity from {len(affinity.domains)} profiles ({', '.join(affinity.domains)}): expected GPUs"
            f" touched per token {touched[0]:.3f} (eplb {touched[1]:.3f})"
        )
    print(f"wrote {args.out}")
    return 0


def _replicas_per_gpu(placement) -> dict[int, int]:
    """GPU id -> routed-expert replicas a GPU placement puts on it."""
    counts = (placement.shares > 0).sum(axis=(0, 1))  # [G]
    return {gpu: int(n) for gpu, n in zip(placement.gpu_ids, counts)}


def _model_sizes(model: str):
    from transformers import AutoConfig

    from expertmesh.orchestrator.placement.memory import ModelSizes

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(f"--model {model}: cannot read its config.json ({err})") from None
    try:
        return ModelSizes.of(config)
    except ValueError as err:
        raise InputError(f"--model {model}: {err}") from None


def _check_gpu_memory(model: str, dtype: str, placement, sites) -> None:
    """Refuse a plan that puts more expert weights on a GPU than its memory_gb holds (after its overhead)."""
    from expertmesh.orchestrator.placement.memory import GB, expert_budget_bytes

    sizes = _model_sizes(model)
    per_expert = sizes.params_per_expert * DTYPE_BYTES[dtype]
    memory = {site.gpu.id: site.gpu.memory_gb for site in sites}
    over = [
        (gpu, n * per_expert, memory[gpu])
        for gpu, n in _replicas_per_gpu(placement).items()
        if memory[gpu] and n * per_expert > expert_budget_bytes(int(memory[gpu] * GB))
    ]
    if over:
        gpu, held, gb = over[0]
        raise InputError(
            f"the plan puts {held / GB:.1f} GB of {dtype} expert weights on GPU {gpu} ({gb:g} GB, less its overhead)"
            f"{f' and {len(over) - 1} more over theirs' if len(over) > 1 else ''}; add GPUs, lower --redundant or "
            "--slots-per-gpu, or serve a smaller dtype (see `expertmesh plan memory`)"
        )


def run_plan_memory(args: argparse.Namespace) -> int:
    """``plan memory``: the memory model's table (or JSON) for a model, a placement, a batch and a length."""
    from expertmesh.bench.report import format_table
    from expertmesh.contracts import group_map as placement_mod
    from expertmesh.contracts.gpu_plan import parse_placement_json
    from expertmesh.orchestrator import topology_discovery as disc
    from expertmesh.orchestrator.placement.memory import GB, budget

    if args.batch < 1 or args.seq < 1:
        raise InvalidRequest(f"--batch and --seq must be at least 1, got {args.batch} and {args.seq}")
    sizes = _model_sizes(args.model)
    replicas: dict[str, int] = {}
    capacity: dict[str, int] = {}
    if args.gpu_placement:
        if not args.topology:
            raise InputError("--gpu-placement needs the topology it was planned for (--topology)")
        sites = disc.load_topology_file(args.topology).sites()
        gpu_ids = tuple(site.gpu.id for site in sites)
        gpu_placement = parse_placement_json(
            disc.read_text(args.gpu_placement, "GPU placement"), gpu_ids, sizes.moe_layers, sizes.num_experts
        )
        replicas = {f"gpu {gpu}": n for gpu, n in _replicas_per_gpu(gpu_placement).items()}
        capacity = {f"gpu {site.gpu.id}": int(site.gpu.memory_gb * GB) for site in sites if site.gpu.memory_gb}
    elif args.topology:  # no placement yet: every expert once, spread evenly over the topology's GPUs
        sites = disc.load_topology_file(args.topology).sites()
        experts = sizes.moe_layers * sizes.num_experts
        replicas = {
            f"gpu {site.gpu.id}": experts // len(sites) + (i < experts % len(sites)) for i, site in enumerate(sites)
        }
        capacity = {f"gpu {site.gpu.id}": int(site.gpu.memory_gb * GB) for site in sites if site.gpu.memory_gb}
    elif args.placement:
        from expertmesh.models.checkpoint import Checkpoint

        groups = placement_mod.load(Path(args.placement), Checkpoint(args.model).spec).groups
        replicas = {name: len(pairs) for name, pairs in groups.items()}
    router_capacity = int(args.router_memory_gb * GB) if args.router_memory_gb else None
    rows = budget(sizes, replicas, args.batch, args.seq, DTYPE_BYTES[args.dtype], capacity, router_capacity)
    per_sequence = sizes.kv_bytes(args.seq, DTYPE_BYTES[args.dtype])
    summary = {
        "model_type": sizes.model_type,
        "dtype": args.dtype,
        "total_params": sizes.total_params,
        "shared_params": sizes.shared_params,
        "params_per_expert": sizes.params_per_expert,
        "moe_layers": sizes.moe_layers,
        "num_experts": sizes.num_experts,
        "kv_bytes_per_sequence": per_sequence,
        "batch": args.batch,
        "seq": args.seq,
        "devices": [
            {
                "name": r.name,
                "shared": r.shared,
                "experts": r.experts,
                "replicas": r.replicas,
                "kv": r.kv,
                "overhead": r.overhead,
                "total": r.total,
                "capacity": r.capacity,
                "fits": r.fits,
            }
            for r in rows
        ],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{sizes.model_type}: {sizes.total_params / 1e9:.1f}B parameters, {sizes.shared_params / 1e9:.2f}B shared, "
        f"{sizes.moe_layers} MoE layers x {sizes.num_experts} experts of {sizes.params_per_expert / 1e6:.1f}M; "
        f"{args.dtype}; "
        f"KV cache {per_sequence / 2**20:.1f} MiB per sequence of {args.seq} tokens, {args.batch} sequences"
    )
    print(
        format_table(
            ["device", "replicas", "shared GB", "experts GB", "KV GB", "overhead GB", "total GB", "has GB", "fits"],
            [
                [
                    r.name,
                    r.replicas,
                    r.shared / GB,
                    r.experts / GB,
                    r.kv / GB,
                    r.overhead / GB,
                    r.total / GB,
                    None if r.capacity is None else r.capacity / GB,
                    {True: "yes", False: "NO", None: "-"}[r.fits],
                ]
                for r in rows
            ],
            ["", "d", ".2f", ".2f", ".2f", ".2f", ".2f", ".0f", ""],
        )
    )
    if not replicas:
        total = sum(r.total for r in rows) + (sizes.expert_params * DTYPE_BYTES[args.dtype])
        print(
            f"no placement given: every expert once needs {sizes.expert_params * DTYPE_BYTES[args.dtype] / GB:.1f} GB "
            f"of expert memory ({total / GB:.1f} GB with the router)"
        )
    return 0


def _affinity(args: argparse.Namespace):
    """The planner's domain affinity from ``--profiles`` or ``--state-url``, or None."""
    from expertmesh.orchestrator.placement.affinity import affinity_from_counts
    from expertmesh.router.policy.profiles import load_profiles, read_profiles_file

    if args.profiles:
        profiles = list(read_profiles_file(args.profiles).values())
    elif args.state_url:
        from expertmesh.store import open_store

        store = open_store(args.state_url)
        try:
            profiles = list(load_profiles(store).values())
        finally:
            store.close()
    else:
        return None
    if not profiles:
        raise InputError("no capability profiles to plan with: build them with `expertmesh profile build`")
    if len({(p.moe_layers, p.share.shape) for p in profiles}) != 1:
        raise InputError(
            "the capability profiles were built on different models: rebuild them with `expertmesh profile build`"
        )
    profiles.sort(key=lambda p: p.domain)
    counts = np.stack([p.share * p.choices[:, None] for p in profiles], axis=1)  # [L, D, E] choices per domain
    return affinity_from_counts(tuple(p.domain for p in profiles), counts)


def run_bench_placement(args: argparse.Namespace) -> int:
    from expertmesh.bench.placement import (
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
        raise InputError(f"cannot write {args.out!r}: {err.strerror}") from None
    print(f"wrote {args.out}")
    return 0
