"""``expertmesh bench serve``: streaming clients against ``expertmesh up``, next to
plain transformers ``generate`` on the same checkpoint.

Workload: ``--clients`` N threads, each with its own ``expertmesh.client.Client``,
each sending ``--requests-per-client`` R requests one after the other (greedy,
``stop_at_eos=False``, exactly ``--max-new-tokens`` M tokens each). Prompts are
seeded token ids of ``--prompt-tokens``/2 to ``--prompt-tokens`` tokens (all of
``--prompt-tokens`` with ``--equal-prompts``); request r
of client c uses prompt ``r * N + c``.

Runs
- *platform*: the N clients stream from ``expertmesh up`` — started in this
  process over a fresh data plane (``--groups`` expert groups on local Ray, or
  with ``--groups-as process`` in plain processes, no Ray: ``bench.platform``),
  or an already running one at ``--target`` (then ``--model`` must be its
  checkpoint). ``--device`` puts the router's model and the baseline's on a GPU.
- *transformers generate, one at a time*: the N × R prompts one after the other.
- *transformers generate, batched*: R calls, each with N prompts left-padded
  into one batch (greedy, with no end-of-sequence token: exactly M tokens, as
  the platform streams them with ``stop_at_eos=False``).
- with ``--classifier``, the query classifier's added time to first token: three
  more platform runs with the same clients, each request a *text* prompt (the
  classifier's eval split, queries of at most ``--prompt-tokens`` tokens, seeded
  order): ``exact``; ``prefer`` with ``alpha = 0`` and the query's domain given;
  the same without a domain, so the router classifies each request once before
  prefill. ``prefer`` needs a domain, and ``alpha = 0`` makes its bias 0
  (routing stays the stock gate's); it still needs a capability profile of the
  domain (else the request is refused), so the platform started here gets
  neutral ones (lift 1) for the classifier's domains, and a ``--target`` must hold
  profiles (``expertmesh profile build``) of every domain its classifier
  assigns. Classified minus domain-given is the classifier alone; classified
  minus exact adds the policy's plumbing (a zero bias per MoE layer, counting by
  domain). Beside them, the classifier's own time per call on the same texts in
  this process (as ``expertmesh classifier eval`` measures it).

Figures: tokens/s = generated tokens / wall time of the run; inter-token
latency (ITL) = time between consecutive streamed tokens of one request
(a streamed chunk's gap divided by the tokens it carries; for ``generate``, the
gaps between its streamer's calls, one per step); time to first token (TTFT)
from sending the request (or calling ``generate``) to its first token. One
untimed warm-up request precedes each run; then the in-process platform's prefix
cache is emptied (``Engine.reset_prefix_cache``), so no timed prompt is found
cached by the warm-up or by an earlier repeat or thread count. A ``--target``
keeps its cache: its later repeats find their prompts cached (serve it with
prefix caching off to compare them).

``--repeats`` K runs the platform and both ``generate`` baselines K times,
interleaved (platform, one at a time, batched, platform, ...), so a machine whose
speed drifts slows both sides alike; each row is the repeat of median tokens/s
(the lower middle one for even K), with every repeat's tokens/s beside it in the
JSON (``tokens_per_s_repeats``), and the ratios are of those medians.

``--sweep 1,8,16,32`` repeats the whole benchmark (a fresh platform each) at each
of those client counts, with the other options as given (issue 22's sweep:
``--prompt-tokens 480 --max-new-tokens 96 --requests-per-client 1``), and prints one
row per point: platform and batched ``generate`` tokens/s, their ratio, ITL p50 of
each, the mean step time per decode token of each (a decode step's wall time over the
sequences it advanced: the in-process engine's own step totals, ``serving.step_tally``, and
the batched ``generate`` streamer's calls after the first token), the KV pool's peak and
preemptions. ``--equal-prompts`` makes every prompt ``--prompt-tokens`` long, so the
sequences of a point are of equal length (issue 22's flat decode step per sequence).

``--shared-prefix P`` runs the prefix cache's benchmark instead (``bench.shared_prefix``).
"""

from __future__ import annotations

import argparse
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from expertmesh.bench.platform import add_platform_arguments, device_summary, started
from expertmesh.bench.report import (
    BenchError,
    check_positive,
    format_table,
    machine,
    model_summary,
    options_summary,
    parse_int_list,
    percentile,
    print_and_write,
    torch_threads,
)
from expertmesh.config.settings import add_guard_arguments
from expertmesh.infra.console import bar, progress

FIRST_TOKEN_ID = 3  # seeded prompts avoid the tiny models' pad/bos/eos ids (0, 1, 2)


