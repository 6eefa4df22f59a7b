"""``expertmesh bench elastic``: an expert group added and another removed under streaming load.

Platform: ``expertmesh up --orchestrator --groups-as process`` as a child process (``--groups`` group
processes, the in-process store, the admin API), as a person runs it; with ``--groups-as ray`` the default
``expertmesh up --orchestrator`` (the groups are Ray Serve deployments of a local Ray; an added group is one
more deployment, a removed one's deployment is deleted). Load: ``--clients`` N looping
streaming greedy clients (``looping``), each request ``--prompt-tokens`` P tokens in, ``--max-new-tokens``
M out, every answer compared token by token with stock transformers ``generate`` (greedy, float32, the
same prompts), computed here first.

Phases, in order (each timed one lasts ``--phase-seconds`` and until every client has finished a request
sent in it):

    baseline    N clients, nothing changes
    add gK      N clients; AddGroup through the admin API until the new group serves (started, filled)
    after add   N clients
    step up     N + S clients (``--step-clients`` S: the load step up)
    remove g0   N + S clients; RemoveGroup of an original group until it is stopped (drained, ended)
    step down   N clients (the load step down)

``--cycles`` C runs these phases C times on the one platform (cycle 2 adds the next free name and removes the
oldest group left), since one p99 rests on a handful of the slowest steps: the target is read on the median
over the cycles.

Figures: per phase, inter-token latency (ITL) p50/p99 and p99 over the p99 of the phase it is compared
with (a change against the phase before it at the same load; targets: <= 1.2x), failed requests and
requests whose tokens differ from stock transformers (targets: 0); add -> the first token the new group
computed (its Describe rows counted, polled; target <= 30 s), add -> serving; remove -> drained and ->
stopped (target: stopped <= 10 s after its drain); moves made and bytes moved (the group records).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.bench.looping import Completion, LoopingClients
from expertmesh.bench.report import (
    BenchError,
    add_load_arguments,
    format_table,
    load_options,
    machine,
    model_summary,
    options_summary,
    percentile,
    print_and_write,
)
from expertmesh.infra.console import progress

if TYPE_CHECKING:
    from expertmesh.bench.chaos.platform import Child

__all__ = ["Options", "Window", "add_command", "median_of", "p99_ratio", "run", "summarize", "table"]

#: ITL p99 during a change over before it, at most (issue 42)
ITL_TARGET = 1.2
#: seconds from add to the first token through the new group, at most
FIRST_TOKEN_TARGET_S = 30.0
#: seconds from the end of a removed group's drain to its process stopped, at most
STOP_TARGET_S = 10.0
#: --cycles at most (each adds a group name: g<groups + cycle>)
MAX_CYCLES = 20


@dataclass(frozen=True)
class Options:
    model: Path
    groups: int = 2
    clients: int = 8
    step_clients: int = 4
    prompt_tokens: int = 8
    max_new_tokens: int = 16
    phase_seconds: float = 8.0
    #: times the phases run on the one platform (the ITL target is read on the median over them)
    cycles: int = 1
    heartbeat_s: float = 0.2
    #: how ``up`` runs the groups: "process" (``group serve`` processes) or "ray" (Ray Serve deployments)
    groups_as: str = "process"
    #: --groups-as ray: a Ray cluster for ``up`` to join (``--ray-address``) instead of starting a local one
    ray_address: str | None = None
    #: seconds any one wait (a change, a phase's answers, the platform's start) may take before the run fails
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Window:
    """One phase of the run: its name, clients running, start and end (``perf_counter`` seconds), the phase
    its ITL is compared with (None: none), and whether a group change ran in it."""

    name: str
    clients: int
    start: float
    end: float
    before: str | None = None
    change: bool = False


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "elastic", help="an expert group added and another removed under streaming load, with a load step"
    )
    add_load_arguments(p, groups=2, groups_help="expert groups at the start")
    p.add_argument(
        "--groups-as",
        choices=("process", "ray", "in-process"),
        default="process",
        help="the platform's groups as `group serve` processes, as Ray Serve deployments or in the platform's own "
        "process (default: %(default)s)",
    )
    p.add_argument("--step-clients", type=int, default=4, help="clients added for the load step (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=8, help="prompt tokens per request (default 8)")
    p.add_argument("--phase-seconds", type=float, default=8.0, help="seconds of each phase with no change (default 8)")
    p.add_argument(
        "--cycles", type=int, default=1, help="times to run the phases, on one platform (median ratios) (default 1)"
    )
    p.add_argument("--heartbeat", type=float, default=0.2, help="router heartbeat seconds (default 0.2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take (default 600)")
    p.add_argument("--out", default="bench-elastic.json", help="JSON results (default bench-elastic.json)")
    p.set_defaults(run=_main)


def checked_options(args: argparse.Namespace) -> Options:
    """The flags as Options; BenchError naming the flag for a bad one (the CLI: exit 2, one line)."""
    if args.step_clients < 0:
        raise BenchError(f"--step-clients must be 0 or more, got {args.step_clients}")
    if args.prompt_tokens < 1:
        raise BenchError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    if not 1 <= args.cycles <= MAX_CYCLES:
        raise BenchError(f"--cycles must be 1 to {MAX_CYCLES}, got {args.cycles}")
    for flag, value in (("--phase-seconds", args.phase_seconds), ("--heartbeat", args.heartbeat)):
        if not value > 0 or math.isinf(value):
            raise BenchError(f"{flag} must be a number of seconds > 0, got {value}")
    if not args.timeout > 0:
        raise BenchError(f"--timeout must be > 0, got {args.timeout}")
    options = Options(
        **load_options(args),
        step_clients=args.step_clients,
        prompt_tokens=args.prompt_tokens,
        phase_seconds=args.phase_seconds,
        cycles=args.cycles,
        heartbeat_s=args.heartbeat,
        groups_as=args.groups_as,
        timeout_s=args.timeout,
    )
    from expertmesh.models.checkpoint import Checkpoint

    spec = Checkpoint(options.model).spec
    if options.groups > spec.num_experts:
        raise BenchError(f"--groups must be at most the model's {spec.num_experts} experts, got {options.groups}")
    if spec.max_context and options.prompt_tokens + options.max_new_tokens > spec.max_context:
        raise BenchError(
            f"--prompt-tokens + --max-new-tokens must be at most the model's context of {spec.max_context} tokens, "
            f"got {options.prompt_tokens + options.max_new_tokens}"
        )
    return options


def _main(args: argparse.Namespace) -> int:
    options = checked_options(args)
    result = run(options)
    print_and_write(table(result), result, args.out)
    return 0


# -- pure: phases, ratios, the table --------------------------------------------------------------------


def p99_ratio(during: dict, before: dict | None) -> float | None:
    """ITL p99 of a phase over that of the phase it is compared with; None without tokens in either."""
    if before is None or not during["tokens"] or not before["tokens"]:
        return None
    if not before["itl_p99_ms"] > 0:
        return None
    return during["itl_p99_ms"] / before["itl_p99_ms"]


def median_of(values: list[float | None]) -> float | None:
    """The median of the known values (None: none known). Example: [1.0, None, 3.0, 2.0] gives 2.0."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    middle = len(known) // 2
    return known[middle] if len(known) % 2 else (known[middle - 1] + known[middle]) / 2


