"""``expertmesh bench chaos``: what faults cost the clients being served, and whether the
platform keeps its promise of no wrong answer with status OK.

The platform (``chaos.platform``): a redis-server of its own, expert groups on Ray Serve from
``build_app`` with every expert on two groups, ``expertmesh orchestrator --health-monitor``
and ``expertmesh up --router-only``. ``--clients`` N threads stream greedy completions of
exactly ``--max-new-tokens`` M tokens for the whole run; each prompt's reference completion
is served before any fault. Then the faults (``chaos.faults``), one at a time, each after
``--quiet-seconds`` of undisturbed traffic and each healed before the next: SIGKILL of a
group's replica, SIGSTOP of a group, one expert's weights corrupted in a running group (the
groups' test-only fault hook, enabled for this run), the same with its other replica evicted
first (the quarantine then leaves a fallback: degraded outputs), Redis stopped, Redis frozen
(SIGSTOP), Redis flushed, a routing table of another model published over the good one, a live
move followed by a flush, a flush during an operator's quarantine of a corrupted replica (it must
come back before any table, and no request may be served by the replica), the orchestrator killed,
a group started from another checkpoint of the same shapes under a group's name (registering, then
its address written over the good one's), a group made the only holder of a whole layer and then
killed, an expert quarantined on every layer while long prompts fill the prefix cache and then
released (the same prompts again must be exact), and Redis frozen under clients streaming over the
HTTP API with the ``prefer`` policy (its ``/health/live`` polled throughout).

Per scenario (``chaos.measure``): requests sent / completed / failed, completions that differ
from the reference (``wrong_outputs``: must be 0; for the corruption, the ones sent before the
quarantine took effect are counted apart as ``wrong_before_quarantine``, and ``degraded`` ones
served by a quarantine fallback apart again), seconds to detect, to quarantine and to recover,
streamed tokens per second during the fault against the quiet window before it, and the longest
stall of any stream (``measure.longest_stall_s``: the longest a client waited for its next token,
or for the error that ended its request) during the fault and in the quiet window before it; and
what an operator saw of the fault (``evidence``: a refusal and its reason). A fault's own requests
(``probes``: the long prompts, the HTTP clients) count with the clients'; ``health_live_max_ms`` is
the longest ``/health/live`` took where a fault watched it.

``--hosts``: the multi-host fault bed. Redis, the orchestrator, the router and each expert group
(a plain ``expertmesh group serve`` process, no Ray) each on a test host of its own, a network
namespace with its own address (``chaos.hosts``, ``chaos.hosts_platform``), so calls cross a
network stack and the router reaches the groups by gRPC over TCP, never shared memory. Needs
root. This process makes the bed and re-runs the command inside its ``client`` host (so the
clients and the store reads dial only addresses of the bed), then deletes the bed. Its faults
(``HOST_SCENARIOS``, ``chaos.host_faults``): a group host's link down for the hold and back,
with and without another replica of one of its experts; the Redis host cut off; the
orchestrator host cut off just after it started a live move; a group host killed whole. Per
scenario also ``experts_unhosted``: the (layer, expert) pairs any read of the routing table
during it found without a replica (must be none); and for the run, the router's transport per
group (``group_transports``) and whether the router holds TCP connections to each group host.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from expertmesh.bench.report import (
    BenchError,
    add_load_arguments,
    check_positive,
    format_table,
    load_options,
    machine,
    model_summary,
    options_summary,
    write_json,
)
from expertmesh.infra.console import progress

#: every scenario, in the order they run
SCENARIOS = (
    "group-sigkill",
    "group-sigstop",
    "expert-corrupted",
    "expert-corrupted-sole",
    "redis-stopped",
    "redis-frozen",
    "redis-flushed",
    "table-mismatch",
    "flush-after-move",
    "flush-during-quarantine",
    "orchestrator-killed",
    "foreign-checkpoint-group",
    "sole-group-killed",
    "released-after-degraded-prefix",
    "redis-frozen-http-prefer",
)
#: the multi-host scenarios (``--hosts``), in the order they run
HOST_SCENARIOS = (
    "host-link-down-replicated",
    "host-link-down-sole",
    "redis-host-cut-off",
    "orchestrator-cut-off-mid-migration",
    "group-host-killed",
)


@dataclass(frozen=True)
class Options:
    model: Path
    groups: int = 3
    clients: int = 8
    max_new_tokens: int = 16
    quiet_seconds: float = 5.0
    hold_seconds: float = 15.0
    redis_down_seconds: float = 10.0
    health_interval_s: float = 5.0
    health_tokens: int = 1000
    group_timeout_s: float = 2.0
    deadline_s: float = 60.0
    corrupt_factor: float = 2.0
    #: the corrupted expert is the one whose share of the tokens is nearest this
    target_share: float = 0.05
    scenarios: tuple[str, ...] = SCENARIOS
    #: keep the router's and the orchestrator's output here
    log_dir: Path | None = None


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "chaos", help="faults one at a time under streaming load: failed and wrong requests, detection, recovery"
    )
    add_load_arguments(p, groups=3, groups_help="expert groups; every expert is on two")
    p.add_argument("--quiet-seconds", type=float, default=5.0, help="undisturbed traffic before each fault (default 5)")
    p.add_argument("--hold-seconds", type=float, default=15.0, help="how long each fault lasts at least (default 15)")
    p.add_argument("--redis-down-seconds", type=float, default=10.0, help="how long Redis stays stopped (default 10)")
    p.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between health-monitor rounds (default 5)"
    )
    p.add_argument("--health-tokens", type=int, default=1000, help="probe tokens per replica per round (default 1000)")
    p.add_argument(
        "--group-timeout", type=float, default=2.0, help="the router's deadline of one group call, s (default 2)"
    )
    p.add_argument("--deadline", type=float, default=60.0, help="each request's deadline, s (default 60)")
    p.add_argument(
        "--corrupt-factor",
        type=float,
        default=2.0,
        help="the corrupted expert's weights are scaled by this (default 2)",
    )
    p.add_argument(
        "--target-share",
        type=float,
        default=0.05,
        help="corrupt the expert nearest this share of tokens (default 0.05)",
    )
    p.add_argument(
        "--scenarios",
        help=f"comma-separated subset of: {', '.join(SCENARIOS)}; "
        f"with --hosts of: {', '.join(HOST_SCENARIOS)} (default: all)",
    )
    p.add_argument(
        "--hosts",
        action="store_true",
        help="each process on a test host of its own (network namespaces; needs root): the multi-host scenarios",
    )
    p.add_argument("--in-bed", type=Path, help=argparse.SUPPRESS)  # the re-run inside the bed's client host
    p.add_argument("--logs", type=Path, help="keep the router's and the orchestrator's output in this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario instead of the table")
    p.add_argument("--out", default="bench-chaos.json", help="JSON results (default bench-chaos.json)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    known = HOST_SCENARIOS if args.hosts else SCENARIOS
    scenarios = known if args.scenarios is None else tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = sorted(set(scenarios) - set(known))
    if unknown or not scenarios:
        with_hosts = " with --hosts" if args.hosts else ""
        raise BenchError(f"--scenarios takes names from {', '.join(known)}{with_hosts}; got {args.scenarios!r}")
    for flag, value in (
        ("--quiet-seconds", args.quiet_seconds),
        ("--hold-seconds", args.hold_seconds),
        ("--redis-down-seconds", args.redis_down_seconds),
        ("--health-interval", args.health_interval),
        ("--group-timeout", args.group_timeout),
        ("--deadline", args.deadline),
    ):
        if not value > 0:
            raise BenchError(f"{flag} must be > 0, got {value}")
    if not 0 < args.target_share < 1:
        raise BenchError(f"--target-share must be between 0 and 1, got {args.target_share}")
    if args.corrupt_factor == 1 or not args.corrupt_factor > 0:
        raise BenchError(f"--corrupt-factor must be > 0 and not 1, got {args.corrupt_factor}")
    options = Options(
        **load_options(args),
        quiet_seconds=args.quiet_seconds,
        hold_seconds=args.hold_seconds,
        redis_down_seconds=args.redis_down_seconds,
        health_interval_s=args.health_interval,
        health_tokens=check_positive(args.health_tokens, "--health-tokens"),
        group_timeout_s=args.group_timeout,
        deadline_s=args.deadline,
        corrupt_factor=args.corrupt_factor,
        target_share=args.target_share,
        scenarios=tuple(s for s in known if s in scenarios),
        log_dir=args.logs,
    )
    if "orchestrator-cut-off-mid-migration" in options.scenarios and options.groups < 3:
        raise BenchError(
            "orchestrator-cut-off-mid-migration needs --groups 3 or more: "
            "it moves an expert to a group that does not hold it"
        )
    if args.hosts and args.in_bed is None:
        return _run_in_bed(options)
    hosts = None
    if args.in_bed is not None:
        from expertmesh.bench.chaos.hosts import BedPlan, TestHosts

        hosts = TestHosts.adopt(BedPlan.from_dict(json.loads(args.in_bed.read_text())))
    # Ray prints its notices about the replica this benchmark kills to stdout: keep them off the results.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(options, hosts)
    if args.json:
        for scenario in result["scenarios"]:
            print(json.dumps(scenario))
    else:
        print(table(result))
    write_json(args.out, result)
    progress(f"wrote {args.out}")
    return 0


def _run_in_bed(options: Options) -> int:
    """Make the test hosts, run this same command again inside their client host (its part that
    measures), and delete them, also when it fails."""
    import subprocess
    import tempfile

    from expertmesh.bench.chaos.hosts import TestHosts, check_can_create, plan
    from expertmesh.bench.chaos.hosts_platform import CLIENT, host_names

    check_can_create()
    with (
        TestHosts(plan(host_names(options.groups))) as hosts,
        tempfile.TemporaryDirectory(prefix="expertmesh-bed-") as tmp,
    ):
        bed_file = Path(tmp) / "bed.json"
        bed_file.write_text(json.dumps(hosts.bed.to_dict()))
        progress(
            f"bench chaos: {len(hosts.bed.hosts)} test hosts on {hosts.bed.subnet} (namespaces em{hosts.bed.run_id}-*)"
        )
        argv = [sys.executable, "-m", "expertmesh.cli.main", *sys.argv[1:], "--in-bed", str(bed_file)]
        # The driver itself needs no private TMPDIR: it shares the bed file and the model with the hosts.
        return subprocess.run(hosts.command(CLIENT, argv, private_tmp=False)).returncode


@dataclass(frozen=True)
class Target:
    """The expert the corruption scenarios corrupt, and where."""

    layer: int
    expert: int
    #: its share of the tokens routed so far
    share: float
    #: its replicas: the corrupted one, and the other
    group: str
    other: str


def pick_expert(platform, target_share: float) -> Target:
    """The (layer, expert) whose share of the tokens routed so far is nearest ``target_share``."""
    from expertmesh.contracts.load_report import summed_pulses

    total = summed_pulses(platform.store.loads())
    if total is None:
        raise BenchError("the router has published no expert load yet")
    tokens = total.load.sum(axis=1) / max(total.top_k, 1)  # [L]: tokens routed per MoE layer
    shares = {
        (layer, e): float(total.load[i, e] / tokens[i])
        for i, layer in enumerate(total.moe_layers)
        for e in range(total.num_experts)
        if tokens[i] > 0
    }
    (layer, expert), share = min(shares.items(), key=lambda item: (abs(item[1] - target_share), item[0]))
    group, other = platform.store.routing_table().replicas[(layer, expert)][:2]
    return Target(layer, expert, share, group, other)


def _host_fault(name: str, platform):
    from expertmesh.bench.chaos import host_faults

    groups, table = platform.groups, platform.store.routing_table()
    if name == "host-link-down-replicated":
        return host_faults.HostLinkDown(groups[0])
    if name == "host-link-down-sole":
        group = groups[1 % len(groups)]
        pair = min(p for p, holders in table.replicas.items() if group in holders)
        other = next(g for g in table.replicas[pair] if g != group)
        return host_faults.HostLinkDown(group, pair, other)
    if name == "redis-host-cut-off":
        return host_faults.RedisHostCutOff()
    if name == "orchestrator-cut-off-mid-migration":
        layer, expert = min(table.replicas)
        holders = table.replicas[(layer, expert)]
        target = next(g for g in groups if g not in holders)
        return host_faults.OrchestratorCutOffMidMigration(layer, expert, holders[0], target)
    return host_faults.GroupHostKilled(groups[-1])


def _fault(name: str, options: Options, platform, target: Callable[[], Target]):
    from expertmesh.bench.chaos import faults

    if name in HOST_SCENARIOS:
        return _host_fault(name, platform)
    if name == "group-sigkill":
        return faults.GroupKilled(platform.groups[0])
    if name == "group-sigstop":
        return faults.GroupStopped(platform.groups[-1])
    if name.startswith("expert-corrupted"):
        t = target()
        evict = t.other if name == "expert-corrupted-sole" else None
        return faults.ExpertCorrupted(t.layer, t.expert, t.group, t.share, options.corrupt_factor, evict)
    if name == "redis-stopped":
        return faults.RedisStopped(options.redis_down_seconds)
    if name == "redis-frozen":
        return faults.RedisFrozen(options.redis_down_seconds)
    if name == "redis-flushed":
        return faults.RedisFlushed()
    if name == "table-mismatch":
        return faults.TableMismatch()
    if name == "flush-after-move":
        layer, expert = min(platform.store.routing_table().replicas)
        source, *_ = platform.store.routing_table().replicas[(layer, expert)]
        holders = set(platform.store.routing_table().replicas[(layer, expert)])
        target = next(g for g in platform.groups if g not in holders)
        return faults.FlushedAfterMove(layer, expert, source, target)
    if name == "released-after-degraded-prefix":
        vocab = platform.checkpoint.config.get_text_config().vocab_size
        busiest = pick_expert(platform, 1.0)  # the expert most tokens choose: the fallback changes most answers
        prompts = tuple(map(tuple, faults.long_prompts(vocab, 3)))
        return faults.ReleasedAfterDegradedPrefix(busiest.expert, prompts, options.max_new_tokens)
    if name == "redis-frozen-http-prefer":
        vocab = platform.checkpoint.config.get_text_config().vocab_size
        prompts = tuple(map(tuple, faults.long_prompts(vocab, 3, blocks=1, seed=11)))
        return faults.RedisFrozenUnderHttpPrefer(prompts, options.max_new_tokens, down_s=options.redis_down_seconds)
    if name == "foreign-checkpoint-group":
        return faults.ForeignCheckpointGroup(platform.groups[1 % len(platform.groups)])
    if name == "sole-group-killed":
        return faults.SoleGroupKilled(*faults.sole_layer(platform.store.routing_table(), platform.groups))
    if name == "flush-during-quarantine":
        busiest = pick_expert(platform, 1.0)  # the expert most tokens choose: a leak shows soonest
        return faults.FlushedDuringQuarantine(busiest.layer, busiest.expert, busiest.group, options.corrupt_factor)
    return faults.OrchestratorKilled()


def run(options: Options, hosts=None) -> dict:
    """The scenarios of ``options`` on the loopback platform, or with ``hosts`` (a ``TestHosts``
    this process runs inside, on its client host) on the multi-host one."""
    import torch

    from expertmesh.bench.chaos.faults import ExpertCorrupted
    from expertmesh.bench.chaos.host_faults import UnhostedWatch
    from expertmesh.bench.chaos.measure import count, itl_p99_ms, longest_stall_s, overlapping, tokens_per_second
    from expertmesh.bench.chaos.platform import ChaosPlatform, PlatformSettings
    from expertmesh.bench.chaos.traffic import Traffic, complete
    from expertmesh.client import Client

    settings = PlatformSettings(
        model=options.model,
        groups=options.groups,
        health_interval_s=options.health_interval_s,
        health_tokens=options.health_tokens,
        group_timeout_s=options.group_timeout_s,
        log_dir=options.log_dir,
    )
    if hosts is None:
        platform = ChaosPlatform(settings).start()
    else:
        from expertmesh.bench.chaos.hosts_platform import HostsPlatform

        platform = HostsPlatform(settings, hosts).start()
    target = functools.cache(lambda: pick_expert(platform, options.target_share))
    vocab = platform.checkpoint.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (8 + i,), generator=gen).tolist() for i in range(options.clients)]
    runs = []
    try:
        with Client(platform.target, timeout=options.deadline_s) as client:
            reference = [complete(client, p, options.max_new_tokens) for p in prompts]
        traffic = Traffic(platform.target, prompts, options.max_new_tokens, options.deadline_s).start()
        progress(f"bench chaos: {options.clients} streaming clients; {len(options.scenarios)} faults, one at a time")
        try:
            for name in options.scenarios:
                quiet_from = time.monotonic()
                time.sleep(options.quiet_seconds)
                fault = _fault(name, options, platform, target)
                progress(f"bench chaos: {fault.description}")
                watch = None if hosts is None else UnhostedWatch(platform).start()
                try:
                    timeline = fault.run(platform, options.hold_seconds)
                finally:
                    if watch is not None:
                        watch.stop()
                runs.append((fault, quiet_from, timeline, watch))
                if timeline.recovered is None:
                    why = f" ({timeline.note})" if timeline.note else ""
                    progress(f"bench chaos: {name} did not recover within the time allowed{why}; stopping here")
                    break
        finally:
            traffic.stop()
        if hosts is not None:
            paths = _cross_host_paths(platform)
    finally:
        progress("bench chaos: stopping the platform")
        platform.close()

    scenarios = []
    for fault, quiet_from, t, watch in runs:
        end = _span_end(t, options.hold_seconds)
        mine = overlapping(traffic.requests, t.injected, end)
        counts = count(mine, reference, t) + count(t.probes, t.probe_reference, t)
        before = tokens_per_second(traffic.arrivals, quiet_from, t.injected)
        during = tokens_per_second(traffic.arrivals, t.injected, end)

        entry = {
            "scenario": fault.name,
            "fault": fault.description,
            **{k: v for k, v in asdict(counts).items() if k != "failures"},
            "failures": counts.failures,
            "recovered": t.recovered is not None,
            "seconds_to_recover": _since(t.injected, t.recovered),
            "tokens_per_s_before": before,
            "tokens_per_s_during": during,
            "throughput_during_over_before": during / before if before and during is not None else None,
            "itl_p99_ms_before": itl_p99_ms(traffic.requests, quiet_from, t.injected),
            "itl_p99_ms_during": itl_p99_ms(traffic.requests, t.injected, end),
            "longest_stall_s_before": longest_stall_s(traffic.requests, quiet_from, t.injected),
            "longest_stall_s_during": longest_stall_s([*traffic.requests, *t.probes], t.injected, end),
        }
        if t.probes:
            entry["probes"] = len(t.probes)
        if t.health_live_max_s is not None:
            entry["health_live_max_ms"] = 1e3 * t.health_live_max_s
        if isinstance(fault, ExpertCorrupted):
            since = functools.partial(_since, t.injected)
            entry.update(
                expert={"layer": fault.layer, "expert": fault.expert, "group": fault.group, "share": fault.share},
                detected=t.detected is not None,
                seconds_to_detect=since(t.detected),
                quarantined=t.quarantined is not None,
                seconds_to_quarantine=since(t.quarantined),
                seconds_to_repair=since(t.repaired),
            )
        if watch is not None:
            entry.update(
                experts_unhosted=sorted(watch.unhosted), table_reads=watch.reads, table_reads_failed=watch.unread
            )
        if t.note:
            entry["note"] = t.note
        if t.evidence:
            entry["evidence"] = list(t.evidence)
        scenarios.append(entry)
    setup = {**options_summary(options), "machine": machine(), "placement": "every expert on two groups"}
    if hosts is not None:
        setup.update(hosts={h.name: h.address for h in hosts.bed.hosts}, **paths)
    return {
        "benchmark": "chaos",
        "model": model_summary(platform.checkpoint),
        "setup": setup,
        "steady": _steady(
            traffic.requests, reference, [(t.injected, _span_end(t, options.hold_seconds)) for _, _, t, _ in runs]
        ),
        "scenarios": scenarios,
    }


def _cross_host_paths(platform) -> dict:
    """How the router reaches each group: the transport it reports (ListModels' group_transports:
    "grpc-stream" / "grpc-unary" between hosts, "shm" / "cuda-ipc" on one) and whether the group's
    host holds an established TCP connection from the router's address to the group's port."""
    from expertmesh.bench.chaos.hosts_platform import GROUP_PORT
    from expertmesh.client import Client

    with Client(platform.target, timeout=30) as client:
        (info,) = client.models()
    router = platform.address_of("router")
    tcp = {
        g: any(
            local.endswith(f":{GROUP_PORT}") and remote.split(":")[0] == router
            for local, remote in platform.hosts.connections(platform.host_of(g))
        )
        for g in platform.groups
    }
    return {"group_transports": dict(info.group_transports), "router_tcp_to_groups": tcp}


def _since(start: float, moment: float | None) -> float | None:
    return None if moment is None else moment - start


def _span_end(t, hold_s: float) -> float:
    """A scenario lasts from the injection until the platform is whole again, and at least ``hold_s``
    (a one-off fault's aftermath is watched that long too)."""
    return max(t.recovered if t.recovered is not None else t.lifted, t.injected + hold_s)


def _steady(requests, reference, spans) -> dict:
    """Requests outside every fault: the control group (all must succeed and equal the reference)."""
    quiet = [r for r in requests if not any(r.sent <= b and r.ended >= a for a, b in spans)]
    done = [r for r in quiet if r.ok]
    return {
        "sent": len(quiet),
        "completed": len(done),
        "failed": len(quiet) - len(done),
        "wrong_outputs": sum(list(r.tokens) != list(reference[r.client]) for r in done),
    }


def table(result: dict) -> str:
    model, setup = result["model"], result["setup"]
    title = (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x {model['num_experts']} "
        f"experts on {setup['groups']} groups (every expert on two); {setup['clients']} streaming clients x "
        f"{setup['max_new_tokens']} tokens; {setup['machine']['cpus']} CPUs"
        + ("; each process on a test host of its own" if "hosts" in setup else "")
    )
    rows = [
        [
            s["scenario"],
            s["sent"],
            s["completed"],
            s["failed"],
            s["wrong_outputs"],
            s.get("wrong_before_quarantine"),
            s["degraded"],
            s.get("seconds_to_detect"),
            s.get("seconds_to_quarantine"),
            s["seconds_to_recover"],
            s["tokens_per_s_before"],
            s["tokens_per_s_during"],
            s["itl_p99_ms_before"],
            s["itl_p99_ms_during"],
            s["longest_stall_s_before"],
            s["longest_stall_s_during"],
        ]
        for s in result["scenarios"]
    ]
    headers = [
        "scenario",
        "sent",
        "done",
        "failed",
        "wrong",
        "wrong<q",
        "degraded",
        "detect s",
        "quar. s",
        "recover s",
        "tok/s before",
        "tok/s during",
        "ITL p99 ms before",
        "during",
        "stall s before",
        "during",
    ]
    formats = ["", "d", "d", "d", "d", "d", "d", ".1f", ".1f", ".1f", ".1f", ".1f", ".0f", ".0f", ".2f", ".2f"]
    if "hosts" in setup:  # the multi-host scenarios: experts any table read found without a replica
        headers.append("unhosted")
        formats.append("d")
        for row, s in zip(rows, result["scenarios"]):
            row.append(len(s["experts_unhosted"]))
    body = format_table(headers, rows, formats)
    steady = result["steady"]
    lines = [
        title,
        body,
        (
            f"outside the faults: {steady['sent']} sent, {steady['completed']} completed, {steady['failed']} failed, "
            f"{steady['wrong_outputs']} wrong"
        ),
    ]
    if "hosts" in setup:
        paths = ", ".join(
            f"{g} {t or '-'}{'' if setup['router_tcp_to_groups'].get(g) else ' (no TCP connection seen)'}"
            for g, t in sorted(setup["group_transports"].items())
        )
        lines.append(f"router -> groups: {paths}")
    for s in result["scenarios"]:
        lines.append(f"{s['scenario']}: {s['fault']}" + (f" ({s['note']})" if "note" in s else ""))
        for seen in s.get("evidence", ()):
            lines.append(f"  seen: {seen}")
        for failure, n in s["failures"].items():
            lines.append(f"  {n} x {failure}")
    return "\n".join(lines)
