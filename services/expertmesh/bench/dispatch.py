"""``expertmesh bench dispatch``: the platform against stock transformers on one checkpoint.

In one run, on the same checkpoint, dtype, inputs and intra-op thread count:

* *monolithic*: ``AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")``,
  every expert computed in this process;
* *platform*: the router's model, whose routed experts go to N expert groups
  on Ray Serve or, with ``--groups-as process``, in plain processes (no Ray, no
  Redis: ``bench.platform``). ``--transport`` chooses how the router reaches them
  (``auto``: shared memory on this host; ``grpc``: gRPC streams; ``grpc-unary``:
  one unary call per layer per group, the path before streams). ``--device``
  puts the monolithic model and the router's model on a GPU (``auto``: the first
  one there is); the groups then compute on the GPU too.

Phases
- *prefill*: one forward of ``--prefill-tokens`` tokens (batch 1, fresh cache).
- *decode at batch B*: B sequences of a short prompt are prefilled once (not
  timed), one warm-up step, then ``--decode-steps`` single-token forward steps
  with the cache (``DynamicCache``) are timed; the step time is their mean.

Each phase runs once untimed on each side (warm-up), then ``--repeats`` times,
alternating monolithic and platform; the figure is the median over repeats. On a
GPU each timed run ends with a device synchronisation.
Input tokens are seeded and identical on both sides, so both route the same.

Derived figures (per phase)
- *ratio* = platform seconds / monolithic seconds (> 1: the platform is slower).
- *added ms per MoE layer* = (platform step − monolithic step) / MoE layers.
- *dispatch ms per layer*: wall time inside the router's dispatch of one layer
  (encode, RPCs to all groups concurrently, decode, sum), from the traffic counters
  (median over the timed runs, like the step times).
- *bytes per token per layer*: (request + response bytes) / tokens routed,
  summed over the MoE layers of the timed steps; the *minimum* is
  hidden_size × dtype bytes × 2 (hidden state out, partial sum back) × groups
  touched per token (token–group pairs / tokens). Request bytes are the tensors'
  (hidden rows, expert ids, weights), whatever the transport adds around them.

Memory: the resident set of this process before the models load (*baseline*:
Python, torch, transformers), and its growth while the monolithic model and
then the router load, each reported as baseline + growth (both models live in
this one process, so their own peaks cannot be told apart); each group reports
its own process's peak (Describe's ``peak_rss_bytes``) at the end of the run.

``--tracing``: after the run above (tracing off: no SDK installed), the platform
is started again with OpenTelemetry on in the router and in every expert group,
exporting over OTLP/gRPC to a loopback receiver (``telemetry.sink``), and the
phases are measured again; the report puts platform step times with tracing
off and on side by side.
"""

from __future__ import annotations

import argparse
import math
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from expertmesh.bench.platform import add_platform_arguments, device_summary, started
from expertmesh.bench.report import (
    BenchError,
    check_positive,
    format_table,
    machine,
    median,
    model_summary,
    options_summary,
    parse_int_list,
    print_and_write,
    resident_bytes,
    torch_threads,
)
from expertmesh.config.settings import TransportName
from expertmesh.infra.console import bar, progress

DECODE_PROMPT_TOKENS = 8  # prompt of each sequence before the timed decode steps
WARMUP_STEPS = 1  # untimed decode steps after the prompt, before the timed ones
FIRST_TOKEN_ID = 3  # seeded inputs avoid the tiny models' pad/bos/eos ids (0, 1, 2)


@dataclass(frozen=True)
class Options:
    model: Path
    groups: int = 2
    dtype: str = "float32"
    repeats: int = 5
    prefill_tokens: int = 512
    batches: tuple[int, ...] = (1, 8, 32)
    decode_steps: int = 16
    threads: int | None = None  # None: torch's current intra-op thread count
    seed: int = 0
    ray_address: str | None = None
    tracing: bool = False  # also measure with OpenTelemetry tracing on
    transport: TransportName = "auto"
    groups_as: str = "ray"  # "ray": Ray Serve deployments; "process": `expertmesh group serve` processes
    device: str = "auto"  # of the monolithic and the router's model: auto, cpu, cuda, cuda:N


