"""The router's RMS norms computed in one pass a row (``rms_norm.cpp``), to the stock module's bits.

Why: a transformers RMS norm (``MixtralRMSNorm``, ``LlamaRMSNorm`` and the many written the same way) is six ATen
ops: ``x.pow(2)``, ``mean(-1)``, ``+ eps``, ``rsqrt``, ``x * r`` and ``weight * y``, each its own pass over the
rows (and a fresh tensor); a model runs two a layer and one at the end. In a serving step the rows are cold (the
experts' weights stream through the caches between one norm and the next), so a 480-token prompt's norm took ~290
us in the server (~150 us alone with cold caches, 56 hot), and at a decode step each op costs its dispatch: 13.3
us a norm of one row against 3.2 in one op (two threads, this project's 2-core AVX-512 host). The kernel reads a
row once, writes it once, and computes every step in float32 as those ops round it: the squares, their sum in the
order of ATen's cascade sum (``SumKernel.cpp``: vectors of 8 floats on this host's torch build, whatever its
capability; ``lanes``), divided by the width, plus eps rounded to float32, one over its square root, times each
value, times the weight. In the loaded server (``up --groups-as in-process``, one server switching every 5 steps,
medians): a 480-token prompt's step 177.5 -> 174.0 ms, a decode step of 8 sequences 31.2 -> 30.3, of one 17.8 ->
17.6.

A module is replaced (``fuse_rms_norms``, for the router's model on the CPU in float32) only where the kernel gives
its own forward's bits on seeded rows of three shapes at one of the two sum widths (``agreeing_lanes``); any other
norm (Gemma's ``1 + weight``, a norm in another dtype, one that computes in another order) keeps its forward. The
replacement holds the module's own ``weight`` parameter (the state dict's names and the fingerprints unchanged)
and calls the module's forward for inputs the kernel does not take (another dtype or device).

Shapes: x [..., H] float32, weight [H].
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from pathlib import Path

import torch
from torch import nn

from expertmesh.infra.native_kernels import load_cpu_kernel

__all__ = ["FusedRMSNorm", "agreeing_lanes", "fuse_rms_norms", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_lock = threading.Lock()
#: the vector widths ATen's float sum runs at on some host (AVX2's 8, AVX-512's 16), the likeliest first
SUM_LANES = (8, 16)


@functools.cache
def load() -> bool:
    """Whether the kernel is built (once per machine) and registered (``torch.ops.expertmesh_norm.rms_norm``);
    never raises (a failed build is logged once, and the modules keep their own forward)."""
    with _lock:
        return load_cpu_kernel(
            "expertmesh_rms_norm",
            _SOURCE,
            "RMS norm kernel",
            "the router's norms run their own ops",
            lambda: torch.ops.expertmesh_norm.rms_norm,
            log,
        )


def _candidate(module: nn.Module) -> bool:
    """A module written as transformers' RMS norms are: a float32 [H] ``weight`` on the CPU, a float
    ``variance_epsilon``, nothing else held, and a forward of the rows alone (not a gated norm's ``(hidden, gate)``:
    Kimi-Linear's, GraniteMoeHybrid's)."""
    weight = getattr(module, "weight", None)
    return (
        not isinstance(module, FusedRMSNorm)
        and _takes_rows_alone(type(module).forward)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and not any(True for _ in module.children())
        and [name for name, _ in module.named_parameters()] == ["weight"]
    )


def _takes_rows_alone(forward) -> bool:
    """Whether ``forward(self, x)`` is all the forward takes: no other parameter, not even an optional one."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 2 and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def agreeing_lanes(module: nn.Module) -> int | None:
    """The sum width at which the kernel gives ``module``'s own forward to the bit on seeded rows ([1, H], [3, 7,
    H] and [37, H], values up to ~4 sigma of 3), or None where neither does."""
    if not (_candidate(module) and load()):
        return None
    width = module.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(shape, generator=g) * 3 for shape in ((1, width), (3, 7, width), (37, width))]
    with torch.no_grad():
        try:
            stock = [module(x) for x in rows]
        except Exception:  # a module that does not take plain rows so is not one to replace
            return None
        for lanes in SUM_LANES:
            fused = [torch.ops.expertmesh_norm.rms_norm(x, module.weight, module.variance_epsilon, lanes) for x in rows]
            if all(torch.equal(a, b) for a, b in zip(fused, stock, strict=True)):
                return lanes
    return None


class FusedRMSNorm(nn.Module):
    """An RMS norm computed by the kernel: the replaced module's own ``weight`` and eps, its forward kept for inputs
    the kernel does not take."""

    def __init__(self, norm: nn.Module, lanes: int):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._lanes = lanes
        self._stock = (norm,)  # a tuple: not a submodule, so no second name for the weight in the state dict

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu":
            return torch.ops.expertmesh_norm.rms_norm(hidden_states, self.weight, self.variance_epsilon, self._lanes)
        (norm,) = self._stock
        norm.weight = self.weight  # the parameter as loaded now (a load with assign=True replaces it here)
        return norm(hidden_states)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, lanes={self._lanes}"


def fuse_rms_norms(model: nn.Module) -> int:
    """Every RMS norm of ``model`` that the kernel computes to its own forward's bits (``agreeing_lanes``) replaced
    by a ``FusedRMSNorm``; returns how many."""
    targets = [
        (parent, name, child, lanes)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _candidate(child) and (lanes := agreeing_lanes(child)) is not None
    ]
    for parent, name, child, lanes in targets:
        setattr(parent, name, FusedRMSNorm(child, lanes))
    return len(targets)