@dataclass(frozen=True)
class Options:
    model: Path
    target: str | None = None
    groups: int = 2
    dtype: str = "float32"
    clients: int = 8
    requests_per_client: int = 2
    max_new_tokens: int = 32
    prompt_tokens: int = 32
    equal_prompts: bool = False  # every prompt exactly prompt_tokens long (else half to that, seeded)
    max_step_tokens: int | None = None  # the platform started here: its engine's step size (None: the default)
    threads: tuple[int, ...] = ()  # torch intra-op threads; several: each side at its best of them; (): torch's
    seed: int = 0
    ray_address: str | None = None
    classifier: bool = False  # also the classifier's added TTFT (text prompts; see the module's docstring)
    repeats: int = 1  # interleaved repeats of the platform and baseline runs; medians reported
    groups_as: str = "ray"  # "ray": Ray Serve deployments; "process": `expertmesh group serve` processes
    device: str = "auto"  # of the router's model and the baseline: auto, cpu, cuda, cuda:N
    sweep: tuple[int, ...] = ()  # client counts: the whole benchmark at each (see the module's docstring)
    shared_prefix: int = 0  # tokens of a prompt prefix all requests share: the prefix-cache run instead
    guard: str = ""  # a consistency-guard scorer: the guard's run at load instead (bench.guarded_serve)
    guard_policies: tuple[str, ...] = ("delta_gap", "restrict")
    guard_threshold: float | None = None  # None: the guard's default (0.65)
    guard_recompute: str = "widened"
    #: the platform started here: its experts placed by calibrated load with this many redundant replicas per
    #: layer before the timed runs (bench.planned_placement); None: the contiguous split
    redundant: int | None = None


_RUNNERS = {"ray": "groups on Ray Serve", "process": "groups as plain processes"}

#: What the classifier runs send: ``prefer`` with no bias at all, so only the classification differs.
NEUTRAL_POLICY = {"name": "prefer", "alpha": 0.0}


@dataclass
class _Request:
    """One request as its caller saw it: when it was sent, when each token arrived, and which."""

    sent: float
    prompt: int  # its prompt's index in the run's work
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that chunk)
    ids: list[int] = field(default_factory=list)  # the tokens, in order

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "serve", help="N streaming clients against `expertmesh up` vs transformers generate (one at a time, batched)"
    )
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
        help="the platform started here feeds at most this many tokens a step (`up --max-step-tokens`; default 512)",
    )
    p.add_argument(
        "--threads",
        help="torch intra-op threads in this process (the in-process platform's router and the baselines); several, "
        "comma-separated (e.g. 1,2): every run at each count, each row the best (default: torch's, = cores)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and the prompts")
    p.add_argument("--ray-address", help="join this Ray cluster when starting the platform here")
    p.add_argument(
        "--classifier",
        action="store_true",
        help="also measure the query classifier's added TTFT: text prompts with exact, prefer (alpha 0) with the "
        "domain given, and prefer (alpha 0) classified (default: off)",
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
        "--redundant",
        type=int,
        help="place the experts of the platform started here by their load before the timed runs: calibration "
        "prompts, the placement planner with this many redundant replicas per layer (0: none), live migrations "
        "(default: the contiguous split)",
    )
    add_guard_arguments(p)
    add_platform_arguments(p)
    p.add_argument("--out", default="bench-serve.json", help="JSON results (default bench-serve.json)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    options = Options(
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
        shared_prefix=args.shared_prefix and check_positive(args.shared_prefix, "--shared-prefix"),
        guard=args.guard or "",
        guard_policies=tuple(p.strip() for p in args.guard_policies.split(",") if p.strip()),
        guard_threshold=args.guard_threshold,
        guard_recompute=args.guard_recompute,
        redundant=args.redundant,
    )
    _check_modes(options)
    if options.guard:
        from expertmesh.bench.guarded_serve import guarded_table, run_guarded

        measure, show = run_guarded, guarded_table
    elif options.shared_prefix:
        from expertmesh.bench.shared_prefix import prefix_table, run_shared_prefix

        measure, show = run_shared_prefix, prefix_table
    elif options.sweep:
        measure, show = run_sweep, sweep_table
    else:
        measure, show = run, table
    result = measure(options)
    print_and_write(show(result), result, args.out)
    return 0


def _model(args: argparse.Namespace) -> Path:
    """--model: a checkpoint folder or ``domain-moe`` (the trained domain model, trained on first use); unset,
    the embedded tiny model, or with --guard the domain model (its routing means something)."""
    from expertmesh.models.domain_moe import ALIAS, cached_checkpoint
    from expertmesh.models.embedded import default_checkpoint

    if str(args.model) == ALIAS or (args.model is None and args.guard):
        return cached_checkpoint()
    return args.model or default_checkpoint()