def add_command(bench_commands) -> None:
    p = bench_commands.add_parser(
        "dispatch", help="prefill and decode latency: stock transformers vs the platform (experts over gRPC)"
    )
    p.add_argument("--model", type=Path, help="local checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--groups", type=int, default=2, help="expert groups of the contiguous split (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of both sides")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the prefill phase (default 512)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated (default 1,8,32)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per repeat (default 16)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per phase and side; median reported (default 5)"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads for both sides (default: torch's, = cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and the inputs")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument(
        "--tracing", action="store_true", help="measure again with OpenTelemetry tracing on (OTLP to loopback)"
    )
    p.add_argument(
        "--transport",
        choices=typing.get_args(TransportName),
        default="auto",
        help="router to groups: auto (shared memory on this host, else gRPC streams), grpc (streams only), "
        "grpc-unary (default auto)",
    )
    add_platform_arguments(p)
    p.add_argument("--out", default="bench-dispatch.json", help="JSON results (default bench-dispatch.json)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    from expertmesh.models.embedded import default_checkpoint

    options = Options(
        model=args.model or default_checkpoint(),
        groups=check_positive(args.groups, "--groups"),
        dtype=args.dtype,
        repeats=check_positive(args.repeats, "--repeats"),
        prefill_tokens=check_positive(args.prefill_tokens, "--prefill-tokens"),
        batches=tuple(parse_int_list(args.batches, "--batches")),
        decode_steps=check_positive(args.decode_steps, "--decode-steps"),
        threads=None if args.threads is None else check_positive(args.threads, "--threads"),
        seed=args.seed,
        ray_address=args.ray_address,
        tracing=args.tracing,
        transport=args.transport,
        groups_as=args.groups_as,
        device=args.device,
    )
    result = run(options)
    print_and_write(table(result), result, args.out)
    return 0


# -- measuring --------------------------------------------------------------------------


class _WireMeter:
    """Sums the router's traffic counters over the timed parts only (snapshot diffs, nothing reset)."""

    COUNTERS = ("calls", "tokens", "group_calls", "token_group_pairs", "bytes_sent", "bytes_received", "seconds")

    def __init__(self, traffic) -> None:
        self._traffic = traffic
        self._before: dict | None = None
        self.totals = dict.fromkeys(self.COUNTERS, 0)
        self.ms_per_layer: list[float] = []  # per timed run: seconds inside dispatch / experts calls

    def _sums(self) -> dict:
        snap = self._traffic.snapshot()
        return {name: sum(getattr(t, name) for t in snap.values()) for name in self.COUNTERS}

    def begin(self) -> None:
        self._before = self._sums()

    def end(self) -> None:
        after = self._sums()
        diff = {name: after[name] - self._before[name] for name in self.COUNTERS}
        for name in self.COUNTERS:
            self.totals[name] += diff[name]
        if diff["calls"]:
            self.ms_per_layer.append(1e3 * diff["seconds"] / diff["calls"])


class _NoMeter:
    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


def _finished(model) -> None:
    """Wait for the model's queued GPU work (a CUDA call returns before its kernels ran)."""
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _prefill_seconds(model, ids, meter) -> float:
    """ids [1, P]: one forward with a fresh cache."""
    _finished(model)
    meter.begin()
    start = time.perf_counter()
    model(input_ids=ids, use_cache=True)
    _finished(model)
    seconds = time.perf_counter() - start
    meter.end()
    return seconds


def _decode_seconds(model, prompt, steps, meter) -> float:
    """prompt [B, DECODE_PROMPT_TOKENS], steps [B, WARMUP_STEPS + n]: mean seconds of the n timed steps."""
    cache = model(input_ids=prompt, use_cache=True).cache
    for i in range(WARMUP_STEPS):
        cache = model(input_ids=steps[:, i : i + 1], cache=cache, use_cache=True).cache
    n = steps.shape[1] - WARMUP_STEPS
    _finished(model)
    meter.begin()
    start = time.perf_counter()
    for i in range(WARMUP_STEPS, steps.shape[1]):
        cache = model(input_ids=steps[:, i : i + 1], cache=cache, use_cache=True).cache
    _finished(model)
    seconds = (time.perf_counter() - start) / n
    meter.end()
    return seconds


def _measure(run_once: Callable[[object, object], float], mono, platform, meter, repeats: int) -> tuple[list, list]:
    """One untimed run on each side, then ``repeats`` alternating timed runs."""
    run_once(mono, _NoMeter())
    run_once(platform, _NoMeter())
    mono_s, plat_s = [], []
    with bar(repeats, "bench dispatch: timed repeats", unit="repeat") as done:  # on a terminal
        for _ in range(repeats):
            mono_s.append(run_once(mono, _NoMeter()))
            plat_s.append(run_once(platform, meter))
            done.update()
    return mono_s, plat_s


def _side(samples: list[float], tokens_per_step: int) -> dict:
    seconds = median(samples)
    return {"seconds": seconds, "tokens_per_s": tokens_per_step / seconds, "samples": samples}


def _wire(meter: _WireMeter, hidden_size: int, dtype_bytes: int) -> dict:
    totals = meter.totals
    tokens = totals["tokens"]
    calls = totals["calls"]
    wire_bytes = totals["bytes_sent"] + totals["bytes_received"]
    groups_touched = totals["token_group_pairs"] / tokens if tokens else math.nan
    per_token = wire_bytes / tokens if tokens else math.nan
    minimum = hidden_size * dtype_bytes * 2 * groups_touched
    return {
        **totals,
        "bytes_per_token_per_layer": per_token,
        "groups_touched_per_token": groups_touched,
        "groups_per_layer_call": totals["group_calls"] / calls if calls else math.nan,
        "min_bytes_per_token_per_layer": minimum,
        "overhead_vs_min": per_token / minimum if minimum else math.nan,
        "dispatch_ms_per_layer": median(meter.ms_per_layer),  # median over the timed runs, like the step times
        "dispatch_ms_per_layer_samples": meter.ms_per_layer,
    }


def _phase(name, batch, tokens_per_step, mono_s, plat_s, meter, moe_layers, hidden_size, dtype_bytes) -> dict:
    mono, plat = _side(mono_s, tokens_per_step), _side(plat_s, tokens_per_step)
    return {
        "name": name,
        "batch": batch,
        "tokens_per_step": tokens_per_step,
        "monolithic": mono,
        "platform": plat,
        "ratio": plat["seconds"] / mono["seconds"],
        "added_ms_per_moe_layer": 1e3 * (plat["seconds"] - mono["seconds"]) / moe_layers,
        "wire": _wire(meter, hidden_size, dtype_bytes),
    }


def validate(options: Options):
    """Check the inputs against the checkpoint before starting anything; returns the Checkpoint."""
    from expertmesh.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(options.model)
    context = checkpoint.spec.max_context
    if context and options.prefill_tokens > context:
        raise BenchError(f"--prefill-tokens {options.prefill_tokens} is above the model's context of {context} tokens")
    decode_len = DECODE_PROMPT_TOKENS + WARMUP_STEPS + options.decode_steps
    if context and decode_len > context:
        raise BenchError(
            f"--decode-steps {options.decode_steps} needs {decode_len} positions, "
            f"above the model's context of {context}"
        )
    return checkpoint


def run(options: Options) -> dict:
    """Run every phase on both sides; returns the JSON-ready results."""
    import torch
    from transformers import AutoModelForCausalLM

    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.infra.devices import router_device
    from expertmesh.models.checkpoint import experts_modules

    checkpoint = validate(options)
    device = router_device(options.device, "--device")
    spec = checkpoint.spec
    text = checkpoint.config.get_text_config()
    dtype = getattr(torch, options.dtype)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    moe_layers = len(spec.moe_layers)

    with torch_threads(options.threads) as threads:
        baseline = resident_bytes()
        progress(f"bench dispatch: loading stock transformers ({spec.model_type}, {options.dtype}, on {device})")
        mono = (
            AutoModelForCausalLM.from_pretrained(
                checkpoint.path, experts_implementation="eager", dtype=dtype, local_files_only=True
            )
            .eval()
            .to(device)
        )
        memory = {
            "baseline_bytes": baseline,
            "monolithic_bytes": resident_bytes(),
            "routed_expert_bytes": sum(
                p.numel() * p.element_size() for _, m in experts_modules(mono).values() for p in m.parameters()
            ),
        }
        config = DataPlaneConfig(
            model=checkpoint.path,
            groups=options.groups,
            dtype=options.dtype,
            ray_address=options.ray_address,
            transport=options.transport,
            router_device=str(device),
        )

        def measure() -> dict:
            before = resident_bytes()
            with started(config, options.groups_as, "dispatch") as plane:
                router_bytes = baseline + resident_bytes() - before
                phases, agreement = _run_phases(
                    options, mono, plane, text.vocab_size, moe_layers, spec.hidden_size, dtype_bytes
                )
                return {
                    "phases": phases,
                    "agreement": agreement,
                    "groups": len(plane.placement.groups),
                    "transports": plane.dispatcher.transports(),
                    "router_bytes": router_bytes,
                    "groups_peak_bytes": _groups_peak_bytes(plane.addresses),
                }

        measured = measure()
        traced = _measure_traced(measure) if options.tracing else None
        memory.update(
            router_bytes=measured["router_bytes"],
            groups_peak_bytes=measured["groups_peak_bytes"],
            bench_process_peak_bytes=resident_bytes("VmHWM"),
        )

    return {
        "benchmark": "dispatch",
        "model": {
            **model_summary(checkpoint),
            "max_position_embeddings": spec.max_context,
            "parameters": sum(p.numel() for p in mono.parameters()),
        },
        "setup": {
            **options_summary(options),
            "threads": threads,
            "groups": measured["groups"],
            "transports": measured["transports"],
            "dtype_bytes": dtype_bytes,
            "warmup": "1 untimed run per phase and side; 1 untimed decode step per repeat",
            "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
            "machine": machine(),
            **device_summary(device),
        },
        "phases": measured["phases"],
        "agreement": measured["agreement"],
        "memory": memory,
        **({"tracing_on": traced} if traced is not None else {}),
    }


def _groups_peak_bytes(addresses: dict[str, str]) -> dict[str, int]:
    """Each group's peak resident memory, as its Describe reports it."""
    from expertmesh.infra.group_channels import GroupClients
    from expertmesh.v1 import experts_pb2 as pb

    clients = GroupClients()
    clients.update(addresses)
    try:
        return {g: clients.stub(g).Describe(pb.DescribeRequest(), timeout=30).peak_rss_bytes for g in sorted(addresses)}
    finally:
        clients.close()


def _measure_traced(measure: Callable[[], dict]) -> dict:
    """The same phases with tracing on in router and groups, exporting to a loopback OTLP receiver."""
    import os

    from expertmesh.infra.telemetry import setup as setup_telemetry
    from expertmesh.infra.telemetry.sink import OtlpSink

    sink = OtlpSink().start()
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE")}
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    telemetry = setup_telemetry("expertmesh-bench")
    try:
        progress("bench dispatch: again with OpenTelemetry tracing on (router and groups, OTLP to loopback)")
        phases = measure()["phases"]
    finally:
        telemetry.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sink.stop()
    return {"phases": phases, "spans_received": len(sink.spans)}


def _agreement(mono, platform, ids, dtype: str) -> dict:
    """Both sides' logits on the prefill input ids [1, P]: a speed figure of a platform that computes
    something else would mean nothing (``expertmesh verify``'s tolerance; argmax at every position)."""
    from expertmesh.verify.tolerances import VERIFY_TOLERANCE

    expected = mono(input_ids=ids).logits.float()  # [1, P, V]
    actual = platform(input_ids=ids).logits.float()
    diff = float((expected - actual).abs().max())
    differ = int((expected.argmax(-1) != actual.argmax(-1)).sum())
    return {
        "max_abs_logit_diff": diff,
        "tolerance": VERIFY_TOLERANCE[dtype],
        "positions": ids.shape[1],
        "argmax_differs_at": differ,
        "passed": diff <= VERIFY_TOLERANCE[dtype] and differ == 0,
    }


def _run_phases(
    options: Options, mono, plane, vocab: int, moe_layers: int, hidden: int, dtype_bytes: int
) -> tuple[list, dict]:
    """Every phase on both sides (list of phase results), after checking that both give the same
    answers (``_agreement``)."""
    import torch

    platform = plane.model
    gen = torch.Generator().manual_seed(options.seed)

    def tokens(*shape):
        return torch.randint(FIRST_TOKEN_ID, vocab, shape, generator=gen).to(platform.device)

    phases = []
    with torch.no_grad():
        ids = tokens(1, options.prefill_tokens)  # [1, P]
        agreement = _agreement(mono, platform, ids, options.dtype)
        progress(f"bench dispatch: prefill {options.prefill_tokens} tokens, {options.repeats} repeats per side")
        meter = _WireMeter(plane.dispatcher.traffic)
        mono_s, plat_s = _measure(lambda m, w: _prefill_seconds(m, ids, w), mono, platform, meter, options.repeats)
        phases.append(
            _phase(
                f"prefill {options.prefill_tokens}",
                1,
                options.prefill_tokens,
                mono_s,
                plat_s,
                meter,
                moe_layers,
                hidden,
                dtype_bytes,
            )
        )
        for batch in options.batches:
            prompt = tokens(batch, DECODE_PROMPT_TOKENS)  # [B, prompt]
            steps = tokens(batch, WARMUP_STEPS + options.decode_steps)  # [B, steps]
            progress(
                f"bench dispatch: decode at batch {batch}, "
                f"{options.decode_steps} steps x {options.repeats} repeats per side"
            )
            meter = _WireMeter(plane.dispatcher.traffic)
            mono_s, plat_s = _measure(
                lambda m, w: _decode_seconds(m, prompt, steps, w), mono, platform, meter, options.repeats
            )
            phases.append(
                _phase(f"decode b={batch}", batch, batch, mono_s, plat_s, meter, moe_layers, hidden, dtype_bytes)
            )
    return phases, agreement


# -- reporting --------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def _agreement_line(agreement: dict) -> str:
    verdict = "PASS" if agreement["passed"] else "FAIL"
    return (
        f"same answers: {verdict}: prefill logits max |diff| {agreement['max_abs_logit_diff']:.3g} (tolerance "
        f"{agreement['tolerance']:g}), argmax differs at {agreement['argmax_differs_at']} "
        f"of {agreement['positions']} positions"
    )


def _memory_line(memory: dict) -> str:
    groups = ", ".join(f"{g} {_mib(n)}" for g, n in memory["groups_peak_bytes"].items())
    return (
        f"RSS MiB: monolithic {_mib(memory['monolithic_bytes'])}, router {_mib(memory['router_bytes'])} "
        f"(each = this process's {_mib(memory['baseline_bytes'])} before models + what loading it added; "
        f"the routed experts' weights, {_mib(memory['routed_expert_bytes'])}, are in the monolithic model only); "
        f"group peaks {groups}; this process's peak {_mib(memory['bench_process_peak_bytes'])}"
    )


def table(result: dict) -> str:
    model, setup = result["model"], result["setup"]
    rows = []
    for p in result["phases"]:
        mono, plat, wire = p["monolithic"], p["platform"], p["wire"]
        rows.append(
            [
                p["name"],
                1e3 * mono["seconds"],
                1e3 * plat["seconds"],
                p["ratio"],
                mono["tokens_per_s"],
                plat["tokens_per_s"],
                p["added_ms_per_moe_layer"],
                wire["dispatch_ms_per_layer"],
                wire["groups_touched_per_token"],
                wire["bytes_per_token_per_layer"],
                wire["min_bytes_per_token_per_layer"],
                wire["overhead_vs_min"],
            ]
        )
    runner = {"ray": "Ray Serve", "process": "plain processes", "in-process": "in the router's process"}[
        setup["groups_as"]
    ]
    carried = ", ".join(sorted(set(setup["transports"].values()))) or "-"
    title = (
        f"{model['model_type']} {Path(model['path']).name}: {model['moe_layers']} MoE layers x "
        f"{model['num_experts']} experts top-{model['top_k']}, hidden {model['hidden_size']}, {setup['dtype']}; "
        f"platform = router + {setup['groups']} expert groups ({runner}), transport {setup['transport']} "
        f"(carried by {carried}); {setup['threads']} torch threads both sides; {setup['machine']['cpus']} CPUs; "
        f"{'on ' + setup['gpu'] + '; ' if 'gpu' in setup else ''}"
        f"median of {setup['repeats']}"
    )
    body = format_table(
        [
            "phase",
            "mono ms",
            "plat ms",
            "ratio",
            "mono tok/s",
            "plat tok/s",
            "+ms/layer",
            "dispatch ms/layer",
            "groups/tok",
            "B/tok/layer",
            "min B",
            "x min",
        ],
        rows,
        ["", ".2f", ".2f", ".2f", ".1f", ".1f", ".3f", ".3f", ".2f", ".0f", ".0f", ".2f"],
    )
    body += "\n" + _agreement_line(result["agreement"]) + "\n" + _memory_line(result["memory"])
    if "tracing_on" not in result:
        return title + "\n" + body
    traced = result["tracing_on"]
    rows = [
        [
            off["name"],
            1e3 * off["platform"]["seconds"],
            1e3 * on["platform"]["seconds"],
            100 * (on["platform"]["seconds"] / off["platform"]["seconds"] - 1),
            off["wire"]["dispatch_ms_per_layer"],
            on["wire"]["dispatch_ms_per_layer"],
        ]
        for off, on in zip(result["phases"], traced["phases"])
    ]
    tracing = format_table(
        ["phase", "plat ms off", "plat ms on", "on vs off %", "dispatch ms/layer off", "on"],
        rows,
        ["", ".2f", ".2f", "+.1f", ".3f", ".3f"],
    )
    return (
        f"{title}\n{body}\n\ntracing off vs on (router and groups export spans over OTLP; "
        f"{traced['spans_received']} spans received)\n{tracing}"
    )
