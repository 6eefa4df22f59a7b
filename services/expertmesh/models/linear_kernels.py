"""Which kernel computes a product ``x @ W.T`` (``nn.functional.linear``; W [out, in]) on the device the weights
are on, and weights prepared once for it.

torch's float32 products on an x86 CPU go to MKL, which picks its code path by CPU vendor: on this project's host
(an AMD EPYC with AVX-512) it runs a path that reads a weight at 5-12 GB/s for a few rows and reaches ~70 GFLOP/s
for many. oneDNN (torch's ``mkldnn`` ops, what vLLM's CPU build multiplies with) picks its kernels by the CPU's
instruction set, and with a weight reordered once into its blocked layout it does much better. Measured on that
host, float32, the 214M Mixtral's shapes:

=============================================  ==============  ===============
product                                        MKL, weight     oneDNN packed
                                               input-major
=============================================  ==============  ===============
LM head [32000, 512], 8 rows, 2 threads        9.9 ms          2.8 ms
LM head, 32 rows, 2 threads                    14.4 ms         6.3 ms
12 expert products [1792, 512], 8 rows, 1 th.  6.8 ms          3.8 ms
the same, 512 rows, 1 thread                   124 ms          106 ms
=============================================  ==============  ===============

Kernels (``LINEAR_KERNELS``, keyed by ``LinearKernel``):
- ``blas``: ``nn.functional.linear`` as torch computes it: every device and dtype.
- ``onednn-packed``: the weight reordered by ``torch.ops.mkldnn._reorder_linear_weight`` and multiplied by
  ``torch.ops.mkldnn._linear_pointwise``: CPU tensors of float32, or of bfloat16 where the CPU runs oneDNN's
  bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), where torch is built with oneDNN.
- ``grouped``: this project's register-block kernel (``grouped_experts``, the experts' own) over the weight as
  one expert: CPU float32 where the kernel builds; the router's choice there (``choose_linear_kernel(...,
  grouped=True)``). A weight of fewer outputs than one of its tiles (an 8-expert gate) stays on ``blas``. Measured
  on the AVX-512 host, float32, a 64 MB read between calls (the expert weights a decode step streams push the
  router's out of the caches), one thread: [512, 512] at 1 / 8 / 64 rows 60 / 62 / 169 us against MKL's 85 / 133
  / 399 and oneDNN's 155 / 132 / 244; the LM head [32000, 512] 1.64 / 1.75 / 8.7 ms against 4.0 / 7.4 / 23.3 and
  2.0 / 2.6 / 9.4 (two threads at 64 rows: 4.4 against 13.6 and 4.9). In ``up --groups-as in-process``, the
  attention projections and the head on it against MKL and oneDNN, interleaved runs: a decode step of 8 sequences
  25.3 against 27.9 ms (medians of three), of 32 37.1 against 41.4.
The products' last bits may differ from ``blas``'s, as they already do with the number of rows in a call;
``expertmesh verify`` and the engine's tests check the tokens stay stock's.

A packed copy follows its weight: it keeps the version counter torch bumps on every in-place write (a view's
writes included), and is made again when the weight has moved on, so a weight overwritten in place (a fault
injected, a hot update) is computed with its new values. A write torch does not see (through ``.data``, or
a memory fault) leaves the two apart: a group's fingerprints therefore read the packed copies back
(``PackedRows.computed``), so a fault in either copy shows as a fingerprint that changed.
``PackedLinear`` keeps the ``nn.Linear`` it replaces' own parameters (same names, same tensors: state dicts
see no change) and holds the packed copy beside them, outside the state dict; the router's weight check reads
that copy back too (``PackedLinear.computed_weight``).

Shapes: x [..., in], W [out, in] (a view of any strides), bias [out]; a stacked weight [E, out, in].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, Protocol, get_args

import torch
from torch import nn

__all__ = [
    "BLAS_MAX_ELEMENTS",
    "LINEAR_KERNELS",
    "LinearKernel",
    "PackedLinear",
    "PackedProduct",
    "PackedRows",
    "PackedWeight",
    "choose_linear_kernel",
    "pack_linears",
]

LinearKernel = Literal["blas", "onednn-packed", "grouped"]
LINEAR_KERNELS: tuple[LinearKernel, ...] = get_args(LinearKernel)

#: rows the packed layout is chosen for (oneDNN's hint; any number of rows computes with it): a decode step's
PACK_ROWS_HINT = 8
#: a product of fewer rows is computed on this many (zeros below, cut off after): oneDNN's kernels for one or two
#: rows read a packed weight slower than its kernel for four (an expert's [3584, 512] at 1 or 2 rows: 12-15 GB/s,
#: padded to 4: 16-18 GB/s; one thread, this project's host); the extra rows cost no more weight reads. End to end,
#: 8 clients of 64-token prompts and 256-token answers: 92.1 / 95.8 -> 95.8 / 102.7 tok/s, groups' CPU -11 %
MIN_ROWS = 4
#: the largest weight (elements) the router leaves to ``blas`` under ``onednn-packed`` (``pack_linears``'
#: ``blas_max_elements``): a weight this small stays in the caches between steps, where MKL's own product of a few
#: rows costs less than oneDNN's call. Measured inside one ``up --groups-as in-process`` server on the 214M
#: Mixtral, one configuration against the other every 5 steps (its attention projections, [512, 512] and
#: [128, 512], and its gates on ``blas``): a one-client decode step 30.8 against 35.4 ms and 28.7 against 34.0; at
#: 8 clients 67.7 against 68.2, at 64 163.5 against 162.9 (no change). Read from memory instead (a weight not in
#: the caches, measured alone), oneDNN's is the faster from [512, 512] up: why the line is not higher.
BLAS_MAX_ELEMENTS = 512 * 512


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _cpu_runs_onednn_bf16() -> bool:
    """Whether this CPU has what oneDNN's bfloat16 products need (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT): without
    them its reorder refuses a bfloat16 weight ("bf16 path needs the cpu support ..."), as on an AVX2-only host."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _grouped_available() -> bool:
    from expertmesh.models import grouped_experts  # it builds on this module's packed rows: imported when asked

    return grouped_experts.load()