def _check_modes(options: Options) -> None:
    """One kind of run per command, and the guard run's own limits."""
    modes = [f for f, on in (("--sweep", options.sweep), ("--shared-prefix", options.shared_prefix),
                             ("--guard", options.guard)) if on]  # fmt: skip
    if len(modes) > 1:
        raise BenchError(f"{' and '.join(modes)} are different runs; choose one")
    if len(options.threads) > 1 and (options.shared_prefix or options.guard):
        raise BenchError(f"--threads takes one count with {modes[0]}")
    if options.max_step_tokens:
        from expertmesh.config.settings import MAX_STEP_TOKENS

        if options.target:
            raise BenchError("--max-step-tokens sets the platform started here; a --target keeps its own step size")
        if options.max_step_tokens > MAX_STEP_TOKENS:
            raise BenchError(f"--max-step-tokens is at most {MAX_STEP_TOKENS}, got {options.max_step_tokens}")
    if options.redundant is not None:
        if options.target:
            raise BenchError("--redundant places the experts of the platform started here; drop --target")
        if options.shared_prefix or options.guard:
            raise BenchError(f"--redundant is for the throughput runs, not {modes[0]}")
        if options.redundant < 0:
            raise BenchError(f"--redundant is a count of replicas per layer, >= 0; got {options.redundant}")
    if not options.guard:
        return
    if options.target:
        raise BenchError("--guard starts its own platform (its profiles go into that platform's store); drop --target")
    if not options.guard_policies:
        raise BenchError("--guard-policies: name at least one routing policy, e.g. delta_gap")
    if "exact" in options.guard_policies:
        raise BenchError("--guard-policies: exact is the reference and is never guarded; name other policies")
    if options.guard_threshold is not None and not 0 <= options.guard_threshold <= 1:
        raise BenchError(f"--guard-threshold must be between 0 and 1, got {options.guard_threshold:g}")


def validate(options: Options):
    from expertmesh.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(options.model)
    spec = checkpoint.spec
    if options.redundant and options.redundant > spec.num_experts * (options.groups - 1):
        raise BenchError(
            f"--redundant {options.redundant}: {options.groups} groups hold at most "
            f"{spec.num_experts * (options.groups - 1)} redundant replicas of a layer's {spec.num_experts} experts"
        )
    context = spec.max_context
    if context and options.prompt_tokens + options.max_new_tokens > context:
        raise BenchError(
            f"--prompt-tokens {options.prompt_tokens} + --max-new-tokens {options.max_new_tokens} "
            f"is above the model's context of {context} tokens"
        )
    return checkpoint


