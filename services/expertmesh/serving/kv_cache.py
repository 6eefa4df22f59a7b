"""The KV cache of the packed serving step: the paged pool's tensors and the step's view of them.

Glossary (blocks, block tables and the prefix cache: ``serving.kv_blocks``)
- *pool* (``KVPool``): per attention layer, the two tensors that layer hands to
  ``cache.update`` (keys and values, or DeepSeek-V3's compressed latent and
  rotary key, each with its own heads and width), preallocated for every slot:
  ``[num_blocks * block_size, heads, dim]`` each. Allocated up front from the
  model's config (``layer_shapes``), as vLLM allocates its KV cache at start; a
  layer whose first update brings other shapes (a family the config's formula
  does not describe) is allocated again from them, once, with a warning.
  Slot-major: a slot's heads side by side, so a read gathers one contiguous row
  per slot, and hands attention ``[1, heads, L, dim]`` views of the gathered
  rows. At 64 decoding sequences with ~150 tokens of past each, a step's gathers
  (torch profiler, 16 steps of the 214M Mixtral) took 12.7 ms head-major (a
  256-byte row per slot and head) and 9.7 ms slot-major (512-byte rows).
- *slot*: one token position of one block, ``block * block_size + offset``.
- *step cache* (``PackedCache``): what one packed forward gets as its ``cache``.
  Every attention layer calls ``update`` once with the step's new states of all
  sequences side by side (``[1, heads, T, dim]``), which it writes into their
  slots; ``serving.paged_attention`` then reads each sequence's own past with
  ``past`` (a gather of that sequence's slots: O(its length), nothing of the
  other sequences is touched).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

__all__ = [
    "KVPool",
    "PackedCache",
    "auto_cache_bytes",
    "host_free_bytes",
    "layer_shapes",
    "positions_and_slots",
    "token_bytes",
]

log = logging.getLogger(__name__)

#: of the memory there is when the engine starts, what an automatic pool takes: the host's
#: available memory on CPU, the device's free memory on a GPU (activations need the rest)
AUTO_FRACTION = {"cpu": 0.25, "cuda": 0.5}


def layer_shapes(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of the two tensors every attention layer of a model with text ``config`` caches per token:
    keys and values, or multi-head latent attention's latent and rotary key (one "head" each)."""
    if getattr(config, "kv_lora_rank", None):
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (heads, head_dim), (heads, head_dim)


def token_bytes(config, dtype: torch.dtype) -> int:
    """What one token's past costs in every attention layer of a model with text ``config``."""
    per_layer = sum(heads * width for heads, width in layer_shapes(config))
    return config.num_hidden_layers * per_layer * torch.empty((), dtype=dtype).element_size()


#: cgroup v2's memory limit and use of this process's container (absent outside one, or under v1)
CGROUP_MEMORY = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")