def choose_linear_kernel(device: torch.device, dtype: torch.dtype, grouped: bool = False) -> LinearKernel:
    """``grouped`` (when asked: the router's dense products) for CPU float32 weights where its kernel builds;
    ``onednn-packed`` for CPU weights of float32, or bfloat16 where the CPU runs oneDNN's bfloat16 path, where
    torch has oneDNN; else ``blas``."""
    if grouped and device.type == "cpu" and dtype == torch.float32 and _grouped_available():
        return "grouped"
    if device.type != "cpu" or not _onednn_available():
        return "blas"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _cpu_runs_onednn_bf16()):
        return "onednn-packed"
    return "blas"


class PackedWeight:
    """One weight [out, in] and its oneDNN-packed copy, made on first use and again after any in-place write."""

    __slots__ = ("weight", "_packed", "_version")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]
        self._packed: torch.Tensor | None = None
        self._version = -1

    def packed(self) -> torch.Tensor:
        version = self.weight._version
        if self._packed is None or version != self._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
            self._version = version
        return self._packed

    def computed(self) -> torch.Tensor | None:
        """The values its products use now, [out, in] (the packed copy read back); None before the first one."""
        return None if self._packed is None else self._packed.to_dense()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]: ``nn.functional.linear(x, weight, bias)`` by the packed kernel."""
        if x.dtype != self.weight.dtype:  # what linear would refuse: let it say so
            return nn.functional.linear(x, self.weight, bias)
        rows = x.shape[0] if x.dim() == 2 else 0
        if 0 < rows < MIN_ROWS:  # [rows, in] -> [MIN_ROWS, in]: see MIN_ROWS
            padded = x.new_zeros(MIN_ROWS, x.shape[1])
            padded[:rows] = x
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed(), bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed(), bias, "none", [], "")


class PackedRows:
    """Each expert's matrix of a stacked weight, packed on first use: [E, out, in], or [E, in, out] where the
    module multiplies ``x @ W[e]`` (``transposed``)."""

    __slots__ = ("_stacked", "_transposed", "_rows")

    def __init__(self, stacked: torch.Tensor, transposed: bool):
        self._stacked = stacked
        self._transposed = transposed
        self._rows: dict[int, PackedWeight] = {}

    def computed(self, expert: int) -> torch.Tensor | None:
        """The values local expert ``expert``'s products use now, in the stack's orientation (its packed copy read
        back); None before its first product. What a fingerprint of the computed weights reads."""
        packed = self._rows.get(expert)
        if packed is None or packed._packed is None:
            return None
        dense = packed._packed.to_dense()  # [out, in]
        return dense.t() if self._transposed else dense

    def row(self, expert: int) -> PackedWeight:
        """Local expert ``expert``'s matrix as [out, in] (a view: in-place writes to the stack reach it)."""
        packed = self._rows.get(expert)
        if packed is None:
            weight = self._stacked[expert]
            packed = self._rows[expert] = PackedWeight(weight.t() if self._transposed else weight)
        return packed