def prompts(options: Options, vocab_size: int) -> list[list[int]]:
    """N x R seeded prompts of prompt_tokens/2 .. prompt_tokens token ids (all prompt_tokens with equal_prompts)."""
    import torch

    gen = torch.Generator().manual_seed(options.seed)
    shortest = options.prompt_tokens if options.equal_prompts else max(1, options.prompt_tokens // 2)
    out = []
    for _ in range(options.clients * options.requests_per_client):
        length = int(torch.randint(shortest, options.prompt_tokens + 1, (1,), generator=gen))
        out.append(torch.randint(FIRST_TOKEN_ID, vocab_size, (length,), generator=gen).tolist())
    return out


def text_prompts(options: Options, checkpoint) -> list[tuple[str, str, int]]:
    """N x R (query, domain, tokens) of the classifier's eval split with at most prompt_tokens tokens, in
    seeded order (repeated when fewer fit)."""
    import random

    from expertmesh.classifier.corpus import load_examples, shipped
    from expertmesh.platform.router_apis import load_tokenizer

    tokenizer = load_tokenizer(checkpoint.path)
    if tokenizer is None:
        raise BenchError(f"--classifier sends text prompts, and the checkpoint {checkpoint.path} has no tokenizer")
    examples = load_examples(shipped("eval"))
    lengths = [len(tokenizer(e.text)["input_ids"]) for e in examples]
    fit = [(e.text, e.domain, n) for e, n in zip(examples, lengths) if n <= options.prompt_tokens]
    if not fit:
        raise BenchError(
            f"--classifier: no query of the classifier's eval split fits --prompt-tokens {options.prompt_tokens} "
            f"(the shortest has {min(lengths)} tokens)"
        )
    random.Random(options.seed).shuffle(fit)
    return [fit[i % len(fit)] for i in range(options.clients * options.requests_per_client)]


def text_prompts_summary(queries: list[tuple[str, str, int]]) -> dict:
    """The JSON's account of ``text_prompts``' queries: where they come from, each one's domain and tokens."""
    return {
        "source": "the classifier's eval split",
        "domains": [d for _, d, _ in queries],
        "lengths": [n for _, _, n in queries],
    }


def run(options: Options) -> dict:
    from expertmesh.infra.devices import router_device

    checkpoint = validate(options)
    device = router_device(options.device, "--device")
    text = checkpoint.config.get_text_config()
    work = prompts(options, text.vocab_size)
    queries = text_prompts(options, checkpoint) if options.classifier else []

    kv = None  # the KV pool's use, known of the in-process platform only
    placed: dict = {}  # the planned placement's summary (--redundant)

    def place(plane, target: str) -> None:
        from expertmesh.bench.planned_placement import place_by_load

        placed.update(place_by_load(plane, options.redundant, lambda: _calibrate(target, options, text.vocab_size)))

    with torch_threads(options.threads[0] if options.threads else None) as threads:
        if options.target:
            _check_target(options.target, checkpoint, text)
            # the classifier runs first: a target without capability profiles fails them before the baselines load
            classified = _classifier_runs(options.target, options, queries)
            platform, baselines = _best_threads(
                options, lambda: _interleaved(options.target, checkpoint.path, options, work, text, device)
            )
        else:
            with served_here(
                options, checkpoint, device, ready=place if options.redundant is not None else None
            ) as server:
                target = f"127.0.0.1:{server.port}"
                classified = _classifier_runs(target, options, queries)
                fresh, steps = server.engine.reset_prefix_cache, server.engine.step_tally.totals
                platform, baselines = _best_threads(
                    options, lambda: _interleaved(target, checkpoint.path, options, work, text, device, fresh, steps)
                )
                kv = server.engine.kv_usage()

    runs = [platform, *baselines]
    result = {
        "benchmark": "serve",
        "model": model_summary(checkpoint),
        "setup": {
            **options_summary(options),
            "threads": list(options.threads) if len(options.threads) > 1 else threads,
            "platform": options.target
            or f"in-process expertmesh up (local data plane, {_RUNNERS[options.groups_as]}, gRPC on loopback)",
            **device_summary(device),
            "prompt_lengths": [len(p) for p in work],
            "machine": machine(),
        },
        "runs": runs,
        "platform_vs": {r["name"]: platform["tokens_per_s"] / r["tokens_per_s"] for r in baselines},
        "agreement": same_tokens(platform, baselines[0]),  # the baseline of each prompt alone
    }
    if options.classifier:
        result["classifier"] = _classifier_summary(classified, queries)
    if kv is not None:
        result["kv"] = _kv_summary(kv)
    if placed:
        result["placement"] = placed
    return result


#: prompts of the run's shape that ``--redundant``'s calibration sends, and tokens each generates
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 8, 8


def _calibrate(target: str, options: Options, vocab_size: int) -> None:
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
            _neutral_profiles(plane)
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


def _kv_summary(kv) -> dict:
    """The in-process platform's KV pool over all its runs (``Engine.kv_usage``)."""
    return {
        "blocks_total": kv.blocks_total,
        "block_size": kv.block_size,
        "blocks_used_peak": kv.blocks_used_peak,
        "usage_peak": kv.blocks_used_peak / kv.blocks_total,
        "preemptions": kv.preemptions,
        "prefix_cache_queries": kv.prefix_queries,
        "prefix_cache_hits": kv.prefix_hits,
    }


def run_sweep(options: Options) -> dict:
    """The benchmark at each of ``options.sweep`` client counts; one summary row per point."""
    import dataclasses

    points = []
    for clients in options.sweep:
        result = run(dataclasses.replace(options, clients=clients, sweep=()))
        platform, batched = result["runs"][0], result["runs"][-1]
        kv = result.get("kv", {})
        points.append(
            {
                "clients": clients,
                "platform_tokens_per_s": platform["tokens_per_s"],
                "generate_batched_tokens_per_s": batched["tokens_per_s"],
                "ratio_to_batched": platform["tokens_per_s"] / batched["tokens_per_s"],
                "itl_p50_ms": {"platform": platform["itl_ms"]["p50"], "generate_batched": batched["itl_ms"]["p50"]},
                "decode_ms_per_token": {
                    "platform": platform.get("decode_steps", {}).get("ms_per_token"),
                    "generate_batched": batched["decode_steps"]["ms_per_token"],
                },
                "threads": {"platform": platform.get("threads"), "generate_batched": batched.get("threads")},
                "kv_usage_peak": kv.get("usage_peak"),
                "preemptions": kv.get("preemptions"),
                "same_answers": result["agreement"]["passed"],
                "result": result,
            }
        )
    return {"benchmark": "serve-sweep", "model": points[0]["result"]["model"], "points": points}


def sweep_table(result: dict) -> str:
    setup = result["points"][0]["result"]["setup"]
    best_of = isinstance(setup["threads"], list)
    rows = [
        [
            p["clients"],
            p["platform_tokens_per_s"],
            p["generate_batched_tokens_per_s"],
            p["ratio_to_batched"],
            p["itl_p50_ms"]["platform"],
            p["itl_p50_ms"]["generate_batched"],
            p["decode_ms_per_token"]["platform"],
            p["decode_ms_per_token"]["generate_batched"],
            None if p["kv_usage_peak"] is None else 100 * p["kv_usage_peak"],
            p["preemptions"],
            "PASS" if p["same_answers"] else "FAIL",
            *((p["threads"]["platform"], p["threads"]["generate_batched"]) if best_of else ()),
        ]
        for p in result["points"]
    ]
    title = (
        f"bench serve --sweep: {result['model']['model_type']} {Path(result['model']['path']).name}, {setup['dtype']}; "
        f"{setup['max_new_tokens']} new tokens, prompts {_prompts_note(setup)}, "
        f"{setup['requests_per_client']} request(s) per client; {_threads_note(setup['threads'])}"
    )
    body = format_table(
        [
            "clients",
            "platform tok/s",
            "generate batched tok/s",
            "ratio",
            "ITL p50 ms",
            "generate ITL p50 ms",
            "decode ms/token",
            "generate decode ms/token",
            "KV peak %",
            "preemptions",
            "same answers",
            *(("platform threads", "generate threads") if best_of else ()),
        ],
        rows,
        ["d", ".1f", ".1f", ".2f", ".1f", ".1f", ".2f", ".2f", ".1f", "d", "", *(("d", "d") if best_of else ())],
    )
    placed = [(p["clients"], p["result"]["placement"]) for p in result["points"] if "placement" in p["result"]]
    if placed:
        from expertmesh.bench.planned_placement import placement_line

        body += "".join(f"\n{clients} clients: {placement_line(placement)}" for clients, placement in placed)
    return f"{title}\n{body}"


def _prompts_note(setup: dict) -> str:
    tokens = setup["prompt_tokens"]
    return f"of {tokens} tokens each" if setup.get("equal_prompts") else f"up to {tokens} tokens"


def _threads_note(threads) -> str:
    """The title's word on torch threads: a count, or the counts each run took its best of."""
    if isinstance(threads, list):
        return f"each run at its best of {', '.join(map(str, threads))} torch threads"
    return f"{threads} torch threads"


def _interleaved(
    target: str,
    path: Path,
    options: Options,
    work: list,
    text,
    device,
    fresh: Callable[[], object] | None = None,
    steps: Callable[[], dict] | None = None,
) -> tuple[dict, list[dict]]:
    """The platform run and the baseline runs, ``options.repeats`` times in turn; the median of each. ``fresh``
    empties the platform's prefix cache before each platform run's timed requests; ``steps`` reads its engine's
    step totals (see ``_platform_run``)."""
    baseline = _baselines(path, options, text, device)
    repeats = [
        (_platform_run(target, options, work, fresh=fresh, steps=steps), *baseline(work))
        for _ in range(options.repeats)
    ]
    platform, *baselines = (_median_run(list(runs)) for runs in zip(*repeats))
    return platform, baselines


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
    best = []
    for same_run in zip(*by_count.values()):  # the platform, then each baseline
        runs = dict(zip(by_count, same_run))
        count = max(runs, key=lambda c: runs[c]["tokens_per_s"])
        best.append(
            {
                **runs[count],
                "threads": count,
                "tokens_per_s_by_threads": {c: r["tokens_per_s"] for c, r in runs.items()},
            }
        )
    return best[0], best[1:]


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count), with every run's tokens/s."""
    median = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    return {**median, "tokens_per_s_repeats": [r["tokens_per_s"] for r in runs]}


