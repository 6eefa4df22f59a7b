"""A group's experts computed by a grouped kernel (``grouped_experts.cpp``): one call per stacked weight for all of a
call's rows, instead of a product per expert.

Why: ``expert_rows.rows_forward`` on oneDNN-packed weights runs, per expert a call touches, two products and the
ops around them, each product its own OpenMP region; at a decode step that is ~40 torch ops a layer and a group,
and oneDNN's small-row kernels read a weight well below the memory's rate. The grouped kernel takes every row of
the call at once (grouped by expert), shares the (expert, column tile) pairs out over the intra-op threads in one
parallel region, and keeps a tile of 8 rows x 32 columns in registers while it streams the tile's weights once
(vLLM's CPU MoE kernel is built the same way). Measured on this project's 2-core host, 8 layers x 8 experts of
the 214M Mixtral ([3584, 512] and [512, 1792]), two threads, the gate between the two products:

===================  ===========  ============
rows an expert       grouped      oneDNN packed
===================  ===========  ============
1                    26.4 ms      38.4 ms
4                    30.5 ms      40.3 ms
16 (64 clients)      42.3 ms      55.6 ms
32                   67.3 ms      95.3 ms
128 (a prefill)      228 ms       252 ms
512                  1022 ms      907 ms
===================  ===========  ============

(a prompt chunk of the engine's 512 tokens gives each expert ~128 rows; past that oneDNN's cache blocking wins.)

The register block follows the host's vector unit (``grouped_experts.cpp``: 8 rows of two 16-float vectors with
AVX-512, 3 rows of four 8-float vectors with AVX2). On an AVX2 host (AMD EPYC, znver3; ``gmb.py`` in the session
notes), the same experts, two threads, against ``F.linear`` an expert at a time: 22.5 / 29.4 / 57.9 / 99.9 ms at
1 / 4 / 16 / 32 rows an expert against 47.9 / 90.1 / 105.4 / 132.5 (2 rows a block: 30.6 / 32.2 / 65.7 / 107.8;
4 rows, which spill: 37.8 / 50.2 / 105.0 / 192.5). Its loads are plain vector moves, not ``memcpy``: that host's
tuning split each into two 16-byte moves through the stack: with the spills, 3-30x slower (1 to 32 rows).

Each block asks the memory for the weight rows 64 ahead of the ones it multiplies (``PREFETCH``): from ~4 rows an
expert its products no longer hide the memory's latency (on an AVX-512 host, the lanes' two groups of 4: 14.9 / 15.0
/ 17.6 / 29.3 ms at 4 / 8 / 16 / 32 rows an expert against 18.4 / 18.2 / 20.5 / 36.6 without; a 32-sequence decode
step of ``up --groups-as in-process`` 44.0 against 45.8 ms; one sequence unchanged).

Past one register block of rows an expert, a tile goes through its blocks 64 of its K rows at a time (``KC``), each
block's running sums kept between: each 16 KB chunk of a gate tile and its up tile comes from the memory once and
serves every block from the L1 cache, where a whole tile (128 KB) read again for each block came from the memory for
the first and from L2 for the others, the first block's reads not overlapped by the others' products. The same
bits: each output's sum still runs over K in order. A call of 4 experts alone at one thread, weights out of the
caches (medians of two runs each): 12 / 16 / 24 / 32 / 64 rows an expert 1.63-1.75 / 1.77-1.97 / 2.46-2.66 /
3.24-3.45 / 6.5-6.8 ms against 2.55 / 2.31-2.38 / 3.12-3.20 / 3.92 / 6.84-6.88; 1-8 rows (one block) and 120 the
same. In ``up --groups-as in-process``, one server switching every 5 steps (a slow hour): decode steps of 64
sequences 81.1 -> 75.5 ms, of 32 55.1 -> 52.8.

Each output is a plain float32 dot product over its inputs in order, so its last bits are this kernel's (as they
are oneDNN's on the packed path); ``agrees`` checks a module against its own forward before a group uses it, and
``expertmesh verify`` and the engine's tests check the tokens stay stock's. The gate between the two products is
the module's own (``_apply_gate`` / ``act_fn``).

Where a module's gate is SiLU's GLU (``fuses`` checks the bits on seeded rows), a call's whole MLP (the rows
gathered by expert, the two products, the gate, the routing weights, the rows put back) is one op,
``grouped_silu_glu``: the same ATen ops in C++ (so the same bits), without the Python between them. Measured in
the loaded server, one configuration against the other every 5 steps: ~0.9 ms of a ~29 ms one-sequence decode
step, ~1.4 ms of a ~131 ms 64-sequence one.

In that one call the gate is computed inside the gate-and-up products where ``exact_silu`` holds (the kernel's SiLU
gives ``at::silu``'s bits on this host and torch build, checked once a process) and the gate's I outputs end at a
tile's edge: each work item takes a gate tile and its up tile for a block of rows and writes silu(gate) * up
([S, I]), so the [S, 2I] products are never written out and read back, and the routing weights multiply the down
products as they are stored. The same bits as the ATen ops between the products (tested, and ``fuses`` still checks
the whole call against the step-by-step path). Measured in the loaded server (``up --groups-as in-process``, one
server switching every 5 steps, 200 prompts, median step): a 480-token prompt **196.9 -> 173.9 ms**; decode steps
27.6 -> 27.4 ms at 8 sequences and 55.5 -> 54.8 at 64. The call alone (4 experts, 240 tokens top-2, two threads):
6.6 -> 6.1 ms; in the server's profile the SiLU (~0.4 ms a prompt's call) and its product (~0.3) were slower than
alone, as fresh [S, I] and [S, 2I] tensors are.

``GroupedRows`` holds a stacked weight's packed copy ([E, T, K, 32]: each expert's [N, K] matrix in tiles of 32
output columns) and follows the weight as ``linear_kernels.PackedRows`` does: made again after any in-place
write torch sees, and read back by ``computed`` for a group's fingerprints.

Shapes: S rows of a call, E local experts, K a product's inputs, N its outputs, T = ceil(N / 32) tiles.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from transformers.activations import SiLUActivation

from expertmesh.infra.cpu_threads import all_threads_for
from expertmesh.infra.native_kernels import load_cpu_kernel
from expertmesh.models.expert_rows import agrees_with_stock

__all__ = [
    "GroupedRows",
    "GroupedWeight",
    "agrees",
    "exact_silu",
    "fuses",
    "grouped_call",
    "grouped_rows_forward",
    "load",
    "usable",
]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_NAME = "expertmesh_grouped_experts"
#: output columns a tile (the kernel's NR)
TILE = 32
_lock = threading.Lock()


@functools.cache
def load() -> bool:
    """Whether the kernel is built and registered (``torch.ops.expertmesh_experts.grouped_linear``); builds it on
    the first call of a machine. Never raises: a failed build is logged once and gives False."""
    with _lock:
        return load_cpu_kernel(
            _NAME,
            _SOURCE,
            "grouped experts kernel",
            "experts compute one product at a time",
            lambda: (
                torch.ops.expertmesh_experts.grouped_linear,
                torch.ops.expertmesh_experts.grouped_silu_glu,
                torch.ops.expertmesh_experts.grouped_silu_glu_call,
                torch.ops.expertmesh_experts.silu_glu_epilogue,
            ),
            log,
        )


def usable(module: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the module's experts can run on the kernel: float32 on the CPU, no biases, no norm after the
    experts (what the kernel does not add), and the kernel built."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", True)
        and load()
    )


class GroupedRows:
    """A stacked weight [E, out, in] (or [E, in, out] where the module multiplies ``x @ W[e]``: ``transposed``)
    and its packed copy [E, T, in, 32], made on first use and again after any in-place write."""

    __slots__ = ("_stacked", "_transposed", "_packed", "_version")

    def __init__(self, stacked: torch.Tensor, transposed: bool):
        self._stacked = stacked
        self._transposed = transposed
        self._packed: torch.Tensor | None = None
        self._version = -1

    @property
    def outputs(self) -> int:
        """N: each expert's product's outputs."""
        return self._stacked.shape[2 if self._transposed else 1]

    def packed(self) -> torch.Tensor:
        version = self._stacked._version
        if self._packed is None or version != self._version:
            weight = self._stacked.detach()
            weight = weight.transpose(1, 2) if self._transposed else weight  # [E, N, K]
            experts, n, k = weight.shape
            tiles = -(-n // TILE)
            padded = weight.new_zeros(experts, tiles * TILE, k)
            padded[:, :n] = weight
            self._packed = padded.view(experts, tiles, TILE, k).transpose(2, 3).contiguous()  # [E, T, K, 32]
            self._version = version
        return self._packed

    def computed(self, expert: int) -> torch.Tensor | None:
        """The values local expert ``expert``'s products use now, in the stack's orientation (its packed copy read
        back); None before the first product."""
        if self._packed is None:
            return None
        tiles, k = self._packed.shape[1], self._packed.shape[2]
        dense = self._packed[expert].transpose(1, 2).reshape(tiles * TILE, k)[: self.outputs]  # [N, K]
        return dense.t() if self._transposed else dense


class GroupedWeight:
    """One weight [out, in] multiplied by the grouped kernel as a stack of one (``linear_kernels``' ``grouped``
    kernel: the router's dense products); its packed copy follows the weight as ``GroupedRows`` does."""

    __slots__ = ("weight", "threads", "_rows")

    def __init__(self, weight: torch.Tensor, threads: int = 0):
        """``threads``: the router's intra-op threads, which a large product takes in a step narrowed to fewer
        (``infra.cpu_threads.all_threads_for``); 0: the caller's."""
        self.weight = weight  # [out, in]
        self.threads = threads
        self._rows = GroupedRows(weight.unsqueeze(0), transposed=False)  # a view: the weight's writes bump it

    def computed(self) -> torch.Tensor | None:
        """The values its products use now, [out, in]; None before the first one."""
        return self._rows.computed(0)

    def operands(self) -> tuple[torch.Tensor, int]:
        """What ``grouped_linear`` multiplies by, for a caller of the op itself (a fused native op): the packed copy
        of the weight as it is now [1, T, in, 32] and its outputs."""
        return self._rows.packed(), self._rows.outputs

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]: ``nn.functional.linear(x, weight, bias)`` to float32 rounding."""
        if x.dtype != torch.float32 or x.device.type != "cpu":  # what the kernel does not take: torch's product
            return nn.functional.linear(x, self.weight, bias)
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        with all_threads_for(rows.shape[0] * self._rows.outputs, self.threads):
            out = torch.ops.expertmesh_experts.grouped_linear(
                rows, [0, rows.shape[0]], self._rows.packed(), self._rows.outputs
            )
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])


def grouped_rows_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    local: list[int],
    weights: torch.Tensor,
    packs: Mapping[str, GroupedRows],
    silu_glu: bool = False,
) -> torch.Tensor:
    """hidden [S, H], ``local`` [S] (each row's local expert), weights [S, 1] -> each row through its expert,
    weighted, [S, H]: ``expert_rows.rows_forward``'s result, its products on the grouped kernel. ``silu_glu``: the
    module's gate is SiLU's GLU (``fuses``), and the whole of it is one call of the kernel's ``grouped_silu_glu``."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    first_packed = packs[first].packed()  # [E, T, K, 32]
    experts = first_packed.shape[0]
    order = sorted(range(len(local)), key=local.__getitem__)  # stable: each expert's rows in their order
    counts = [0] * experts
    for e in local:
        counts[e] += 1
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    in_order = order == list(range(len(local)))
    index = None if in_order else torch.tensor(order, device=hidden.device)  # [S]
    down = packs["down_proj"]
    if silu_glu:  # the ops below in one call: each torch op from Python costs ~10-20 us in a loaded server
        return torch.ops.expertmesh_experts.grouped_silu_glu(
            hidden,
            index,
            starts,
            first_packed,
            packs[first].outputs,
            down.packed(),
            down.outputs,
            weights,
            exact_silu(),
        )
    rows = hidden if index is None else hidden.index_select(0, index)  # [S, H], grouped by expert
    h = torch.ops.expertmesh_experts.grouped_linear(rows, starts, first_packed, packs[first].outputs)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [S, I]
    out = torch.ops.expertmesh_experts.grouped_linear(h, starts, down.packed(), down.outputs)  # [S, H]
    out = out * (weights if index is None else weights.index_select(0, index))
    if index is None:
        return out
    return torch.empty_like(out).index_copy_(0, index, out)


def grouped_call(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    local_of: torch.Tensor,
    packs: Mapping[str, GroupedRows],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group's whole call on a module that ``fuses``, in one op: hidden [T, H], expert_ids [T, K] (global ids, -1
    empty), weights [T, K] float32, local_of [G] (global id -> local expert, -1 not held) -> (partial sums [T, H];
    rows [S, H], local [S] and row weights [S] of the held (token, slot) pairs grouped by expert, each expert's in
    row order (so each expert's statistics sum as in row order), for the statistics;
    missing [M]: the ids named that the group does not hold, sorted, where nothing was computed).

    The pairs, ``grouped_rows_forward``'s plan and ``row_sums.add_rows``' sums in C++, around the same
    ``grouped_silu_glu``: the same bits as those steps, without ~20 torch ops and the Python between them a call
    (measured in the loaded server at 8 sequences: ~0.25 ms of a layer's ~2.3, on both the router's threads)."""
    first = packs["gate_up_proj"]
    down = packs["down_proj"]
    return torch.ops.expertmesh_experts.grouped_silu_glu_call(
        hidden, expert_ids, weights, local_of, first.packed(), first.outputs, down.packed(), down.outputs, exact_silu()
    )


@functools.cache
def exact_silu() -> bool:
    """Whether the kernel's SiLU (the gated products' epilogue: Sleef's expf at ATen's vector width) gives
    ``at::silu``'s bits on this host and torch build, checked once a process on a spread of values: from -100 to
    100 by 1/64 (the exponential's whole float range, its overflow and underflow included), ±0, ±inf, the extremes
    of float32, and seeded normal ones. Where it does, a fused call computes the gate inside the products; where
    not (another torch's SiLU), the ATen ops between them, as before."""
    if not load():
        return False
    grid = torch.arange(-6400, 6400, dtype=torch.float32) / 64
    info = torch.finfo(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), info.max, -info.max, info.tiny, -info.tiny])
    normal = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 8
    values = torch.cat([grid, special, normal])  # [16904]
    gate = values[: values.numel() // TILE * TILE].view(-1, TILE)  # [R, 32]
    up = torch.rand(gate.shape, generator=torch.Generator().manual_seed(1)) * 4 - 2
    with torch.no_grad():
        fused = torch.ops.expertmesh_experts.silu_glu_epilogue(torch.cat([gate, up], dim=1))
        stock = nn.functional.silu(gate) * up
    exact = torch.equal(fused.view(torch.int32), stock.view(torch.int32))
    if not exact:
        log.info("grouped experts kernel: its SiLU is not this torch's to the bit; the gate runs between the products")
    return exact


def fuses(module: nn.Module, hidden_size: int, packs: Mapping[str, GroupedRows]) -> bool:
    """Whether ``grouped_rows_forward`` may take the module's gated MLP in one call (``silu_glu``): its gate is the
    stock GLU (gate and up halves of one product) over SiLU, checked where it counts: the one call gives the
    step-by-step path's bits on seeded rows over its first experts, one of them out of order."""
    if not module.has_gate or not isinstance(module.act_fn, (nn.SiLU, SiLUActivation)):
        return False
    g = torch.Generator().manual_seed(0)
    local = [e % packs["down_proj"].packed().shape[0] for e in (1, 0, 2, 0, 1)]
    hidden = torch.randn(len(local), hidden_size, generator=g)  # [5, H]
    weights = torch.rand(len(local), 1, generator=g)  # [5, 1]
    with torch.no_grad():
        steps = grouped_rows_forward(module, hidden, local, weights, packs)
        one = grouped_rows_forward(module, hidden, local, weights, packs, silu_glu=True)
    return torch.equal(steps, one)


def agrees(module: nn.Module, hidden_size: int, packs: Mapping[str, GroupedRows]) -> bool:
    """Whether the grouped kernel gives the module's own forward to float32 rounding on rows of its loaded
    weights: five rows over its first experts, seeded (each expert's output checked, not only their sum)."""
    ok = agrees_with_stock(
        module,
        hidden_size,
        lambda m, hidden, local, weights: grouped_rows_forward(m, hidden, local, weights, packs),
        [1, 0, 2, 0, 1],
        lambda stock, mine: torch.allclose(stock, mine, rtol=1e-4, atol=1e-5),
    )
    if not ok:
        log.warning("grouped experts kernel: %s computes another way; its products stay per expert", type(module))
    return ok
