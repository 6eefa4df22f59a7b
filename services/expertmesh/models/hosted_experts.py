"""The experts one group holds, computed with the architecture's own experts module.

For each hosted MoE layer the group keeps one instance of the checkpoint's
experts class (``MixtralExperts``, ``GptOssExperts``, ...) whose stacked
parameters hold only the hosted experts, in ascending global id. A request's
global expert ids are mapped to local rows, and the module's stock ``eager``
forward does the math, so activation, biases, clamping and gate layout are the
architecture's, not ours.

Loading and unloading never touch what a concurrent ``compute`` may be
reading: each changed layer gets a new module, ids and id map built off to the
side, and the layer map is replaced with one assignment. ``compute`` reads the
map once and uses that snapshot throughout, so it sees either the old layer or
the new one, never a half-built mix of two experts' weights.

Each expert carries a weight fingerprint (``fingerprint``) taken when its rows
were read from disk; ``fingerprints`` recomputes it now, and a difference means
the weights changed in memory since (``inject_fault`` makes that happen on purpose,
for the chaos tests). A reload (``load(..., reload=True)``) reads
held experts from disk again, swapped in the same way: the health monitor's
repair, with no moment at which the expert is missing.

``warm_up`` runs each held layer's compute once at a decode size and once at a prefill size
(``warm_up_calls``), before the group reports ready: the first Dispatch does not pay for first-call
allocation and kernel selection. It records nothing (``stats`` stay as they were), so the health
monitor reads the same statistics as without it.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Callable, Literal, Mapping, Sequence

import torch
from torch import nn

from expertmesh.contracts.errors import InvalidRequest, NotHosted, OverBudget
from expertmesh.infra import row_sums
from expertmesh.infra.finite import all_finite
from expertmesh.infra.row_sums import add_rows
from expertmesh.models import call_statistics
from expertmesh.models.call_statistics import per_expert
from expertmesh.models.checkpoint import Checkpoint, experts_modules, interface_forward
from expertmesh.models.expert_rows import matches_stock, rows_forward
from expertmesh.models.fingerprint import fingerprint
from expertmesh.models.grouped_experts import GroupedRows, agrees, fuses, grouped_call, grouped_rows_forward, usable
from expertmesh.models.linear_kernels import LinearKernel, PackedRows, choose_linear_kernel
from expertmesh.models.weight_layout import input_major, prefers_input_major

#: Columns of expert_ids a Dispatch may carry beyond the model's top-k: the router's
#: dynamic top-k may widen a token's choice by one expert.
TOP_K_ALLOWANCE = 1
#: Default cap on the (token, slot) pairs of one Dispatch, T·K.
MAX_ROWS = 1 << 20
#: Calls of up to this many (token, slot) entries (decode steps) find their pairs in plain Python
#: (``_compute_small``) where the module does not fuse (``grouped_experts.fuses``)
SMALL_RECORD_ROWS = 64

#: Tokens of the warm-up's calls per held layer: a decode-sized call (at most SMALL_RECORD_ROWS rows at any top-k
#: up to 8: the plain-Python path) and a prefill-sized one (the batched path)
WARM_UP_TOKENS = (8, 256)

#: How ``inject_fault`` corrupts an expert: ``scale`` multiplies its weights by a factor (outputs
#: change but stay finite: the quiet kind), ``nan`` overwrites them with NaN.
FaultKind = Literal["scale", "nan"]


def _stored(stacked: torch.Tensor, module: nn.Module, device: torch.device) -> torch.Tensor:
    """``stacked`` as the group keeps it: a module that multiplies by [E, out, in] weights (``is_transposed``
    false: Mixtral, Qwen, OLMoE...) gets them input-major where the device prefers it (``weight_layout``);
    GPT-OSS's are [in, out] already, and 1-D/2-D parameters (biases) stay as they are."""
    if stacked.dim() != 3 or getattr(module, "is_transposed", None) is not False or not prefers_input_major(device):
        return stacked
    return input_major(stacked)