# -- the platform -------------------------------------------------------------------------


def _check_target(target: str, checkpoint, text) -> None:
    import grpc

    from expertmesh.client import Client

    try:
        with Client(target, timeout=10) as client:
            models = client.models()
    except grpc.RpcError as err:
        raise BenchError(f"cannot reach `expertmesh up` at {target}: {err.code().name}: {err.details()}") from None
    spec = checkpoint.spec
    mine = (spec.num_layers, spec.hidden_size, spec.num_experts, text.vocab_size)
    if not any((m.num_layers, m.hidden_size, m.num_experts, m.vocab_size) == mine for m in models):
        served = ", ".join(f"{m.name} ({m.architecture}, hidden {m.hidden_size})" for m in models) or "nothing"
        raise BenchError(
            f"{target} serves {served}, not the checkpoint {checkpoint.path}; pass --model with the served checkpoint"
        )


def _platform_run(
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
    in-process engine's step totals (``StepTally.totals``): the run's decode steps are reported from them."""
    import grpc

    from expertmesh.client import Client

    n, m = options.clients, options.max_new_tokens
    name = name or f"platform: {n} streaming clients"
    extras = extras or [{}] * len(work)
    progress(f"bench serve: {name}, {options.requests_per_client} requests of {m} tokens each at {target}")
    try:
        with Client(target, timeout=600) as client:  # warm-up
            list(client.generate(work[0], max_new_tokens=2, stop_at_eos=False, **extras[0]))
    except grpc.RpcError as err:
        raise BenchError(f"a request to {target} failed: {err.code().name}: {err.details()}") from None
    if fresh is not None:
        fresh()
    before = steps() if steps is not None else None

    records: list[list[_Request]] = [[] for _ in range(n)]
    errors: list[str] = []
    barrier = threading.Barrier(n)

    def one_client(c: int) -> None:
        try:
            with Client(target, timeout=600) as client:
                barrier.wait()
                for r in range(options.requests_per_client):
                    i = r * n + c
                    request = _Request(time.perf_counter(), i)
                    records[c].append(request)
                    for chunk in client.generate(work[i], max_new_tokens=m, stop_at_eos=False, **extras[i]):
                        if chunk.token_ids:
                            request.arrivals.append((time.perf_counter(), len(chunk.token_ids)))
                            request.ids.extend(chunk.token_ids)
                    done.update()
        except grpc.RpcError as err:
            errors.append(f"{err.code().name}: {err.details()}")
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=one_client, args=(c,), name=f"bench-client-{c}") for c in range(n)]
    with bar(n * options.requests_per_client, "bench serve: requests", unit="request") as done:  # on a terminal
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise BenchError(f"a streaming request to {target} failed: {errors[0]}")
    summary = _summary(name, n, [r for rs in records for r in rs])
    if before is not None:
        from expertmesh.serving.step_tally import StepKind

        after = steps()
        run = {kind: after[kind].since(before[kind]) for kind in StepKind}
        decode = run[StepKind.DECODE]
        summary["decode_steps"] = _decode_steps(decode.steps, decode.tokens, decode.seconds)
        summary["engine_steps"] = {
            kind.value: {"steps": t.steps, "tokens": t.tokens, "seconds": t.seconds} for kind, t in run.items()
        }
    return summary


# -- the query classifier's added time to first token ---------------------------------------------


def _neutral_profiles(plane) -> None:
    """Capability profiles of lift 1 for every domain the default classifier assigns, in the plane's
    store: what ``prefer`` needs to serve, with a bias of 0 whatever its alpha."""
    import numpy as np

    from expertmesh.classifier import default_classifier
    from expertmesh.router.policy.profiles import build_profiles, save_profiles

    spec = plane.checkpoint.spec
    even = np.ones((len(spec.moe_layers), spec.num_experts))  # [L, E]: every expert chosen alike
    domains = {d.split("/")[0] for d in default_classifier().domains}  # trains it here if it is not cached yet
    save_profiles(plane.store, build_profiles({d: even for d in domains}, tuple(spec.moe_layers)))


def _classifier_runs(target: str, options: Options, queries: list[tuple[str, str, int]]) -> list[dict]:
    """The three text-prompt runs: exact; prefer (alpha 0) with the domain given; prefer (alpha 0) classified."""
    if not options.classifier:
        return []
    from expertmesh.v1 import inference_pb2 as pb

    texts = [t for t, _, _ in queries]
    neutral = pb.RoutingPolicy(**NEUTRAL_POLICY)
    n = options.clients
    return [
        _platform_run(target, options, texts, f"text, exact: {n} clients", [{"routing_policy": "exact"}] * len(texts)),
        _platform_run(
            target,
            options,
            texts,
            f"text, prefer alpha=0, domain given: {n} clients",
            [{"routing_policy": neutral, "domain": d} for _, d, _ in queries],
        ),
        _platform_run(
            target,
            options,
            texts,
            f"text, prefer alpha=0, classified: {n} clients",
            [{"routing_policy": neutral}] * len(texts),
        ),
    ]


def _classifier_summary(runs: list[dict], queries: list[tuple[str, str, int]]) -> dict:
    from expertmesh.classifier import default_classifier

    exact, given, classified = runs

    def added(than: dict) -> dict:
        return {q: classified["ttft_ms"][q] - than["ttft_ms"][q] for q in ("p50", "p99")}

    classifier = default_classifier()
    calls = [1e3 * classifier.classify(text).seconds for text, _, _ in queries]
    return {
        "policy": "prefer(alpha=0)",
        "prompts": text_prompts_summary(queries),
        "runs": runs,
        "added_ttft_ms": added(given),  # the classifier alone
        "added_ttft_ms_vs_exact": added(exact),  # and the policy's plumbing
        "classify_ms": {"p50": percentile(calls, 50), "p99": percentile(calls, 99), "calls": len(calls)},
    }


# -- plain transformers ---------------------------------------------------------------------


class _Clock:
    """A transformers streamer that only notes when generate hands it tokens (the prompt first, then each step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _baselines(path: Path, options: Options, text, device) -> Callable[[list[list[int]]], list[dict]]:
    """Stock transformers loaded once, on ``device``; the returned function runs both ``generate`` baselines
    over ``work``."""
    import torch
    from transformers import AutoModelForCausalLM

    progress(f"bench serve: loading stock transformers ({options.dtype}, on {device})")
    model = (
        AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="eager", dtype=getattr(torch, options.dtype), local_files_only=True
        )
        .eval()
        .to(device)
    )
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    m, n = options.max_new_tokens, options.clients

    def generate(batch: list[list[int]], new_tokens: int, first: int = 0, decode: list | None = None) -> list[_Request]:
        """``batch`` = prompts ``first``, ``first`` + 1, ... of the work, in one ``generate``. ``decode``, when
        given, gets (steps, tokens, seconds) of its decode steps: each streamer call after the first token's."""
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)  # [B, width]
        clock = _Clock()
        sent = time.perf_counter()
        with torch.no_grad():
            # No end-of-sequence token (rather than min_new_tokens, which forbids it): exactly new_tokens
            # tokens, each the argmax, as the platform streams them with stop_at_eos=False.
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                do_sample=False,
                pad_token_id=pad,
                streamer=clock,
            )  # [B, width + new_tokens]
        steps = clock.times[1:]  # the first call hands over the prompt
        if decode is not None and len(steps) > 1:
            decode.append((len(steps) - 1, (len(steps) - 1) * len(batch), steps[-1] - steps[0]))
        new = out[:, width:].tolist()
        return [_Request(sent, first + j, [(t, 1) for t in steps], new[j]) for j in range(len(batch))]

    def runs(work: list[list[int]]) -> list[dict]:
        progress(f"bench serve: transformers generate, {len(work)} requests one at a time")
        generate(work[:1], 2)  # warm-up
        sequential = [r for i, p in enumerate(work) for r in generate([p], m, i)]
        progress(f"bench serve: transformers generate, {options.requests_per_client} batches of {n}")
        generate(work[:n], 2)  # warm-up
        decode: list[tuple[int, int, float]] = []
        batched = [
            r for b in range(options.requests_per_client) for r in generate(work[b * n : (b + 1) * n], m, b * n, decode)
        ]
        return [
            _summary("transformers generate, one at a time", 1, sequential),
            {
                **_summary(f"transformers generate, batched x{n}", n, batched),
                "decode_steps": _decode_steps(*(sum(column) for column in zip(*decode)) if decode else (0, 0, 0.0)),
            },
        ]

    return runs


