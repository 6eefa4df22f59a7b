"""The ``bench serve`` command: its flags, the options they make, and the run (and its table) they choose."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from expertmesh.bench.cost import check_price
from expertmesh.bench.platform import add_platform_arguments
from expertmesh.bench.report import check_positive, parse_int_list, parse_shapes, print_and_write
from expertmesh.bench.serve.options import Options, check_modes
from expertmesh.config.settings import add_guard_arguments

__all__ = ["add_command", "options_from_args"]


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "serve",
        help="N streaming clients against `expertmesh up` vs transformers generate (one at a time, batched) "
        "and, with --baseline vllm, vLLM's server",
    )
    _add_workload_arguments(p)
    _add_run_arguments(p)
    add_guard_arguments(p)
    add_platform_arguments(p)
    p.add_argument("--out", default="bench-serve.json", help="JSON results (default bench-serve.json)")
    p.set_defaults(run=_main)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What is served, where, and the load: the model, the platform, the clients and their prompts."""
    p.add_argument("--model", type=Path, help="local checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--target", help="host:port of a running `expertmesh up` serving --model (default: start one here)")
    p.add_argument("--groups", type=int, default=2, help="expert groups when starting the platform here (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of both sides")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in turn (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument(
        "--prompt-tokens", type=int, default=32, help="longest prompt; prompts are half to this (default 32)"
    )
    p.add_argument(
        "--equal-prompts",
        action="store_true",
        help="every prompt exactly --prompt-tokens long (sequences of equal length, for the decode step per token)",
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        help="the platform started here feeds at most this many tokens a step (`up --max-step-tokens`; default 1024)",
    )
    p.add_argument(
        "--threads",
        help="torch intra-op threads in this process (the in-process platform's router and the baselines); several, "
        "comma-separated (e.g. 1,2): every run at each count, each row the best (default: torch's, = cores)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and the prompts")
    p.add_argument("--ray-address", help="join this Ray cluster when starting the platform here")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Which runs: the classifier's, repeats, the sweep, and the runs instead of the throughput ones."""
    p.add_argument(
        "--classifier",
        action="store_true",
        help="also measure the query classifier's added TTFT: text prompts with exact, prefer (alpha 0) with the "
        "domain given, and prefer (alpha 0) classified (default: off)",
    )
    p.add_argument(
        "--baseline",
        default="generate",
        help="comma-separated: what the platform is compared with in the same run: generate (stock transformers in "
        "this process, one at a time and batched; the reference of agreement), vllm (vLLM's server from "
        "build/vllm-venv, `make vllm-venv`, or $EXPERTMESH_VLLM_VENV; its answers are not token-identical) "
        "(default generate)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the platform and of each baseline, interleaved; each row reports the median's (default 1)",
    )
    p.add_argument(
        "--sweep",
        help="comma-separated client counts (e.g. 1,8,16,32): the benchmark at each, one table row per point "
        "(default: off)",
    )
    p.add_argument(
        "--shapes",
        metavar="PROMPTxNEW,...",
        help="comma-separated prompt and answer lengths in tokens (e.g. 480x96,64x256: long prompts with short "
        "answers, short prompts with long answers): the benchmark at each, in place of --prompt-tokens and "
        "--max-new-tokens; with --sweep, at each client count too (default: off)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="instead: the prefix-cache run, requests whose prompts share this many leading tokens, the first alone, "
        "the other --clients - 1 after it, with prefix caching on and off (default: off)",
    )
    p.add_argument(
        "--guard",
        choices=["self", "embedding"],
        help="instead: the consistency guard at load with this scorer, text prompts with their domains, each policy "
        "of --guard-policies without and with the guard against exact: bad-case rate and added ms per token "
        "(default model: the trained domain model; default: off)",
    )
    p.add_argument(
        "--guard-policies",
        default="delta_gap,restrict",
        help="comma-separated routing policies the guard run measures (default delta_gap,restrict)",
    )
    p.add_argument(
        "--price-per-hour",
        type=float,
        metavar="USD",
        help="US dollars an hour of this machine: each run's (and each sweep point's) cost per million output "
        "tokens beside its tok/s (default: not priced)",
    )
    p.add_argument(
        "--redundant",
        type=int,
        help="place the experts of the platform started here by their load before the timed runs: calibration "
        "prompts, the placement planner with this many redundant replicas per layer (0: none), live migrations "
        "(default: the contiguous split)",
    )


def _main(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    check_modes(options)
    measure, show = _chosen(options)
    result = measure(options)
    print_and_write(show(result), result, args.out)
    return 0


def options_from_args(args: argparse.Namespace) -> Options:
    """The command's flags as ``Options``, each count checked positive (``BenchError`` naming the flag)."""
    return Options(
        model=_model(args),
        target=args.target,
        groups=check_positive(args.groups, "--groups"),
        dtype=args.dtype,
        clients=check_positive(args.clients, "--clients"),
        requests_per_client=check_positive(args.requests_per_client, "--requests-per-client"),
        max_new_tokens=check_positive(args.max_new_tokens, "--max-new-tokens"),
        prompt_tokens=check_positive(args.prompt_tokens, "--prompt-tokens"),
        equal_prompts=args.equal_prompts,
        max_step_tokens=None
        if args.max_step_tokens is None
        else check_positive(args.max_step_tokens, "--max-step-tokens"),
        threads=tuple(parse_int_list(args.threads, "--threads")) if args.threads else (),
        seed=args.seed,
        ray_address=args.ray_address,
        classifier=args.classifier,
        repeats=check_positive(args.repeats, "--repeats"),
        groups_as=args.groups_as,
        device=args.device,
        sweep=tuple(parse_int_list(args.sweep, "--sweep")) if args.sweep else (),
        shapes=tuple(parse_shapes(args.shapes)) if args.shapes else (),
        shared_prefix=args.shared_prefix and check_positive(args.shared_prefix, "--shared-prefix"),
        guard=args.guard or "",
        guard_policies=tuple(p.strip() for p in args.guard_policies.split(",") if p.strip()),
        guard_threshold=args.guard_threshold,
        guard_recompute=args.guard_recompute,
        redundant=args.redundant,
        baselines=tuple(b.strip() for b in args.baseline.split(",") if b.strip()),
        price_per_hour=check_price(args.price_per_hour),
    )


def _chosen(options: Options) -> tuple[Callable[[Options], dict], Callable[[dict], str]]:
    """The run the options ask for and the table that prints its result."""
    if options.guard:
        from expertmesh.bench.guarded_serve import guarded_table, run_guarded

        return run_guarded, guarded_table
    if options.shared_prefix:
        from expertmesh.bench.shared_prefix import prefix_table, run_shared_prefix

        return run_shared_prefix, prefix_table
    from expertmesh.bench.serve.drivers import run, run_sweep
    from expertmesh.bench.serve.tables import sweep_table, table

    return (run_sweep, sweep_table) if options.sweep or options.shapes else (run, table)


def _model(args: argparse.Namespace) -> Path:
    """--model: a checkpoint folder or ``domain-moe`` (the trained domain model, trained on first use); unset,
    the embedded tiny model, or with --guard the domain model (its routing means something)."""
    from expertmesh.models.domain_moe import ALIAS, cached_checkpoint
    from expertmesh.models.embedded import default_checkpoint

    if str(args.model) == ALIAS or (args.model is None and args.guard):
        return cached_checkpoint()
    return args.model or default_checkpoint()