@dataclass
class OutputStats:
    """Output statistics of one hosted expert since it was loaded.

    The norm statistics cover the L2 norms of the expert's unweighted output
    rows, merged batch by batch (Chan et al.'s parallel form of Welford's
    algorithm); ``norm_var`` is the population variance.
    """

    calls: int = 0
    rows: int = 0
    #: rows whose output held a NaN or an Inf
    non_finite: int = 0
    #: rows in the norm statistics: finite, with a non-zero routing weight
    normed: int = 0
    norm_mean: float = 0.0
    #: sum of squared deviations from norm_mean
    norm_m2: float = 0.0

    @property
    def norm_var(self) -> float:
        return self.norm_m2 / self.normed if self.normed else 0.0

    def merge(self, rows: int, non_finite: int, normed: int, mean: float, m2: float) -> None:
        """Add one Dispatch's rows of this expert: ``normed`` norms with mean ``mean`` and squared deviations ``m2``."""
        self.calls += 1
        self.rows += rows
        self.non_finite += non_finite
        if not normed:
            return
        total = self.normed + normed
        delta = mean - self.norm_mean
        self.norm_mean += delta * normed / total
        self.norm_m2 += m2 + delta * delta * self.normed * normed / total
        self.normed = total


@dataclass(frozen=True)
class _LayerExperts:
    """One layer's hosted experts; never changed once published (``stats`` only accumulate)."""

    module: nn.Module
    #: global expert ids held, ascending; row i of each stacked parameter is expert ids[i]
    ids: tuple[int, ...]
    #: [num_experts] int64: global id -> local row, -1 where not held
    local_of: torch.Tensor
    #: global id -> its statistics; carried into the next build while the expert stays loaded
    stats: Mapping[int, OutputStats]
    #: global id -> its weight fingerprint when its rows were read from disk; carried like ``stats``
    fingerprints: Mapping[int, str]
    #: calls go through ``expert_rows.rows_forward`` (it matched the module's forward at build)
    rows_fast: bool = False
    #: stacked weight name -> its experts' packed copies, where ``rows_forward`` multiplies by the
    #: ``onednn-packed`` kernel (``linear_kernels``), or all of them for the grouped kernel (``grouped_experts``);
    #: None: the products are torch's own
    packs: Mapping[str, PackedRows] | Mapping[str, GroupedRows] | None = None
    #: with the grouped kernel: the module's gated MLP is SiLU's GLU, computed in one call (``grouped_experts.fuses``)
    silu_glu: bool = False

    def rows(self, hidden: torch.Tensor, local: list[int], weights: torch.Tensor) -> torch.Tensor:
        """hidden [S, H], ``local`` [S], weights [S, 1] -> each row through its local expert, weighted, [S, H]
        (``rows_fast`` modules only): on the grouped kernel, else the stock loop's operations."""
        packs = self.packs
        if packs is not None and isinstance(next(iter(packs.values())), GroupedRows):
            return grouped_rows_forward(self.module, hidden, local, weights, packs, self.silu_glu)
        return rows_forward(self.module, hidden, local, weights, packs)

    @cached_property
    def forward(self) -> Callable[..., torch.Tensor]:
        """The module's forward as the experts interface runs it (``checkpoint.interface_forward``)."""
        return interface_forward(self.module)

    @cached_property
    def local_index(self) -> Mapping[int, int]:
        """global id -> local row, of the held ids only (``local_of`` for plain Python)."""
        return MappingProxyType({e: i for i, e in enumerate(self.ids)})

    def rows_of(self, expert: int) -> dict[str, torch.Tensor]:
        """The expert's row of each stacked parameter (views, not copies)."""
        row = self.ids.index(expert)
        return {name: param[row] for name, param in self.module.named_parameters()}

    def fingerprint_now(self, expert: int) -> str:
        """The fingerprint of the expert's weights as its products use them: its stored rows, with any packed copy
        that no longer equals them in its place (``linear_kernels``: a fault in either copy changes it)."""
        stored = self.rows_of(expert)
        now = fingerprint(stored)
        if self.packs is not None and now == self.fingerprints.get(expert):
            row = self.ids.index(expert)
            computed = {name: rows.computed(row) for name, rows in self.packs.items()}
            apart = {n: c for n, c in computed.items() if c is not None and not torch.equal(c, stored[n])}
            if apart:  # the stored rows are as loaded, the computed ones are not
                return fingerprint({**stored, **apart})
        return now