def auto_cache_bytes(device: torch.device) -> int:
    """The pool size when none is set: a fraction (``AUTO_FRACTION``) of what the device has free
    (on CPU, within the container's memory limit when there is one: a pod's limit, not the node's memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = host_free_bytes(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), *map(_read, CGROUP_MEMORY))
    return int(free * AUTO_FRACTION.get(device.type, AUTO_FRACTION["cpu"]))


def host_free_bytes(available: int, limit: str | None, current: str | None) -> int:
    """The host's ``available`` bytes, or less when the cgroup's ``limit`` ("max": none) minus its
    ``current`` use is less (both as cgroup v2 writes them; None: not in such a cgroup)."""
    if limit is None or current is None or limit.strip() == "max":
        return available
    return max(0, min(available, int(limit) - int(current)))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class KVPool:
    """The preallocated cache tensors of ``num_blocks`` blocks of ``block_size`` slots, per attention layer."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        # layer -> (first [slots, h, d1], second [slots, h', d2])
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: layers allocated again at their first update (the config's shapes were not theirs)
        self.reallocated: set[int] = set()

    def allocate(self, layers: int, shapes: tuple[tuple[int, int], tuple[int, int]], dtype: torch.dtype) -> None:
        """Every one of ``layers`` attention layers' two tensors, of (heads, width) ``shapes``, up front."""
        slots = self.num_blocks * self.block_size
        for layer in range(layers):
            self._layers[layer] = tuple(
                torch.empty((slots, heads, width), dtype=dtype, device=self.device) for heads, width in shapes
            )

    def write(self, layer: int, first: torch.Tensor, second: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``first``/``second`` [1, h, T, d] of ``layer`` in ``slots`` [T]."""
        held = self._layers.get(layer)
        if held is None or any(
            (t.shape[1], t.shape[2], t.dtype) != (new.shape[1], new.shape[3], new.dtype)
            for t, new in zip(held, (first, second))
        ):
            if held is not None:
                log.warning(
                    "KV pool: layer %d caches %s, not the %s its config describes; allocated again",
                    layer,
                    [tuple(n.shape[1::2]) for n in (first, second)],
                    [tuple(t.shape[1:]) for t in held],
                )
                self.reallocated.add(layer)
            self._layers[layer] = tuple(
                new.new_empty((self.num_blocks * self.block_size, new.shape[1], new.shape[3]))
                for new in (first, second)
            )
        for store, new in zip(self._layers[layer], (first, second)):
            store.index_copy_(0, slots, new[0].transpose(0, 1))  # [T, h, d] rows

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two tensors at ``slots`` [L], [1, h, L, d] each (a gather: a copy of L rows, [L, h, d], seen
        head-major)."""
        first, second = self._layers[layer]
        return first.index_select(0, slots).transpose(0, 1)[None], second.index_select(0, slots).transpose(0, 1)[None]

    def tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two tensors as the pool holds them, [slots, h, d] each (read in place by a kernel)."""
        return self._layers[layer]

    def bytes(self) -> int:
        """What the layers allocated so far hold."""
        return sum(t.numel() * t.element_size() for pair in self._layers.values() for t in pair)


def positions_and_slots(
    block_tables: np.ndarray, starts: np.ndarray, offsets: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """block_tables [B, M], starts [B], offsets [B + 1] -> (positions [N], slots [N]): sequence i's
    ``offsets[i + 1] - offsets[i]`` positions from ``starts[i]``, one sequence after another (at ``offsets[i]``),
    and the pool slot each is at. All sequences in one numpy pass: a call per sequence costs more than the
    arithmetic.

    Example: tables [[4, 7]], block size 4, start 2, offsets [0, 4] -> positions [2, 3, 4, 5],
    slots [18, 19, 28, 29]."""
    owner = np.repeat(np.arange(len(starts)), np.diff(offsets))  # [N] the sequence of each position
    positions = np.arange(offsets[-1]) - offsets[owner] + starts[owner]
    return positions, block_tables[owner, positions // block_size] * block_size + positions % block_size


def slots_at(block_tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """block_tables [B, M], positions [B, L] (row b's positions in sequence b) -> the pool slot of each, [B, L]
    (``positions_and_slots``' formula for rows of positions, each read through its own table).

    Example: tables [[4, 7]], block size 4, positions [[2, 5]] -> [[18, 29]]."""
    return np.take_along_axis(block_tables, positions // block_size, axis=1) * block_size + positions % block_size


class PackedCache:
    """The ``cache`` of one packed forward over the pool.

    ``write_slots`` [T]: where each of the step's tokens goes. A sequence's past is read through its block table
    (``block_tables`` [B, M], -1 where it holds no block) from its base (``read_bases`` [B]: past the blocks it
    gave back, else 0) to its end (``seq_lens`` [B]); ``read_slots`` [ΣL]: those slots of every step sequence,
    one sequence after another (sequence i's from ``past_offsets()[i]``), built only when a reader asks for them
    all (``pasts``): a kernel that reads the block tables in place (``block_tables``) needs no list of every past
    position's slot.
    """

    def __init__(
        self,
        pool: KVPool,
        write_slots: torch.Tensor,
        block_tables: np.ndarray,
        read_bases: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
    ):
        self._pool = pool
        self._write = write_slots
        self._tables = block_tables
        self._block_size = block_size
        self._lens = seq_lens
        self._bases = read_bases.tolist()
        self._offsets = np.concatenate([[0], np.cumsum(seq_lens - read_bases)]).tolist()  # [B + 1]
        self._pasts: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, first) -> its slots, for ``past``

    def update(
        self, first: torch.Tensor, second: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store first/second [1, h, T, d] in the step's slots; returns them as they came: the attention
        reads each sequence's past with ``past``."""
        self._pool.write(layer_idx, first, second, self._write)
        return first, second

    @functools.cached_property
    def _read(self) -> torch.Tensor:
        """read_slots [ΣL] (see the class)."""
        _, slots = positions_and_slots(
            self._tables, np.asarray(self._bases, dtype=np.int64), np.asarray(self._offsets), self._block_size
        )
        return torch.from_numpy(slots).to(self._pool.device)

    def _check_held(self, sequence: int, first: int) -> None:
        if first < self._bases[sequence]:
            raise ValueError(
                f"position {first} of step sequence {sequence} is in a block it gave back (from {self._bases[sequence]}"
                " on)"
            )

    def past(self, layer: int, sequence: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``sequence``-th sequence's past on ``layer`` from position ``first``, [1, h, L, d] each."""
        key = (sequence, first)
        if key not in self._pasts:  # the same for every layer of the step
            self._check_held(sequence, first)
            positions = np.arange(first, self._lens[sequence])[None, :]  # [1, L]
            slots = slots_at(self._tables[sequence : sequence + 1], positions, self._block_size)[0]  # [L]
            self._pasts[key] = torch.from_numpy(slots).to(self._pool.device)
        return self._pool.read(layer, self._pasts[key])

    def pasts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every step sequence's past on ``layer`` from its base, one after another, [1, h, ΣL, d] each."""
        return self._pool.read(layer, self._read)

    def past_offsets(self) -> list[int]:
        return self._offsets

    def padded_slots(self, sequences: list[int], firsts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The slots of step sequences ``sequences`` from positions ``firsts`` to their ends, right-padded with each
        one's last slot, [B, L]; and each one's length."""
        for sequence, first in zip(sequences, firsts):
            self._check_held(sequence, first)
        chosen, starts = np.asarray(sequences), np.asarray(firsts, dtype=np.int64)
        lengths = self._lens[chosen] - starts  # [B]
        # each row's positions, then its last one again
        positions = starts[:, None] + np.minimum(np.arange(lengths.max())[None, :], lengths[:, None] - 1)  # [B, L]
        slots = slots_at(self._tables[chosen], positions, self._block_size)  # [B, L]
        return torch.from_numpy(slots).to(self._pool.device), lengths.tolist()

    def block_tables(self, sequences: list[int]) -> torch.Tensor:
        """The block tables of step sequences ``sequences``, [B, M] int64 (-1 where a sequence holds no block):
        what a kernel reading the pool in place (``layer_pool``) is handed."""
        return torch.from_numpy(self._tables[sequences]).to(self._pool.device)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def write_slots(self) -> torch.Tensor:
        """[T] int64: the pool slot each of the step's new tokens' keys and values go to (``update``'s)."""
        return self._write

    def layer_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two pool tensors, [slots, h, d] each: where ``padded_slots``' slots point."""
        return self._pool.tensors(layer)

    def padded_pasts(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two tensors at ``slots`` [B, L], [B, h, L, d] each (one gather for the B sequences)."""
        batch, width = slots.shape
        first, second = self._pool.read(layer, slots.reshape(-1))  # [1, h, B*L, d] each
        return tuple(t[0].unflatten(1, (batch, width)).transpose(0, 1) for t in (first, second))