# -- figures ----------------------------------------------------------------------------------


def _decode_steps(steps: int, tokens: int, seconds: float) -> dict:
    """A run's decode steps (every sequence feeding its newest token): how many, and their mean time per
    token (a step's wall time over the sequences it advanced)."""
    return {"steps": steps, "tokens": tokens, "ms_per_token": 1e3 * seconds / tokens if tokens else None}


def _summary(name: str, concurrency: int, requests: list[_Request]) -> dict:
    itl, ttft = [], []
    for r in requests:
        if r.arrivals:
            ttft.append(r.arrivals[0][0] - r.sent)
        for (before, _), (after, k) in zip(r.arrivals, r.arrivals[1:]):
            itl.append((after - before) / k)
    tokens = sum(r.tokens for r in requests)
    wall = max(t for r in requests for t, _ in r.arrivals) - min(r.sent for r in requests)

    def ms(values, q):
        return 1e3 * percentile(values, q)

    return {
        "name": name,
        "concurrency": concurrency,
        "requests": len(requests),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "itl_ms": {"p50": ms(itl, 50), "p99": ms(itl, 99), "mean": 1e3 * sum(itl) / len(itl) if itl else None},
        "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
        "token_ids": [r.ids for r in sorted(requests, key=lambda r: r.prompt)],  # by prompt
    }


