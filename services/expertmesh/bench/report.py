"""What every ``expertmesh bench`` command of the data plane shares: one table
printer, the JSON file, percentiles, the machine and model descriptions, the
torch thread count both sides run with, resident memory, and the error that
makes the CLI exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Sequence

from expertmesh.contracts.errors import ExpertMeshError


class BenchError(ExpertMeshError):
    """A benchmark's input is wrong (bad flag value, prompt longer than the model's context)."""


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], formats: Sequence[str] | None = None) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned,
    a rule under the header. ``formats`` gives a format spec per column for
    numbers (e.g. ``".2f"``); ``None`` and NaN print as ``-``."""
    formats = list(formats or [""] * len(headers))

    def cell(value: Any, spec: str) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return format(value, spec)
        return str(value)

    cells = [[cell(v, f) for v, f in zip(row, formats)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        first, *rest = values
        return " ".join([first.ljust(widths[0])] + [v.rjust(w) for v, w in zip(rest, widths[1:])]).rstrip()

    head = line(list(headers))
    return "\n".join([head, "-" * len(head)] + [line(r) for r in cells])


def write_json(path: str | Path, data: dict) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as err:
        raise BenchError(f"cannot write {str(path)!r}: {err.strerror}") from None


def print_and_write(table: str, result: dict, out: str) -> None:
    """A benchmark's end: its ``table`` on stdout, ``result`` as JSON in ``out``, and where that went."""
    print(table)
    write_json(out, result)
    print(f"wrote {out}")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or at its peak so far (``VmHWM``), in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    raise BenchError(f"/proc/self/status has no {field}")


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; each a positive integer, else BenchError naming the flag."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{flag} takes positive integers separated by commas (e.g. 1,8,32), got {text!r}")
    return values


#: at most this many --shapes: each is a whole benchmark (a fresh platform and every baseline)
MAX_SHAPES = 16


def parse_shapes(text: str, flag: str = "--shapes") -> list[tuple[int, int]]:
    """``"480x96,64x256"`` -> [(480, 96), (64, 256)]: (prompt tokens, new tokens) pairs, each positive, distinct,
    at most MAX_SHAPES; else BenchError naming the flag."""
    shapes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        prompt, x, new = part.lower().partition("x")
        try:  # as parse_int_list reads its counts: int() says what a number is, then each must be positive
            shape = (int(prompt), int(new)) if x else None
        except ValueError:
            shape = None
        if shape is None or min(shape) < 1:
            raise BenchError(
                f"{flag} takes PROMPTxNEW pairs of positive token counts separated by commas (e.g. 480x96,64x256), "
                f"got {part!r}"
            )
        shapes.append(shape)
    if not shapes:
        raise BenchError(f"{flag} takes PROMPTxNEW pairs separated by commas (e.g. 480x96,64x256), got {text!r}")
    if len(shapes) > MAX_SHAPES:
        raise BenchError(f"{flag} takes at most {MAX_SHAPES} shapes (each is a whole benchmark), got {len(shapes)}")
    if len(set(shapes)) != len(shapes):
        raise BenchError(f"{flag} names a shape twice: {text!r}")
    return shapes


def check_positive(value: int, flag: str) -> int:
    if value < 1:
        raise BenchError(f"{flag} must be at least 1, got {value}")
    return value


def add_load_arguments(p: argparse.ArgumentParser, *, groups: int, groups_help: str) -> None:
    """The flags of a benchmark whose clients stream from the platform it starts: ``--model``,
    ``--groups``, ``--clients``, ``--max-new-tokens`` (read back by ``load_options``)."""
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--groups", type=int, default=groups, help=f"{groups_help} (default {groups})")
    p.add_argument("--clients", type=int, default=8, help="streaming clients (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per request (default 16)")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """``add_load_arguments``' flags, checked, as the options' fields ``model``, ``groups``, ``clients``
    and ``max_new_tokens``; no ``--model``: the embedded tiny model."""
    from expertmesh.models.embedded import default_checkpoint

    return {
        "model": args.model or default_checkpoint(),
        "groups": check_positive(args.groups, "--groups"),
        "clients": check_positive(args.clients, "--clients"),
        "max_new_tokens": check_positive(args.max_new_tokens, "--max-new-tokens"),
    }


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` torch intra-op threads (None: the current count), then restore.
    Yields the count in force, for the report."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        yield threads or previous
    finally:
        torch.set_num_threads(previous)


def model_summary(checkpoint) -> dict:
    """The checkpoint's shape, as every benchmark's JSON reports it."""
    spec = checkpoint.spec
    return {
        "path": str(checkpoint.path),
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "moe_layers": len(spec.moe_layers),
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "hidden_size": spec.hidden_size,
    }


def options_summary(options) -> dict:
    """A benchmark's options dataclass as JSON-ready values (paths as text, tuples as lists)."""

    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, tuple):
            return list(value)
        return value

    return {f.name: plain(getattr(options, f.name)) for f in fields(options)}
