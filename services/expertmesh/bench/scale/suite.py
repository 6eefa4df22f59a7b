"""``expertmesh bench scale``: the control plane simulated at DeepSeek-V3 scale (``bench.scale``).

One case per (GPUs, routers): a simulated day of drifting Zipf load with the real planner, drift
policy, migration executor and health policy. Prints one row per case and writes every figure
(hourly series included) as JSON; ``--plots DIR`` draws balancedness and moves over the day when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.bench.cost import check_price, per_million_tokens
from expertmesh.bench.report import BenchError, format_table, machine, parse_int_list, write_json
from expertmesh.bench.scale.model import DEEPSEEK_V3, QUICK_MODEL, Costs, day_tokens
from expertmesh.infra.console import progress

if TYPE_CHECKING:  # the simulation imports numpy and the router's modules: not at `expertmesh --help`
    from expertmesh.bench.scale.run import Case

#: the quick shape's groups give experts room for 64 of its experts (memory then reads ~0.3, as at full scale)
QUICK_BUDGET_EXPERTS = 64


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser("scale", help="the control plane simulated at DeepSeek-V3 scale over a simulated day")
    p.add_argument("--gpus", default=None, help="GPU counts, one case each (default 64,256; --quick 4,8)")
    p.add_argument("--routers", default=None, help="router counts, one case each (default 16,128; --quick 2,4)")
    p.add_argument("--hours", type=float, default=24.0, help="simulated hours (default 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drifting Zipf load (default 0)")
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.01,
        help="the day-end re-plans and the GPU added/removed keep a layer within this balancedness of the full "
        "plan's (plan --min-gain; 0: every layer as balanced as the full plan's; default 0.01)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a small model ({QUICK_MODEL.moe_layers} layers x {QUICK_MODEL.num_experts} experts): seconds, for CI",
    )
    p.add_argument(
        "--price-per-hour",
        type=float,
        metavar="USD",
        help="US dollars per GPU-hour: each case's cost per million tokens over its simulated day (its GPUs for "
        "the day over the tokens its routers fed; default: not priced)",
    )
    p.add_argument(
        "--capacity",
        action="store_true",
        help="each case also with the capacity controller beside drift (replicas of hot experts, cold ones "
        "retired; its default settings), one more row per case",
    )
    p.add_argument("--out", default="bench-scale.json", help="JSON results (default bench-scale.json)")
    p.add_argument("--plots", type=Path, help="directory for balancedness.png and moves.png (needs matplotlib)")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead of running: one table, JSON and plots of the cases these earlier runs wrote (a day of "
        "each case takes long enough to run them as separate commands, in parallel)",
    )
    p.set_defaults(run=_main)


def cases(
    gpus: list[int],
    routers: list[int],
    hours: float,
    quick: bool,
    seed: int,
    min_gain: float = 0.01,
    capacity: bool = False,
) -> list["Case"]:
    from expertmesh.bench.scale.run import Case
    from expertmesh.orchestrator.capacity.config import CapacityConfig

    model = QUICK_MODEL if quick else DEEPSEEK_V3
    costs = Costs(budget_bytes=QUICK_BUDGET_EXPERTS * model.expert_bytes) if quick else Costs()
    for g in gpus:
        if g % min(8, g):
            raise BenchError(f"--gpus: {g} GPUs do not fill nodes of 8")
        if g * costs.budget_bytes < model.pairs * model.expert_bytes:
            raise BenchError(
                f"--gpus: {g} GPUs cannot hold {model.name}'s {model.pairs} experts "
                f"in {costs.budget_bytes / 1e9:g} GB each"
            )
    if not 0.0 <= min_gain <= 1.0:
        raise BenchError(f"--min-gain must be between 0 and 1, got {min_gain}")
    controllers = [None, CapacityConfig(enabled=True)] if capacity else [None]
    return [
        Case(model, g, r, hours, seed=seed, costs=costs, min_gain=min_gain, capacity=c)
        for g in gpus
        for r in routers
        for c in controllers
    ]


def _main(args: argparse.Namespace) -> int:
    from expertmesh.bench.scale.run import run_case

    check_price(args.price_per_hour)  # before a day of simulation, not after
    if args.merge:
        if args.gpus or args.routers or args.quick:
            raise BenchError("--merge reports earlier runs: it takes no --gpus, --routers or --quick")
        if any(Path(path).resolve() == Path(args.out).resolve() for path in args.merge):
            raise BenchError(f"--merge: --out {args.out} is one of the runs merged; name another file")
        return _report(merged(args.merge), args)
    if not args.hours > 0:
        raise BenchError(f"--hours must be > 0, got {args.hours}")
    gpus = parse_int_list(args.gpus or ("4,8" if args.quick else "64,256"), "--gpus")
    routers = parse_int_list(args.routers or ("2,4" if args.quick else "16,128"), "--routers")
    results = []
    todo = cases(gpus, routers, args.hours, args.quick, args.seed, args.min_gain, args.capacity)
    out = {"benchmark": "scale", "machine": machine(), "loadavg_start": _loadavg(), "results": results}
    for i, case in enumerate(todo):
        progress(f"bench scale: {case.name}, {case.hours:g} simulated hours (case {i + 1} of {len(todo)})")
        results.append(run_case(case, progress=progress))
        # a day of one case takes a quarter to half an hour here: an interrupted run keeps the cases it finished
        write_json(args.out, {**out, "loadavg": _loadavg(), "complete": i + 1 == len(todo)})
    return _report(out, args, write=False)


def _report(out: dict, args: argparse.Namespace, write: bool = True) -> int:
    price = check_price(getattr(args, "price_per_hour", None))
    print(table(out["results"]))
    if price is not None:
        for result in out["results"]:
            result["cost"] = day_cost(result, price)
        print(cost_lines(out["results"], price))
    if write:
        write_json(args.out, out)
    if args.plots is not None:
        print(plots(out["results"], args.plots))
    return 0


def merged(paths: list[str]) -> dict:
    """One result of the cases in the ``bench scale`` JSON files ``paths``, in their order."""
    import json

    results, runs = [], []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise BenchError(f"--merge: cannot read {path!r}: {getattr(err, 'strerror', None) or err}") from None
        cases_in = doc.get("results") if isinstance(doc, dict) and doc.get("benchmark") == "scale" else None
        if not isinstance(cases_in, list) or not all(
            isinstance(r, dict) and {"case", "hours"} <= r.keys() for r in cases_in
        ):
            raise BenchError(f"--merge: {path!r} is not the JSON of a bench scale run")
        if not doc.get("complete", True):
            progress(f"bench scale: {path} is of an unfinished run; its {len(cases_in)} finished cases count")
        results += cases_in
        runs.append({"path": str(path), **{k: doc.get(k) for k in ("machine", "loadavg_start", "loadavg")}})
    return {"benchmark": "scale", "merged_from": runs, "results": results}


def day_cost(result: dict, price_per_gpu_hour: float) -> dict:
    """A case's simulated day priced: its GPUs for the day, the tokens its routers fed (at ``Costs``' peak
    rate and the diurnal curve), and US dollars per million tokens."""
    case = result["case"]
    tokens = day_tokens(case["routers"], Costs().router_tokens_s, case["hours"])
    dollars = case["gpus"] * price_per_gpu_hour * case["hours"]
    return {
        "usd_per_gpu_hour": price_per_gpu_hour,
        "usd": dollars,
        "tokens": tokens,
        "usd_per_million_tokens": per_million_tokens(dollars / case["hours"], tokens / (case["hours"] * 3600.0)),
    }


def cost_lines(results: list[dict], price_per_gpu_hour: float) -> str:
    return f"cost at ${price_per_gpu_hour:.2f} per GPU-hour over the simulated day: " + "; ".join(
        f"{r['case']['gpus']} GPUs {r['case']['routers']} routers ${r['cost']['usd_per_million_tokens']:.2f} "
        f"per million tokens ({r['cost']['tokens'] / 1e9:.2f} G tokens)"
        for r in results
    )


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def table(results: list[dict]) -> str:
    """One row per case. (sim) figures are simulated time, (wall) measured on this machine. ``a/b`` cells are the
    full planner's figure, then the incremental planner's (``-`` in runs made before it)."""
    rows = []
    for r in results:
        store, health, planner = r["store"], r["health"], r["planner"]
        rows.append(
            [
                f"{r['case']['gpus']} GPUs {r['case']['routers']} routers"
                + (" +capacity" if r["case"].get("capacity") else ""),
                planner["first_plan_wall_s"],
                planner.get("first_plan_cpu_s"),
                _pair(planner, "day_end", "wall_s", ".2f"),
                _pair(planner, "day_end", "weights_moved", ""),
                _pair(planner, "day_end", "balancedness", ".3f"),
                _pair(planner, "gpu_added", "wall_s", ".2f"),
                _pair(planner, "gpu_added", "weights_moved", ""),
                _pair(planner, "gpu_added", "balancedness", ".3f"),
                _pair(planner, "gpu_removed", "wall_s", ".2f"),
                _pair(planner, "gpu_removed", "weights_moved", ""),
                _pair(planner, "gpu_removed", "balancedness", ".3f"),
                r["drift"]["moves_per_hour"],
                r["drift"]["bytes_moved_per_hour"] / 1e9,
                _mean(r["hours"], "balancedness_static"),
                _mean(r["hours"], "balancedness_drift"),
                r["memory"]["peak_utilisation"],
                r["table"]["all_routers_serve_s_max"],
                store["ops_s"],
                store["ops_s_per_router"],
                store["router_bytes_in_s"] / 1e6,
                _get(store, "router_bytes_in_s_before", 1e6),
                store["scan_decode_wall_s"],
                _get(store, "scan_decode_wall_s_before"),
                health["probe_bytes"] / 1e9,
                health["probe_sim_s"],
                health["summarise_wall_s"] + health["judge_wall_s"],
                *_sampled(health.get("sampled")),
            ]
        )
    return format_table(
        [
            "case",
            "plan s (wall)",
            "plan s (CPU)",
            "re-plan s full/inc (wall)",
            "re-plan moved full/inc",
            "re-plan bal. full/inc",
            "+1 GPU s full/inc",
            "+1 GPU moved",
            "+1 GPU bal.",
            "-1 GPU s full/inc",
            "-1 GPU moved",
            "-1 GPU bal.",
            "moves/h",
            "GB moved/h",
            "bal. static",
            "bal. drift (+capacity)",
            "peak mem",
            "all routers s (sim)",
            "store ops/s",
            "ops/s/router",
            "store MB/s in",
            "was (whole windows)",
            "scan decode s (wall)",
            "was",
            "probe GB",
            "probe s (sim)",
            "health CPU s (wall)",
            "sampled probe GB",
            "sampled CPU s",
            "rounds to cover (h)",
        ],
        rows,
        [
            "",
            ".2f",
            ".2f",
            *[""] * 9,
            ".1f",
            ".2f",
            ".3f",
            ".3f",
            ".2f",
            ".3f",
            ".0f",
            ".2f",
            ".3f",
            ".3f",
            ".3f",
            ".2f",
            ".1f",
            ".1f",
            ".1f",
            ".1f",
            ".1f",
            "",
        ],
    )


def _get(figures: dict, key: str, unit: float = 1.0) -> float | None:
    """``figures[key] / unit``; None (``-``) in runs made before the figure was."""
    value = figures.get(key)
    return None if value is None else value / unit


def _sampled(sampled: dict | None) -> list:
    """A sampled health round's probe GB, CPU seconds and rounds (hours) to check every replica; ``-`` in runs
    made before sampling."""
    if not sampled:
        return [None, None, None]
    return [
        sampled["probe_bytes"] / 1e9,
        sampled["summarise_wall_s"] + sampled["judge_wall_s"],
        f"{sampled['rounds_to_cover']} ({sampled['hours_to_cover']:.1f})",
    ]


def _pair(planner: dict, change: str, key: str, spec: str) -> str | None:
    """``full/incremental`` of one figure of ``planner[change]``; None when the run has no such figures."""
    figures = planner.get(change)
    if not figures:
        return None
    return f"{format(figures['full'][key], spec)}/{format(figures['incremental'][key], spec)}"


def _mean(hours: list[dict], key: str) -> float | None:
    return sum(h[key] for h in hours) / len(hours) if hours else None


def plots(results: list[dict], directory: Path) -> str:
    """balancedness.png and moves.png in ``directory``; a message saying what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "bench scale: matplotlib is not installed; the hourly series are in the JSON, no plots drawn"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise BenchError(f"--plots: cannot create {str(directory)!r}: {err.strerror}") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        label = f"{r['case']['gpus']} GPUs {r['case']['routers']} routers"
        x = [h["hour"] for h in r["hours"]]
        line = ax.plot(x, [h["balancedness_drift"] for h in r["hours"]], label=f"{label}, drift")[0]
        ax.plot(
            x, [h["balancedness_static"] for h in r["hours"]], "--", color=line.get_color(), label=f"{label}, no drift"
        )
    ax.set(xlabel="simulated hour", ylabel="balancedness (mean / max group load)", title="Balancedness over the day")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "balancedness.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        x = [h["hour"] - 1 + i * width for h in r["hours"]]
        ax.bar(
            x,
            [h["moves"] for h in r["hours"]],
            width=width,
            label=f"{r['case']['gpus']} GPUs {r['case']['routers']} routers",
        )
    ax.set(xlabel="simulated hour", ylabel="moves completed", title="Drift moves per hour")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "moves.png", dpi=120)
    plt.close(fig)
    return f"bench scale: wrote {directory / 'balancedness.png'} and {directory / 'moves.png'}"
