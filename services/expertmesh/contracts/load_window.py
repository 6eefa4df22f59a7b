"""Expert load as the router sees it: tokens per expert and co-activation per
MoE layer over a sliding window, the placement planner's input.

Glossary
- *row*: the ordinal of an MoE layer among the model's MoE layers (DeepSeek-V3's
  dense first layers have none), the layer index of stats and placement files.
- *load[row, e]*: tokens that chose expert ``e``.
- *coactivation[row, e, f]*: tokens that chose both ``e`` and ``f`` (symmetric,
  zero diagonal).
- *position_load[row, p, e]*: of those, tokens at sequence positions in
  position bin ``p`` (``max_context / position_bins`` positions a bin), when the
  caller knows positions (the serving engine does), for heatmaps.
- *bucket*: ``window_s / buckets`` seconds of counts; the window is the last
  ``buckets`` of them, so old traffic ages out a bucket at a time.
- *domain_load[d][row, e]*: tokens of requests of query domain ``d`` (given by
  the client or classified) that chose expert ``e``, since the router started
  (not windowed: capability profiles are built from differences of it, which
  must not lose counts to ageing).
- *relative_load[row, r, e]*: tokens at relative position bin ``r`` that chose
  expert ``e``, where a token's relative position is its position / its
  sequence's final length (prompt + generated), in ``[0, 1)``, ``r =
  position * relative_bins // final_length``. Counted when a sequence finishes
  (``record_sequence``: the serving engine keeps each active sequence's choices
  until then), so only finished sequences are in it.
- *experts_per_token[q, h]*: tokens of finished sequences whose prompt length
  falls in query-length bucket ``q`` (``QUERY_LENGTH_EDGES``) that were served by
  ``h`` experts over all MoE layers together (``h <= L * (top_k + 1)``; active
  parameters per token = dense + ``h`` x parameters per expert).

A snapshot's bytes (``to_bytes``) are an ``.npz`` without pickles, so routers, the orchestrator and
``expertmesh stats export`` read the same bytes; what a router publishes to the state store, and how often,
is ``contracts.load_report``'s (the load alone often, the whole snapshot rarely).
"""

from __future__ import annotations

import bisect
import io
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch

from expertmesh.contracts.count_codec import pack_coactivation, pack_counts, unpack_coactivation, unpack_counts

#: domains counted apart at most: the published window's size must not grow with what clients send
MAX_DOMAINS = 256
#: bytes of JSON one GetLoadStats answer holds at most (gRPC's default message limit is 4 MiB)
STATS_PAGE_BYTES = 3 << 20
#: upper bounds (inclusive) of the query-length buckets of ``experts_per_token``: prompts of 1-16 tokens,
#: 17-64, 65-256, 257-1024, 1025-4096 and over 4096
QUERY_LENGTH_EDGES = (16, 64, 256, 1024, 4096)


def query_bucket(length: int, edges: tuple[int, ...] = QUERY_LENGTH_EDGES) -> int:
    """The bucket of a prompt of ``length`` tokens: the first edge at or above it (len(edges): above all)."""
    return bisect.bisect_left(edges, length)


def query_bucket_labels(edges: tuple[int, ...] = QUERY_LENGTH_EDGES) -> list[str]:
    """ "1-16", "17-64", ..., "4097+": each bucket's prompt lengths."""
    lows = [1, *(e + 1 for e in edges)]
    return [f"{low}-{high}" for low, high in zip(lows, edges)] + [f"{lows[-1]}+"]