def summarize(
    windows: list[Window],
    gaps: list[tuple[float, float]],
    completed: list[Completion],
    failed: list[tuple[float, int, str]],
) -> list[dict]:
    """Per window: its tokens' ITL (a gap belongs to the window its token arrived in), the requests that ended
    in it, failed or differing, and the p99 ratio to its ``before`` window.

    Example: a window with gaps of 10 and 30 ms gives ``itl_p50_ms`` 20.0."""
    out: list[dict] = []
    for w in windows:

        def within(t: float, w: Window = w) -> bool:
            return w.start <= t < w.end

        itl = [g for t, g in gaps if within(t)]
        ended = [c for c in completed if within(c.ended)]
        out.append(
            {
                "phase": w.name,
                "clients": w.clients,
                "change": w.change,
                "seconds": w.end - w.start,
                "tokens": len(itl),
                "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else None,
                "itl_p99_ms": 1e3 * percentile(itl, 99) if itl else None,
                "requests": len(ended),
                "failed": sum(1 for t, _, _ in failed if within(t)),
                "differing": sum(c.differs for c in ended),
                "before": w.before,
            }
        )
    by_name = {p["phase"]: p for p in out}
    for p in out:
        p["p99_over_before"] = p99_ratio(p, by_name.get(p["before"])) if p["before"] else None
    return out


