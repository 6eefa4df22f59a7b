"""The options of ``bench serve`` and their checks: one kind of run per command, within what the model allows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from expertmesh.bench.report import BenchError

__all__ = ["Options", "check_modes", "shaped", "validate"]


@dataclass(frozen=True)
class Options:
    """One ``bench serve`` command's options: its flags, as ``cli.options_from_args`` reads them."""

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
    classifier: bool = False  # also the classifier's added TTFT (text prompts; see the package's docstring)
    repeats: int = 1  # interleaved repeats of the platform and baseline runs; medians reported
    groups_as: str = "ray"  # "ray": Ray Serve deployments; "process": `expertmesh group serve` processes
    device: str = "auto"  # of the router's model and the baseline: auto, cpu, cuda, cuda:N
    sweep: tuple[int, ...] = ()  # client counts: the whole benchmark at each (see the package's docstring)
    #: (prompt tokens, new tokens) pairs: the whole benchmark at each, crossed with ``sweep`` (or at ``clients``)
    shapes: tuple[tuple[int, int], ...] = ()
    shared_prefix: int = 0  # tokens of a prompt prefix all requests share: the prefix-cache run instead
    guard: str = ""  # a consistency-guard scorer: the guard's run at load instead (bench.guarded_serve)
    guard_policies: tuple[str, ...] = ("delta_gap", "restrict")
    guard_threshold: float | None = None  # None: the guard's default (0.65)
    guard_recompute: str = "widened"
    #: the platform started here: its experts placed by calibrated load with this many redundant replicas per
    #: layer before the timed runs (bench.planned_placement); None: the contiguous split
    redundant: int | None = None
    #: what the platform is compared with (``baselines.BASELINES``), in this order; ``generate`` first when given
    baselines: tuple[str, ...] = ("generate",)
    #: US dollars an hour of the machine both sides run on: each run's cost per million output tokens (None: not
    #: priced; ``bench.cost``)
    price_per_hour: float | None = None


def check_modes(options: Options) -> None:
    """One kind of run per command, and each run's own limits (nothing read yet: no model, no platform)."""
    modes = [f for f, on in (("--sweep", options.sweep), ("--shapes", options.shapes),
                             ("--shared-prefix", options.shared_prefix), ("--guard", options.guard)) if on]  # fmt: skip
    if options.sweep and options.shapes:  # one run, swept over both: clients x shapes
        modes.remove("--shapes")
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
    if options.guard:
        _check_guard(options)
    _check_baselines(options)


def _check_baselines(options: Options) -> None:
    from expertmesh.bench.serve.baselines import BASELINES

    unknown = [b for b in options.baselines if b not in BASELINES]
    if unknown or not options.baselines or len(set(options.baselines)) != len(options.baselines):
        given = ",".join(options.baselines)
        raise BenchError(f"--baseline takes distinct names of {', '.join(BASELINES)}, comma-separated; got {given!r}")
    if (options.shared_prefix or options.guard) and options.baselines != ("generate",):
        raise BenchError("--baseline is for the throughput runs; --shared-prefix and --guard have their own")
    if "vllm" in options.baselines:
        from expertmesh.bench.serve.baselines.vllm import venv_python

        venv_python()  # before anything starts: a missing venv is one line, not a platform started for nothing


def _check_guard(options: Options) -> None:
    if options.target:
        raise BenchError("--guard starts its own platform (its profiles go into that platform's store); drop --target")
    if not options.guard_policies:
        raise BenchError("--guard-policies: name at least one routing policy, e.g. delta_gap")
    if "exact" in options.guard_policies:
        raise BenchError("--guard-policies: exact is the reference and is never guarded; name other policies")
    if options.guard_threshold is not None and not 0 <= options.guard_threshold <= 1:
        raise BenchError(f"--guard-threshold must be between 0 and 1, got {options.guard_threshold:g}")


def shaped(options: Options) -> list[Options]:
    """``options`` at each of its ``shapes`` (prompt and new tokens), or as given without shapes."""
    if not options.shapes:
        return [options]
    return [replace(options, prompt_tokens=p, max_new_tokens=n, shapes=()) for p, n in options.shapes]


def validate(options: Options):
    """The checkpoint of ``options.model``, once the options fit it (its context, its experts per group; every
    one of its ``shapes``)."""
    from expertmesh.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(options.model)
    spec = checkpoint.spec
    if options.redundant and options.redundant > spec.num_experts * (options.groups - 1):
        raise BenchError(
            f"--redundant {options.redundant}: {options.groups} groups hold at most "
            f"{spec.num_experts * (options.groups - 1)} redundant replicas of a layer's {spec.num_experts} experts"
        )
    context = spec.max_context
    for shape in shaped(options):
        if context and shape.prompt_tokens + shape.max_new_tokens > context:
            what = (
                f"--shapes {shape.prompt_tokens}x{shape.max_new_tokens}"
                if options.shapes
                else f"--prompt-tokens {shape.prompt_tokens} + --max-new-tokens {shape.max_new_tokens}"
            )
            raise BenchError(f"{what} is above the model's context of {context} tokens")
    return checkpoint