def relative_bins(positions: np.ndarray, final_length: int, bins: int) -> np.ndarray:
    """[T] relative position bins of positions [T] in a sequence of ``final_length`` tokens:
    ``position * bins // final_length``, within ``0 .. bins - 1`` (bin r covers [r / bins, (r + 1) / bins))."""
    if final_length < 1:
        raise ValueError(f"a sequence's final length is at least 1, got {final_length}")
    return np.clip(np.asarray(positions, dtype=np.int64) * bins // final_length, 0, bins - 1)


@dataclass(frozen=True, eq=False)
class LoadSnapshot:
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    load: np.ndarray  # [L, E] float64
    coactivation: np.ndarray  # [L, E, E] float64
    position_load: np.ndarray  # [L, P, E] float64
    max_context: int
    domain_load: Mapping[str, np.ndarray] = field(default_factory=dict)  # domain -> [L, E] float64, since start
    relative_load: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))  # [L, R, E] float64
    experts_per_token: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [Q, H] float64
    query_length_edges: tuple[int, ...] = QUERY_LENGTH_EDGES

    def __post_init__(self):
        if self.relative_load.size == 0:  # (none recorded, or a router from before they were): no bins
            object.__setattr__(self, "relative_load", np.zeros((len(self.moe_layers), 0, self.num_experts)))

    def to_bytes(self) -> bytes:
        """The ``.npz`` (no pickles) of the whole snapshot: counts packed exactly (``count_codec``)."""
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            moe_layers=np.array(self.moe_layers, dtype=np.int64),
            shape=np.array([self.num_experts, self.top_k, self.max_context], dtype=np.int64),
            load=pack_counts(self.load),
            **pack_coactivation(self.coactivation),
            position_load=pack_counts(self.position_load),
            domains=np.array(sorted(self.domain_load), dtype=str),
            domain_load=pack_counts(np.stack([self.domain_load[d] for d in sorted(self.domain_load)]))
            if self.domain_load
            else np.zeros((0, *self.load.shape)),
            relative_load=pack_counts(self.relative_load),
            experts_per_token=pack_counts(self.experts_per_token),
            query_length_edges=np.array(self.query_length_edges, dtype=np.int64),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LoadSnapshot":
        """What ``to_bytes`` wrote, or an older router's window (dense float64 arrays, fewer of them)."""
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            num_experts, top_k, max_context = (int(v) for v in z["shape"])
            return cls(
                tuple(int(v) for v in z["moe_layers"]),
                num_experts,
                top_k,
                unpack_counts(z["load"]),
                unpack_coactivation(z, num_experts),
                unpack_counts(z["position_load"]),
                max_context,
                # routers from before domains (or per-sequence statistics) were counted publish no such arrays
                dict(zip((str(d) for d in z["domains"]), unpack_counts(z["domain_load"]))) if "domains" in z else {},
                unpack_counts(z["relative_load"]) if "relative_load" in z else np.zeros((0, 0, 0)),
                unpack_counts(z["experts_per_token"]) if "experts_per_token" in z else np.zeros((0, 0)),
                tuple(int(v) for v in z["query_length_edges"]) if "query_length_edges" in z else QUERY_LENGTH_EDGES,
            )

    def __add__(self, other: "LoadSnapshot") -> "LoadSnapshot":
        if (self.moe_layers, self.num_experts) != (other.moe_layers, other.num_experts):
            raise ValueError("load snapshots of different models cannot be added")
        return LoadSnapshot(
            self.moe_layers,
            self.num_experts,
            self.top_k,
            self.load + other.load,
            self.coactivation + other.coactivation,
            self.position_load + other.position_load,
            self.max_context,
            {
                d: self.domain_load.get(d, 0) + other.domain_load.get(d, 0)
                for d in sorted({*self.domain_load, *other.domain_load})
            },
            _sum(self.relative_load, other.relative_load),
            _sum(self.experts_per_token, other.experts_per_token),
            self.query_length_edges,
        )

    def to_stats_dict(self, rows: slice = slice(None)) -> dict:
        """The stats file format of ``expertmesh plan`` (rows = MoE layers in order), of ``rows`` of them."""
        layers = list(self.moe_layers)[rows]
        return {
            "num_layers": len(layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_layers": layers,
            "load": self.load[rows].tolist(),
            "coactivation": self.coactivation[rows].tolist(),
            "max_context": self.max_context,
            "position_load": self.position_load[rows].tolist(),
            "domain_load": {d: load[rows].tolist() for d, load in sorted(self.domain_load.items())},
            "relative_load": self.relative_load[rows].tolist(),
            "experts_per_token": self.experts_per_token.tolist(),
            "query_length_edges": list(self.query_length_edges),
        }

    def stats_page(self, first_row: int, max_rows: int = 0, max_bytes: int = STATS_PAGE_BYTES) -> tuple[str, int]:
        """(JSON of rows ``first_row``.. as ``to_stats_dict``, plus "first_row"; the next page's first row,
        0 after the last). The page holds as many rows as fit ``max_bytes`` (at least one), ``max_rows`` at most."""
        total = len(self.moe_layers)
        if not 0 <= first_row < max(total, 1):
            raise ValueError(f"first_row {first_row} is past the {total} MoE layers")
        end = min(total, first_row + max_rows) if max_rows else total
        per_row = max(len(json.dumps(self.to_stats_dict(slice(first_row, first_row + 1)))), 1)
        end = max(first_row + 1, min(end, first_row + max_bytes // per_row))
        page = {**self.to_stats_dict(slice(first_row, end)), "first_row": first_row}
        return json.dumps(page), end if end < total else 0


class LoadWindow:
    def __init__(
        self,
        moe_layers: tuple[int, ...],
        num_experts: int,
        top_k: int,
        window_s: float = 600.0,
        buckets: int = 4,
        clock: Callable[[], float] = time.monotonic,
        max_context: int = 4096,
        position_bins: int = 16,
        relative_bins: int = 16,
    ):
        self.moe_layers = tuple(moe_layers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.window_s = window_s
        self._row = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._bucket_s = window_s / buckets
        self._clock = clock
        L, E = len(self.moe_layers), num_experts
        # float32 keeps DeepSeek-V3 scale (58 x 256 x 256 per bucket) at 15 MiB a bucket
        self._load = np.zeros((buckets, L, E), dtype=np.float32)
        self._coact = np.zeros((buckets, L, E, E), dtype=np.float32)
        self.max_context = max_context
        self._bins = position_bins
        self._position = np.zeros((buckets, L, position_bins, E), dtype=np.float32)
        self._relative_bins = relative_bins
        self._relative = np.zeros((buckets, L, relative_bins, E), dtype=np.float32)
        #: experts one token is served by over all layers: 0 .. L * (top_k + 1) (a dynamic-k policy's extra one)
        self._per_token_width = L * (top_k + 1) + 1
        self._per_token = np.zeros((buckets, len(QUERY_LENGTH_EDGES) + 1, self._per_token_width), dtype=np.float32)
        self._epoch = np.full(buckets, -1, dtype=np.int64)  # which time slot each bucket holds
        self._since_start = np.zeros((L, E), dtype=np.float64)  # never ages out: monotonic metrics read it
        self._domains: dict[str, np.ndarray] = {}  # domain -> [L, E] float64 since start
        self._lock = threading.Lock()

    def _bucket(self) -> int:
        slot = int(self._clock() // self._bucket_s)
        b = slot % len(self._epoch)
        if self._epoch[b] != slot:  # reused: its counts are a window old
            self._load[b] = 0
            self._coact[b] = 0
            self._position[b] = 0
            self._relative[b] = 0
            self._per_token[b] = 0
            self._epoch[b] = slot
        return b

    def record(
        self,
        layer: int,
        top_k_index: torch.Tensor,
        positions: torch.Tensor | None = None,
        domains: tuple[torch.Tensor, tuple[str, ...]] | None = None,
    ) -> None:
        """top_k_index [T, K] global expert ids of MoE layer ``layer``; ids >= num_experts (expert-parallel
        sentinels) and negative ones are skipped.
        positions [T] (optional): sequence position of each token.
        domains (optional): (domain_ids [T] int64, -1 for none; the domain names they index)."""
        self.record_layers((layer,), top_k_index.detach().to("cpu", torch.long).numpy()[None], positions, domains)

    def record_layers(
        self,
        layers: tuple[int, ...],
        top_k_index: np.ndarray,
        positions: torch.Tensor | None = None,
        domains: tuple[torch.Tensor, tuple[str, ...]] | None = None,
    ) -> None:
        """``record`` of several MoE layers that routed the same T tokens (a serving step's), in one pass:
        top_k_index [L', T, K] int global expert ids, ``layers`` [L'] the MoE layers they are of (each once).
        The counts are ``record``'s layer by layer, to the bit: they are sums of ones."""
        # In numpy and once a step (not once a MoE layer): on the serving step's path, where each call costs
        # tens of microseconds whatever its size.
        E = self.num_experts
        ids = np.asarray(top_k_index, dtype=np.int64)  # [L', T, K]
        ids = np.where((ids < 0) | (ids > E), E, ids)  # [L', T, K]; E: the column that collects sentinels
        L, T = ids.shape[0], ids.shape[1]
        rows = [self._row[layer] for layer in layers]  # [L']
        onehot = np.zeros((L, T, E + 1), dtype=np.float32)  # [L', T, E+1]
        onehot[np.arange(L)[:, None, None], np.arange(T)[None, :, None], ids] = 1.0  # a repeated id counts once
        onehot = onehot[:, :, :E]  # [L', T, E]
        counts = onehot.sum(axis=1)  # [L', E]
        coact = onehot.transpose(0, 2, 1) @ onehot  # [L', E, E]
        coact[:, np.arange(E), np.arange(E)] = 0
        by_bin = None
        if positions is not None:
            # positions are never negative; np.clip would cost more than the rest of the bins together
            bins = np.minimum(
                positions.to("cpu", torch.long).numpy() * self._bins // self.max_context, self._bins - 1
            )  # [T]
            in_bin = np.zeros((T, self._bins), dtype=np.float32)  # [T, P]
            in_bin[np.arange(T), bins] = 1.0
            by_bin = in_bin.T @ onehot  # [L', P, E]
        by_domain = {}
        if domains is not None:
            domain_ids, names = domains
            domain_ids = domain_ids.to("cpu", torch.long).numpy()  # [T]
            for d, name in enumerate(names):
                by_domain[name] = onehot[:, domain_ids == d].sum(axis=1, dtype=np.float64)  # [L', E]
        with self._lock:
            b = self._bucket()
            # np.add.at: a layer listed twice counts twice, as two ``record`` calls would
            np.add.at(self._load[b], rows, counts)
            np.add.at(self._since_start, rows, counts)
            np.add.at(self._coact[b], rows, coact)
            if by_bin is not None:
                np.add.at(self._position[b], rows, by_bin)
            for name, counts_d in by_domain.items():
                if name not in self._domains and len(self._domains) >= MAX_DOMAINS:
                    name = name.split("/")[0]  # past the cap, a sub-domain counts under its top-level domain
                np.add.at(self._domains.setdefault(name, np.zeros(self._since_start.shape)), rows, counts_d)

    def record_sequence(
        self,
        layers: tuple[int, ...],
        experts: np.ndarray,
        first_position: int,
        final_length: int,
        query_length: int,
    ) -> None:
        """A finished sequence's choices: experts [L', T, K] global ids (>= num_experts: an empty slot) of its
        tokens at positions ``first_position`` .. + T - 1 in MoE layers ``layers`` (L' of them); its final
        length (prompt + generated) and its prompt's length (the query length)."""
        E, R, H = self.num_experts, self._relative_bins, self._per_token_width
        known = [i for i, layer in enumerate(layers) if layer in self._row]
        ids = np.minimum(np.asarray(experts, dtype=np.int64)[known], E)  # [L', T, K]; E: empty
        rows = np.array([self._row[layers[i]] for i in known], dtype=np.int64)  # [L']
        T = ids.shape[1] if ids.ndim == 3 else 0
        if T == 0:
            return
        bins = relative_bins(first_position + np.arange(T), final_length, R)  # [T]
        flat = (rows[:, None, None] * R + bins[None, :, None]) * (E + 1) + ids  # [L', T, K]
        by_bin = np.bincount(flat.ravel(), minlength=len(self.moe_layers) * R * (E + 1))
        by_bin = by_bin.reshape(len(self.moe_layers), R, E + 1)[:, :, :E]  # [L, R, E]
        served = (ids < E).sum(axis=(0, 2))  # [T] experts per token over the layers
        per_token = np.bincount(np.minimum(served, H - 1), minlength=H)  # [H]
        q = query_bucket(query_length)
        with self._lock:
            b = self._bucket()
            self._relative[b] += by_bin
            self._per_token[b, q] += per_token

    def since_start(self) -> np.ndarray:
        """[L, E] tokens per expert since the router started."""
        with self._lock:
            return self._since_start.copy()

    def _live(self) -> np.ndarray:
        """[buckets] bool: the buckets within the window now (call under the lock)."""
        current = int(self._clock() // self._bucket_s)
        return (self._epoch >= 0) & (self._epoch > current - len(self._epoch))

    def load(self) -> np.ndarray:
        """[L, E] float64 tokens per expert over the window: the snapshot's ``load`` without summing the rest."""
        with self._lock:
            return self._load[self._live()].sum(axis=0, dtype=np.float64)

    def snapshot(self) -> LoadSnapshot:
        with self._lock:
            live = self._live()
            return LoadSnapshot(
                self.moe_layers,
                self.num_experts,
                self.top_k,
                self._load[live].sum(axis=0, dtype=np.float64),
                self._coact[live].sum(axis=0, dtype=np.float64),
                self._position[live].sum(axis=0, dtype=np.float64),
                self.max_context,
                {d: load.copy() for d, load in self._domains.items()},
                self._relative[live].sum(axis=0, dtype=np.float64),
                self._per_token[live].sum(axis=0, dtype=np.float64),
            )


def _sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b, where an array without entries (a snapshot that recorded none) adds nothing."""
    if a.size == 0:
        return b
    if b.size == 0:
        return a
    return a + b