def _seconds(later: float, earlier: float) -> float | None:
    """``later - earlier`` of two record times (0 = not yet): None when either is missing."""
    return later - earlier if later and earlier else None


def add_figures(record: dict, first_token_s: float | None, held: int | None) -> dict:
    """The add's figures from the new group's record (``group_record``) and what the bench saw."""
    return {
        "group": record["name"],
        "phase": record["phase"],
        "to_first_token_s": first_token_s,
        "to_listed_s": _seconds(record["first_listed_at"], record["requested_at"]),
        "to_serving_s": _seconds(record["finished_at"], record["requested_at"]),
        "moves_planned": record["moves_planned"],
        "moves": record["moves_done"],
        "bytes_moved": record["bytes_moved"],
        "experts": record["experts"],
        "experts_held": held,
        "reason": record["reason"],
    }


def remove_figures(record: dict, group_ended: bool) -> dict:
    """The remove's figures from the removed group's record; ``registered_at`` of a removal is when its last
    expert left it."""
    return {
        "group": record["name"],
        "phase": record["phase"],
        "to_drained_s": _seconds(record["registered_at"], record["requested_at"]),
        "to_stopped_s": _seconds(record["finished_at"], record["requested_at"]),
        "stop_after_drain_s": _seconds(record["finished_at"], record["registered_at"]),
        "moves_planned": record["moves_planned"],
        "moves": record["moves_done"],
        "bytes_moved": record["bytes_moved"],
        "experts": record["experts"],
        "exit_code": record["exit_code"],
        "group_ended": group_ended,
        "reason": record["reason"],
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def table(result: dict) -> str:
    model, setup, requests = result["model"], result["setup"], result["requests"]
    load = setup["load_average"]
    cycles = result["cycles"]
    title = (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x "
        f"{model['num_experts']} experts; {setup['groups']} groups as {_AS[setup.get('groups_as', 'process')]}; "
        f"{setup['clients']} streaming "
        f"clients (+{setup['step_clients']} in the load step), {setup['prompt_tokens']} + {setup['max_new_tokens']} "
        f"tokens; {setup['machine']['cpus']} CPUs, load average {load['start']:.1f} at the start, "
        f"{load['end']:.1f} at the end"
    )
    blocks = [
        (f"cycle {number} of {len(cycles)}\n" if len(cycles) > 1 else "") + _cycle_table(cycle)
        for number, cycle in enumerate(cycles, 1)
    ]
    ratios = "; ".join(
        f"{kind} {', '.join('-' if v is None else f'{v:.2f}x' for v in values)}"
        + (f" (median {_x(result['p99_median'][kind])})" if len(values) > 1 else "")
        for kind, values in result["p99_during_change_over_before"].items()
    )
    return (
        f"{title}\n" + "\n".join(blocks) + "\n"
        f"ITL p99 during a change over before it: {ratios} (target <= {ITL_TARGET:g}x"
        + (", on the median)" if len(cycles) > 1 else ")")
        + f"\nrequests: {requests['completed']} completed, {requests['failed']} failed, "
        f"{requests['differing_from_stock']} with tokens different from stock transformers (targets: 0, 0)"
    )


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _cycle_table(cycle: dict) -> str:
    """One cycle's phases, and its add and remove."""
    from expertmesh.orchestrator.elastic.plan import size

    add, remove = cycle["add"], cycle["remove"]
    body = format_table(
        ["phase", "clients", "s", "requests", "failed", "changed", "ITL p50 ms", "ITL p99 ms", "p99 vs", "ratio"],
        [
            [
                p["phase"],
                p["clients"],
                p["seconds"],
                p["requests"],
                p["failed"],
                p["differing"],
                p["itl_p50_ms"],
                p["itl_p99_ms"],
                p["before"] or "-",
                None if p["p99_over_before"] is None else _x(p["p99_over_before"]),
            ]
            for p in cycle["phases"]
        ],
        ["", "d", ".1f", "d", "d", "d", ".1f", ".1f", "", ""],
    )
    return (
        f"{body}\n"
        f"add {add['group']}: first token through it {_s(add['to_first_token_s'])} after the add (target <= "
        f"{FIRST_TOKEN_TARGET_S:g} s), listed {_s(add['to_listed_s'])}, serving {_s(add['to_serving_s'])}; "
        f"{add['moves']}/{add['moves_planned']} moves, {size(add['bytes_moved'])} copied, {add['experts']} experts\n"
        f"remove {remove['group']}: drained {_s(remove['to_drained_s'])} after the request, stopped "
        f"{_s(remove['stop_after_drain_s'])} after its drain (target <= {STOP_TARGET_S:g} s), "
        f"{_s(remove['to_stopped_s'])} in all; {remove['moves']}/{remove['moves_planned']} moves, "
        f"{size(remove['bytes_moved'])} copied"
    )


#: how the table's title says the groups run
_AS = {"process": "processes", "ray": "Ray Serve deployments", "in-process": "in the router's process"}


# -- the run ----------------------------------------------------------------------------------------------


def group_record(status) -> dict:
    """An ``ExpertGroupStatus`` as plain data; ``phase`` as ``groups list`` writes it (serving, stopped, ...)."""
    from expertmesh.v1 import admin_pb2 as apb

    return {
        "name": status.name,
        "phase": apb.GroupPhase.Name(status.phase).removeprefix("GROUP_PHASE_").lower(),
        "address": status.address,
        "pid": status.pid,
        "experts": status.experts,
        "reason": status.reason,
        "requested_at": status.requested_at,
        "registered_at": status.registered_at,
        "first_listed_at": status.first_listed_at,
        "finished_at": status.finished_at,
        "moves_planned": status.moves_planned,
        "moves_done": status.moves_done,
        "bytes_moved": status.bytes_moved,
        "exit_code": status.exit_code if status.HasField("exit_code") else None,
    }


def stock_reference(model: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Stock transformers ``generate`` of each prompt alone: greedy, float32, no end-of-sequence token
    (exactly ``max_new_tokens``, as the clients ask with ``stop_at_eos=False``)."""
    import torch
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(
        model, experts_implementation="eager", dtype=torch.float32, local_files_only=True
    ).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])  # [1, P]
            new = stock.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                do_sample=False,
                pad_token_id=0,
            )  # [1, P + M]
            out.append(new[0, len(p) :].tolist())
    return out


@dataclass(frozen=True)
class _Platform:
    """``expertmesh up`` as a child process: the process, its Inference API and its admin API."""

    child: Child
    target: str
    admin: str


def _start_platform(options: Options) -> _Platform:
    from expertmesh.bench.chaos.platform import Child

    argv = ["up", "--model", str(options.model), "--groups", str(options.groups), "--dtype", "float32"]
    argv += ["--groups-as", options.groups_as, "--orchestrator", "--port", "0", "--admin-port", "0"]
    argv += ["--max-active", str(max(32, options.clients + options.step_clients))]
    argv += ["--ray-address", options.ray_address] if options.ray_address else []
    child = Child("up", argv, {"EXPERTMESH_HEARTBEAT_S": str(options.heartbeat_s)}).start()
    try:
        target = child.wait_for(r"expertmesh is serving \S+ on (\S+:\d+) ", options.timeout_s).group(1)
        admin = child.wait_for(r"orchestrator admin gRPC on (\S+:\d+)", 60).group(1)
    except BaseException:
        child.stop()
        raise
    return _Platform(child, target, admin)


class _Admin:
    """The admin API's group RPCs, and the Describe of the groups they name."""

    def __init__(self, address: str, timeout_s: float):
        from expertmesh.orchestrator.admin_client import connect

        self._channel, self._stub = connect(address)
        self._timeout_s = timeout_s

    def close(self) -> None:
        self._channel.close()

    def groups(self) -> dict[str, dict]:
        from expertmesh.orchestrator.admin_client import call
        from expertmesh.v1 import admin_pb2 as apb

        return {g.name: group_record(g) for g in call(self._stub.ListGroups, apb.ListGroupsRequest()).groups}

    def add(self) -> str:
        from expertmesh.orchestrator.admin_client import call
        from expertmesh.v1 import admin_pb2 as apb

        return call(self._stub.AddGroup, apb.AddGroupRequest()).name

    def remove(self, name: str) -> None:
        from expertmesh.orchestrator.admin_client import call
        from expertmesh.v1 import admin_pb2 as apb

        call(self._stub.RemoveGroup, apb.RemoveGroupRequest(name=name))

    def follow(self, name: str, done: str, watch_rows: bool = False) -> tuple[dict, float | None, int | None]:
        """Poll group ``name`` until it is ``done`` or failed: its last record, and with ``watch_rows`` when
        it first had computed a row (``perf_counter``; its Describe polled once it has an address, as
        ``test_elastic_groups_live`` does) and the experts it says it holds at the end."""
        import grpc

        from expertmesh.infra.group_channels import group_channel
        from expertmesh.orchestrator.admin_client import call
        from expertmesh.v1 import admin_pb2 as apb
        from expertmesh.v1 import experts_pb2 as epb
        from expertmesh.v1 import experts_pb2_grpc as epb_grpc

        deadline = time.monotonic() + self._timeout_s
        channel, first_row, held = None, None, None
        try:
            while True:
                record = group_record(call(self._stub.GetGroup, apb.GetGroupRequest(name=name)))
                if watch_rows and record["address"] and first_row is None:
                    channel = channel or group_channel(record["address"])
                    try:
                        described = epb_grpc.ExpertGroupStub(channel).Describe(epb.DescribeRequest(), timeout=10)
                    except grpc.RpcError:
                        described = None
                    if described is not None and sum(s.rows for s in described.expert_stats) > 0:
                        first_row = time.perf_counter()
                finished = record["phase"] in (done, "failed")
                if finished and (not watch_rows or first_row is not None or record["phase"] == "failed"):
                    break
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"group {name} is still {record['phase']} after {self._timeout_s:g} s "
                        f"({record['moves_done']}/{record['moves_planned']} moves; --timeout)"
                    )
                time.sleep(0.05)
            if channel is not None and record["phase"] == done:
                described = epb_grpc.ExpertGroupStub(channel).Describe(epb.DescribeRequest(), timeout=10)
                held = len(described.experts)
        finally:
            if channel is not None:
                channel.close()
        return record, first_row, held


def _timed_phase(
    name: str, traffic: LoopingClients, options: Options, before: str | None, seconds: float | None = None
) -> Window:
    """``seconds`` (default ``options.phase_seconds``) of traffic, and on until every client has finished a
    request sent in it."""
    seconds = options.phase_seconds if seconds is None else seconds
    progress(f"bench elastic: {name}, {traffic.active} clients")
    start = time.perf_counter()
    deadline = start + seconds + options.timeout_s
    time.sleep(seconds)
    while len(traffic.completions_since(start)) < traffic.active:
        if time.perf_counter() > deadline:
            raise BenchError(f"{name}: a client had no answer for {options.timeout_s:g} s (--timeout)")
        time.sleep(0.05)
    return Window(name, traffic.active, start, time.perf_counter(), before)


def _closed(address: str, within_s: float = 10.0) -> bool:
    """Whether nothing accepts connections at ``address`` (host:port) any more, or does not within ``within_s``."""
    import socket

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _ended(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` (on this host) has ended, or does within ``within_s`` (a Ray Serve replica's
    worker exits just after Serve has stopped the replica)."""
    deadline = time.monotonic() + within_s
    while pid and Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _prompts(vocab: int, count: int, tokens: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (tokens,), generator=gen).tolist() for _ in range(count)]


def run(options: Options) -> dict:
    """The whole run (platform started and stopped here); the result as JSON-ready data."""
    from expertmesh.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(options.model)
    load_start = os.getloadavg()[0]
    vocab = checkpoint.config.get_text_config().vocab_size
    prompts = _prompts(vocab, options.clients + options.step_clients, options.prompt_tokens)
    progress(f"bench elastic: stock transformers generate of {len(prompts)} prompts (the reference)")
    reference = stock_reference(checkpoint.path, prompts, options.max_new_tokens)
    progress(
        f"bench elastic: starting expertmesh up --orchestrator --groups-as {options.groups_as} "
        f"({options.groups} groups)"
    )
    up = _start_platform(options)
    try:
        admin = _Admin(up.admin, options.timeout_s)
        try:
            result = _measure(options, up, admin, prompts, reference)
        finally:
            admin.close()
        result["platform_served_on"] = up.child.proc.poll() is None
    finally:
        progress("bench elastic: stopping the platform")
        up.child.stop()
    result["platform_exit_code"] = up.child.proc.returncode
    result["model"] = model_summary(checkpoint)
    result["setup"] = {
        **options_summary(options),
        "machine": machine(),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "platform": f"expertmesh up --orchestrator --groups-as {options.groups_as} (a child process)",
    }
    return result


def _measure(options: Options, up: _Platform, admin: _Admin, prompts, reference) -> dict:
    before = admin.groups()
    if sorted(before) != [f"g{i}" for i in range(options.groups)] or any(
        g["phase"] != "serving" for g in before.values()
    ):
        raise BenchError(f"the platform started with groups {before}, not g0..g{options.groups - 1} serving")
    traffic = LoopingClients(up.target, prompts, reference, options.max_new_tokens)
    cycles: list[dict] = []
    try:
        traffic.grow(options.clients)
        progress(f"bench elastic: {options.clients} streaming clients; waiting for every client's first answer")
        _timed_phase("warm-up", traffic, options, None, seconds=0)
        for number in range(1, options.cycles + 1):
            if options.cycles > 1:
                progress(f"bench elastic: cycle {number} of {options.cycles}")
            cycles.append(_cycle(options, admin, traffic))
        after = admin.groups()
    finally:
        traffic.stop()

    for cycle in cycles:
        cycle["phases"] = summarize(cycle.pop("windows"), traffic.gaps, traffic.completed, traffic.failed)
    ratios = {
        kind: [next(p["p99_over_before"] for p in c["phases"] if p["phase"].startswith(kind + " ")) for c in cycles]
        for kind in ("add", "remove")
    }
    return {
        "benchmark": "elastic",
        "cycles": cycles,
        "p99_during_change_over_before": ratios,
        "p99_median": {kind: median_of(values) for kind, values in ratios.items()},
        "groups_before": before,
        "groups_after": after,
        "requests": traffic.request_figures("differing_from_stock"),
    }


def _cycle(options: Options, admin: _Admin, traffic: LoopingClients) -> dict:
    """One run of the phases: a group added, the load stepped up, the oldest group removed, the load stepped
    down. Its windows (cut into phases once the clients have stopped) and the two changes' figures."""
    before = admin.groups()
    victim = min((n for n, g in before.items() if g["phase"] == "serving"), key=lambda n: (len(n), n))
    windows: list[Window] = [_timed_phase("baseline", traffic, options, None)]

    started = time.perf_counter()
    new = admin.add()
    progress(f"bench elastic: group {new} added; waiting until it serves")
    added, first_row, held = admin.follow(new, "serving", watch_rows=True)
    windows.append(Window(f"add {new}", traffic.active, started, time.perf_counter(), "baseline", True))
    if added["phase"] != "serving":
        raise BenchError(f"group {new} ended {added['phase']}: {added['reason']}")
    first_token_s = first_row - started if first_row is not None else None
    windows.append(_timed_phase("after add", traffic, options, "baseline"))

    traffic.grow(options.step_clients)
    windows.append(_timed_phase("step up", traffic, options, "baseline"))

    pid, address = before[victim]["pid"], before[victim]["address"]
    started = time.perf_counter()
    admin.remove(victim)
    progress(f"bench elastic: removing group {victim}; waiting until it is stopped")
    removed, _, _ = admin.follow(victim, "stopped")
    windows.append(Window(f"remove {victim}", traffic.active, started, time.perf_counter(), "step up", True))
    if removed["phase"] != "stopped":
        raise BenchError(f"group {victim} ended {removed['phase']}: {removed['reason']}")
    # a group in the platform's process ends with its server; any other with its own process
    group_ended = _closed(address) if options.groups_as == "in-process" else _ended(pid)

    traffic.shrink(options.step_clients)
    windows.append(_timed_phase("step down", traffic, options, "baseline"))
    return {
        "windows": windows,
        "add": add_figures(added, first_token_s, held),
        "remove": remove_figures(removed, group_ended),
    }