class HostedExperts:
    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        budget_bytes: int | None = None,
        max_rows: int = MAX_ROWS,
        linear_kernel: LinearKernel | None = None,
        grouped: bool = True,
    ):
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.dtype = dtype
        self.device = torch.device(device)
        #: what the experts' products run on (``linear_kernels``; None: the device's best)
        self.linear_kernel = linear_kernel or choose_linear_kernel(self.device, dtype)
        if self.device.type == "cpu":
            row_sums.load()  # each call's rows are added into its partial sums
        call_statistics.load()  # each call's rows are summed into its experts' statistics (on the host)
        #: with ``onednn-packed``: the experts' products on the grouped kernel where a module can use it
        #: (``grouped_experts``: one call for all of a call's rows); False: one product per expert
        self.grouped = grouped
        #: most bytes of expert weights held at once; None = unlimited
        self.budget_bytes = budget_bytes
        self.max_rows = max_rows
        # A config that does not name its top-k leaves it 0: bound K by the expert count instead.
        self.max_columns = (self.spec.top_k or self.spec.num_experts) + TOP_K_ALLOWANCE
        # A meta skeleton gives one experts-module template per MoE layer; each build copies one.
        self._templates = {
            layer: module for layer, (_, module) in experts_modules(checkpoint.skeleton("eager", dtype)).items()
        }
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._bytes_per_expert = {
            layer: itemsize * sum(getattr(t, name)[0].numel() for name in self.spec.expert_params)
            for layer, t in self._templates.items()
        }
        for template in self._templates.values():
            for name in self.spec.expert_params:
                template._parameters[name] = None
            # A submodule's parameters (Ergo's per-expert output norm) serve a subclass's work around the interface,
            # which the router does (``interface_forward``): not held here, rather than held uninitialised.
            for owner in template.modules():
                if owner is not template:
                    owner._parameters.update(dict.fromkeys(owner._parameters))
        #: layer -> its experts; replaced whole (one assignment), never mutated
        self._layers: Mapping[int, _LayerExperts] = MappingProxyType({})
        self._lock = threading.Lock()  # serialises load and unload
        self._stats_lock = threading.Lock()

    # -- what is held ----------------------------------------------------------------

    def pairs(self) -> list[tuple[int, int]]:
        layers = self._layers
        return [(layer, e) for layer, held in sorted(layers.items()) for e in held.ids]

    def weight_bytes(self) -> int:
        layers = self._layers
        return sum(p.numel() * p.element_size() for held in layers.values() for p in held.module.parameters())

    def expert_bytes(self, pairs: list[tuple[int, int]]) -> int:
        """Bytes the weights of ``pairs`` take once loaded, from the checkpoint's shapes alone."""
        return sum(self._bytes_per_expert[layer] for layer, _ in pairs)

    def fingerprints(self, pairs: list[tuple[int, int]] | None = None) -> list[tuple[int, int, str, str]]:
        """(layer, expert, fingerprint at load, fingerprint recomputed now) for ``pairs`` (default:
        every hosted expert). Raises NotHosted for a pair not held."""
        layers = self._layers
        wanted = self.pairs() if pairs is None else sorted(set(pairs))
        missing = [p for p in wanted if p[0] not in layers or p[1] not in layers[p[0]].ids]
        if missing:
            raise NotHosted(f"(layer, expert) {missing[:5]} are not held by this group")
        return [(layer, e, layers[layer].fingerprints[e], layers[layer].fingerprint_now(e)) for layer, e in wanted]

    def expert_stats(self) -> list[tuple[int, int, OutputStats]]:
        """(layer, expert, a copy of its statistics) for every hosted expert."""
        layers = self._layers
        with self._stats_lock:
            return [(layer, e, replace(held.stats[e])) for layer, held in sorted(layers.items()) for e in held.ids]

    def inject_fault(self, layer: int, expert: int, kind: FaultKind, factor: float = 1.0) -> tuple[str, str]:
        """Overwrite a hosted expert's weights in place, as a memory fault would: the module that
        concurrent and later computes read changes under them, and its fingerprint no longer matches.
        Test-only (the service refuses it unless enabled). Returns (fingerprint at load, now)."""
        if kind == "scale" and (not math.isfinite(factor) or factor == 1.0):
            raise InvalidRequest(f"a scale fault needs a finite factor other than 1, got {factor}")
        if kind not in ("scale", "nan"):
            raise InvalidRequest(f"unknown fault kind {kind!r}")
        held = self._layers.get(layer)
        if held is None or expert not in held.ids:
            raise NotHosted(f"layer {layer} expert {expert} is not held by this group")
        with torch.no_grad():
            for row in held.rows_of(expert).values():
                if kind == "scale":
                    row.mul_(factor)
                else:
                    row.fill_(math.nan)
        return held.fingerprints[expert], fingerprint(held.rows_of(expert))

    # -- load / unload -----------------------------------------------------------------

    def _check_pairs(self, pairs: list[tuple[int, int]]) -> None:
        for layer, expert in pairs:
            if layer not in self.spec.moe_layers:
                raise NotHosted(
                    f"layer {layer} is not an MoE layer of this model (MoE layers: {list(self.spec.moe_layers)})"
                )
            if not 0 <= expert < self.spec.num_experts:
                raise NotHosted(f"expert {expert} of layer {layer} does not exist ({self.spec.num_experts} experts)")

    def _check_budget(self, added: list[tuple[int, int]]) -> None:
        """Refuse a load past the budget before anything is read or allocated."""
        if self.budget_bytes is None or not added:
            return
        held = self.weight_bytes()
        extra = self.expert_bytes(added)
        if held + extra > self.budget_bytes:
            raise OverBudget(
                f"loading {len(added)} experts ({extra} bytes) would take this group's expert weights from "
                f"{held} to {held + extra} bytes, over its budget of {self.budget_bytes} bytes; "
                "unload experts first or place these on another group"
            )

    def load(self, pairs: list[tuple[int, int]], reload: bool = False) -> list[tuple[int, int]]:
        """Start holding ``pairs``; returns those read from disk: the ones not held before, and with
        ``reload`` the held ones too (their statistics and fingerprints start afresh)."""
        self._check_pairs(pairs)
        with self._lock:
            added = sorted(set(pairs) - set(self.pairs()))
            self._check_budget(added)
            read = sorted(set(pairs)) if reload else added
            changed = {}
            for layer in sorted({layer for layer, _ in read}):
                held = set(self._layers[layer].ids) if layer in self._layers else set()
                reread = {e for l, e in read if l == layer}
                changed[layer] = self._build(layer, sorted(held | reread), reread)
            self._publish(changed)
            return read

    def unload(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Stop holding ``pairs``; returns those that were held. Their statistics go with them."""
        self._check_pairs(pairs)
        with self._lock:
            removed = sorted(set(pairs) & set(self.pairs()))
            changed = {}
            for layer in sorted({layer for layer, _ in removed}):
                keep = sorted(set(self._layers[layer].ids) - {e for l, e in removed if l == layer})
                changed[layer] = self._build(layer, keep, set())
            self._publish(changed)
            return removed

    def _publish(self, changed: dict[int, _LayerExperts | None]) -> None:
        """Swap in the changed layers (None: the layer is no longer held) with one assignment."""
        layers = {**self._layers, **changed}
        self._layers = MappingProxyType({layer: held for layer, held in layers.items() if held is not None})

    def _build(self, layer: int, ids: list[int], reread: set[int]) -> _LayerExperts | None:
        """A new module holding exactly ``ids``: rows already held are copied, new ones and ``reread``
        ones read from disk. Reads the published layer but changes nothing a concurrent compute may see."""
        if not ids:
            return None
        old = self._layers.get(layer)
        old_row = {e: i for i, e in enumerate(old.ids) if e not in reread} if old is not None else {}
        new_ids = [e for e in ids if e not in old_row]
        fresh = self.checkpoint.expert_weights(layer, new_ids, self.dtype) if new_ids else {}
        module = copy.deepcopy(self._templates[layer]).to_empty(device=self.device)
        module.requires_grad_(False)
        for name in self.spec.expert_params:
            rows = [
                getattr(old.module, name)[old_row[e]] if e in old_row else fresh[name][new_ids.index(e)].to(self.device)
                for e in ids
            ]
            stacked = _stored(torch.stack(rows), module, self.device)  # [len(ids), ...]
            module._parameters[name] = nn.Parameter(stacked, requires_grad=False)
        module.num_experts = len(ids)
        local_of = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
        local_of[ids] = torch.arange(len(ids))
        stats = {e: old.stats[e] if e in old_row else OutputStats() for e in ids}
        built = _LayerExperts(
            module, tuple(ids), local_of.to(self.device), MappingProxyType(stats), MappingProxyType({})
        )
        prints = {e: old.fingerprints[e] if e in old_row else fingerprint(built.rows_of(e)) for e in ids}
        fast = matches_stock(module, self.spec.hidden_size, self.dtype, self.device)
        packs, silu_glu = None, False
        if fast and self.linear_kernel == "onednn-packed":
            names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
            if self.grouped and usable(module, self.device, self.dtype):
                grouped = {name: GroupedRows(getattr(module, name), module.is_transposed) for name in names}
                packs = grouped if agrees(module, self.spec.hidden_size, grouped) else None
                silu_glu = packs is not None and fuses(module, self.spec.hidden_size, grouped)
            if packs is None:
                packs = {name: PackedRows(getattr(module, name), module.is_transposed) for name in names}
        built = replace(built, fingerprints=MappingProxyType(prints), rows_fast=fast, packs=packs, silu_glu=silu_glu)
        self._warm(layer, built)
        return built

    def _warm(self, layer: int, held: _LayerExperts) -> None:
        """One decode-sized call through a module not yet published, every expert of it computing once, nothing
        recorded. An expert's first product in a new module costs several times a warm one (measured: 8 tokens
        over 5 experts 32 ms cold, 4 ms warm; any size warms every other), and a module built by a live move
        serves at once after the table switch: without this, that switch was a step stall on every router."""
        generator = torch.Generator().manual_seed(0)
        top_k = max(1, min(self.spec.top_k or 1, len(held.ids)))
        hidden, ids, weights = warm_up_call(held.ids, len(held.ids), top_k, self.spec.hidden_size, generator)
        self._computed(layer, held, hidden.to(self.device, self.dtype), ids, weights, record=False)

    # -- compute -------------------------------------------------------------------------

    def _check_request(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden_size:
            raise InvalidRequest(f"hidden_states must be [tokens, {self.spec.hidden_size}], got {list(hidden.shape)}")
        if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
            raise InvalidRequest(
                f"expert_ids must be [{hidden.shape[0]}, K] to match {hidden.shape[0]} tokens, "
                f"got {list(expert_ids.shape)}"
            )
        if weights.shape != expert_ids.shape:
            raise InvalidRequest(
                f"routing_weights {list(weights.shape)} must match expert_ids {list(expert_ids.shape)}"
            )
        if expert_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidRequest(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
        if not weights.is_floating_point():
            raise InvalidRequest(f"routing_weights must be floating point, got {weights.dtype}")
        tokens, columns = expert_ids.shape
        if columns > self.max_columns:
            raise InvalidRequest(
                f"expert_ids has {columns} columns; this model routes a token to at most {self.max_columns} experts "
                f"(top-k {self.spec.top_k} + {TOP_K_ALLOWANCE})"
            )
        if tokens * columns > self.max_rows:
            raise InvalidRequest(
                f"this Dispatch carries {tokens}x{columns} = {tokens * columns} (token, expert) slots, over this "
                f"group's cap of {self.max_rows}; split it into smaller calls"
            )
        for name, tensor in (("hidden_states", hidden), ("routing_weights", weights)):
            if not all_finite(tensor):
                bad = int((~torch.isfinite(tensor)).sum())
                raise InvalidRequest(f"{name} holds {bad} non-finite values (NaN or Inf)")

    def warm_up(self, tokens: Sequence[int] = WARM_UP_TOKENS) -> float:
        """One ``compute`` per held layer and per size in ``tokens``, through the same paths a Dispatch takes,
        recording no statistics; returns the seconds it took."""
        started = time.perf_counter()
        layers = self._layers
        generator = torch.Generator().manual_seed(0)
        top_k = min(self.spec.top_k or 1, self.spec.num_experts)
        for layer, held in sorted(layers.items()):
            for n in tokens:
                hidden, ids, weights = warm_up_call(held.ids, n, top_k, self.spec.hidden_size, generator)
                self.compute(layer, hidden.to(self.dtype), ids, weights, record=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def compute(
        self,
        layer: int,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        record: bool = True,
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, K] (global ids, -1 = empty), weights [T, K] -> partial sums [T, H].
        ``record=False``: the experts' statistics stay as they were (the warm-up's calls)."""
        self._check_request(hidden, expert_ids, weights)
        layers = self._layers  # the one snapshot this call uses
        held = layers.get(layer)
        if held is None:
            raise NotHosted(f"layer {layer} has no experts in this group (it holds layers {sorted(layers)})")

        hidden = hidden.to(self.device, self.dtype)
        return self._computed(layer, held, hidden, expert_ids, weights, record)

    def _computed(
        self,
        layer: int,
        held: _LayerExperts,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        record: bool = True,
    ) -> torch.Tensor:
        """``compute`` of a checked call on the hidden states in the group's device and dtype, by the path that fits
        its size and the module (each the same rows, sums and statistics)."""
        if held.silu_glu and weights.dtype == torch.float32:  # the whole call one kernel op
            partial, rows, local, row_weights, missing = grouped_call(
                hidden, expert_ids, weights, held.local_of, held.packs
            )
            if missing.numel():
                raise _not_held(layer, held, missing.tolist())
            if record and local.numel():
                self._record(held, local, row_weights, rows)
            return partial
        if expert_ids.numel() <= SMALL_RECORD_ROWS:  # a decode step: plain Python beats a dozen tiny ops
            return self._compute_small(layer, held, hidden, expert_ids, weights, record)
        token_idx, slot, local = self._pairs(layer, held, expert_ids)  # [S] each: one row per (token, expert) pair
        partial = torch.zeros_like(hidden)  # [T, H]
        if token_idx.numel():
            row_weights = weights.to(self.device)[token_idx, slot]  # [S]
            with torch.no_grad():
                if held.packs is not None:  # the stock loop's operations, its products on the packed kernel
                    pairs = hidden[token_idx], local.tolist(), row_weights.unsqueeze(1)  # [S, H], [S], [S, 1]
                    rows = held.rows(*pairs)  # [S, H]
                else:
                    # Each (token, expert) pair is its own row with top-k 1, so the stock eager loop sees
                    # no sentinels (GPT-OSS's has no slot for one) and computes every pair exactly once.
                    rows = held.forward(hidden[token_idx], local.unsqueeze(1), row_weights.unsqueeze(1))  # [S, H]
                add_rows(partial, token_idx, rows)
            if record:
                self._record(held, local, row_weights, rows)
        return partial

    def _compute_small(
        self,
        layer: int,
        held: _LayerExperts,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        record: bool = True,
    ) -> torch.Tensor:
        """``compute`` of a decode-sized call: the same rows in the same order, planned in plain Python, and
        through ``expert_rows.rows_forward`` where that gives the module's own bits (``rows_fast``)."""
        index = held.local_index
        pairs = [(t, k, e) for t, row in enumerate(expert_ids.tolist()) for k, e in enumerate(row) if e >= 0]
        missing = sorted({e for _, _, e in pairs if e not in index})
        if missing:
            raise _not_held(layer, held, missing)
        partial = torch.zeros_like(hidden)  # [T, H]
        if not pairs:
            return partial
        scale = weights.tolist()  # [T, K]
        local = [index[e] for _, _, e in pairs]  # [S]
        picked = [scale[t][k] for t, k, _ in pairs]  # [S]
        token_idx = torch.tensor([t for t, _, _ in pairs], dtype=torch.long, device=self.device)  # [S]
        row_weights = torch.tensor(picked, dtype=weights.dtype, device=self.device).unsqueeze(1)  # [S, 1]
        with torch.no_grad():
            if held.rows_fast:
                rows = held.rows(hidden[token_idx], local, row_weights)  # [S, H]
            else:
                local_rows = torch.tensor(local, dtype=torch.long, device=self.device).unsqueeze(1)  # [S, 1]
                rows = held.forward(hidden[token_idx], local_rows, row_weights)
            add_rows(partial, token_idx, rows)
        if record:
            self._record(held, torch.tensor(local), row_weights.squeeze(1), rows)
        return partial

    def _pairs(
        self, layer: int, held: _LayerExperts, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """expert_ids [T, K] -> the filled slots in row order: (token [S], slot [S], local row [S]).
        Raises NotHosted naming the ids this group does not hold."""
        expert_ids = expert_ids.to(self.device, torch.long)
        token_idx, slot = (expert_ids >= 0).nonzero(as_tuple=True)  # [S] each
        global_ids = expert_ids[token_idx, slot]  # [S]
        unknown = global_ids >= self.spec.num_experts
        local = held.local_of[global_ids.clamp(max=self.spec.num_experts - 1)]  # [S]
        missing = sorted(set(global_ids[unknown | (local < 0)].tolist()))
        if missing:
            raise _not_held(layer, held, missing)
        return token_idx, slot, local

    def _record(self, held: _LayerExperts, local: torch.Tensor, row_weights: torch.Tensor, rows: torch.Tensor) -> None:
        """Merge one call's output rows into each expert's statistics (``call_statistics``): local [S] local rows,
        row_weights [S], rows [S, H] weighted outputs."""
        table = per_expert(local, row_weights, rows, len(held.ids))
        with self._stats_lock:
            for e, rows_n, bad, normed, mean, m2 in table:
                held.stats[held.ids[e]].merge(rows_n, bad, normed, mean, m2)


def _not_held(layer: int, held: _LayerExperts, missing: list[int]) -> NotHosted:
    """The refusal of a call naming experts (``missing``, sorted) of ``layer`` this group does not hold."""
    return NotHosted(f"experts {missing} of layer {layer} are not held by this group (it holds {list(held.ids)})")


def warm_up_call(
    held: Sequence[int], tokens: int, top_k: int, hidden_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One warm-up call of ``tokens`` tokens over the ``held`` experts of a layer: (hidden [T, H] float32 from
    ``generator``, expert_ids [T, K] int64, routing weights [T, K] of 1/K). Token t chooses held experts
    t, t+1, ... (cycling), so every held expert computes once the call has at least len(held) - K + 1 tokens;
    K = min(top_k, len(held)), no expert twice in a row.

    Example: held (4, 6, 9), tokens 2, top_k 2 -> expert_ids [[4, 6], [6, 9]]."""
    k = max(1, min(top_k, len(held)))
    hidden = torch.randn(tokens, hidden_size, generator=generator)  # [T, H]
    ids = torch.tensor([[held[(t + j) % len(held)] for j in range(k)] for t in range(tokens)], dtype=torch.long)
    weights = torch.full((tokens, k), 1.0 / k)  # [T, K]
    return hidden, ids, weights