class PackedProduct(Protocol):
    """One weight [out, in] and the copy a kernel multiplies by: ``PackedWeight``, ``grouped_experts.GroupedWeight``."""

    weight: torch.Tensor

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def computed(self) -> torch.Tensor | None: ...


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` computed by a packed kernel (``packing``: ``PackedWeight`` for ``onednn-packed``): the
    replaced module's own ``weight`` and ``bias`` parameters, and their packed copy beside them."""

    def __init__(self, linear: nn.Linear, packing: Callable[[torch.Tensor], PackedProduct] = PackedWeight):
        nn.Module.__init__(self)  # no fresh parameters: the replaced module's own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packing = packing
        self._weight = packing(self.weight)

    def computed_weight(self) -> torch.Tensor | None:
        """The values its products use now, [out, in] (the packed copy read back); None before its first one."""
        return None if self._weight.weight is not self.weight else self._weight.computed()

    def product(self) -> PackedProduct:
        """The packed copy its products use now (made again when the parameter itself was replaced)."""
        if self._weight.weight is not self.weight:  # the parameter itself replaced (a load with assign=True)
            self._weight = self._packing(self.weight)
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product().linear(x, self.bias)


def pack_linears(model: nn.Module, kernel: LinearKernel, blas_max_elements: int = 0, threads: int = 0) -> int:
    """Every ``nn.Linear`` of ``model`` computed by ``kernel`` (a ``PackedLinear``; nothing changes for ``blas``)
    but those whose weight has at most ``blas_max_elements`` elements (left to ``blas``; see ``BLAS_MAX_ELEMENTS``)
    or, for ``grouped``, fewer outputs than its tile; returns how many were replaced. Only modules of the kernel's
    dtypes on the CPU. ``threads``: ``grouped``'s large products take that many intra-op threads in a step narrowed
    to fewer (``grouped_experts.GroupedWeight``)."""
    if kernel == "blas":
        return 0
    packing: Callable[[torch.Tensor], PackedProduct] = PackedWeight
    smallest_outputs = 1
    if kernel == "grouped":
        from expertmesh.models.grouped_experts import TILE, GroupedWeight

        packing, smallest_outputs = functools.partial(GroupedWeight, threads=threads), TILE
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.numel() > blas_max_elements
        and child.out_features >= smallest_outputs
        and choose_linear_kernel(child.weight.device, child.weight.dtype, grouped=kernel == "grouped") == kernel
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, packing))
    return len(targets)