def same_tokens(platform: dict, reference: dict) -> dict:
    """Whether the platform's run streamed, for every prompt, the tokens ``reference`` (transformers
    ``generate`` of that prompt alone, greedy) generated; a speed figure of other answers means nothing."""
    differ = [i for i, (a, b) in enumerate(zip(platform["token_ids"], reference["token_ids"])) if a != b]
    return {
        "requests": len(reference["token_ids"]),
        "differ": differ,
        "passed": not differ and len(platform["token_ids"]) == len(reference["token_ids"]),
    }


def _agreement_line(agreement: dict) -> str:
    n, differ = agreement["requests"], agreement["differ"]
    if agreement["passed"]:
        return (
            f"same answers: PASS: each of the {n} requests streamed the tokens transformers generate "
            "gives its prompt alone"
        )
    return (
        f"same answers: FAIL: {len(differ)} of {n} requests streamed other tokens than generate alone "
        f"(prompts {differ[:10]})"
    )


def table(result: dict) -> str:
    model, setup = result["model"], result["setup"]
    rows = [
        [
            r["name"] + (f" ({r['threads']} threads)" if "threads" in r else ""),
            r["requests"],
            r["concurrency"],
            r["tokens"],
            r["seconds"],
            r["tokens_per_s"],
            r["itl_ms"]["p50"],
            r["itl_ms"]["p99"],
            r["ttft_ms"]["p50"],
            r["ttft_ms"]["p99"],
        ]
        for r in [*result["runs"], *result.get("classifier", {}).get("runs", [])]
    ]
    title = (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x {model['num_experts']} "
        f"experts, hidden {model['hidden_size']}, {setup['dtype']}; {setup['max_new_tokens']} new tokens per request, "
        f"prompts {min(setup['prompt_lengths'])}-{max(setup['prompt_lengths'])} tokens; "
        f"{_threads_note(setup['threads'])}; {setup['machine']['cpus']} CPUs"
        + (f"; on {setup['gpu']}" if "gpu" in setup else "")
        + (f"; median of {setup['repeats']} interleaved repeats" if setup["repeats"] > 1 else "")
    )
    body = format_table(
        [
            "run",
            "requests",
            "concurrent",
            "tokens",
            "seconds",
            "tok/s",
            "ITL p50 ms",
            "ITL p99 ms",
            "TTFT p50 ms",
            "TTFT p99 ms",
        ],
        rows,
        ["", "d", "d", "d", ".2f", ".1f", ".2f", ".2f", ".1f", ".1f"],
    )
    ratios = "; ".join(f"{v:.2f}x {k}" for k, v in result["platform_vs"].items())
    text = f"{title}\n{body}\nplatform tok/s = {ratios}\n{_agreement_line(result['agreement'])}"
    decode = [(r["name"], r["decode_steps"]) for r in result["runs"] if r.get("decode_steps", {}).get("steps")]
    if decode:
        text += "\ndecode steps (every sequence feeding its newest token), wall time per token: " + "; ".join(
            f"{name} {d['ms_per_token']:.2f} ms ({d['steps']} steps)" for name, d in decode
        )
    if "placement" in result:
        from expertmesh.bench.planned_placement import placement_line

        text += "\n" + placement_line(result["placement"])
    if "kv" in result:
        kv = result["kv"]
        text += (
            f"\nKV pool: peak {kv['blocks_used_peak']} of {kv['blocks_total']} blocks of {kv['block_size']} tokens "
            f"({kv['usage_peak']:.1%}); {kv['preemptions']} preemptions; prefix cache hits {kv['prefix_cache_hits']} "
            f"of {kv['prefix_cache_queries']} prompt tokens"
        )
    if "classifier" in result:
        c = result["classifier"]
        alone, vs_exact, calls = c["added_ttft_ms"], c["added_ttft_ms_vs_exact"], c["classify_ms"]
        text += (
            f"\nquery classifier's added TTFT (prefer alpha=0, classified - domain given): p50 {alone['p50']:+.1f} ms, "
            f"p99 {alone['p99']:+.1f} ms; classified - exact: p50 {vs_exact['p50']:+.1f} ms, "
            f"p99 {vs_exact['p99']:+.1f} ms; "
            f"one classify call here: p50 {calls['p50']:.2f} ms, p99 {calls['p99']:.2f} ms"
        )
    return text
