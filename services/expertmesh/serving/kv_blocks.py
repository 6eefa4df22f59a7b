"""The KV block allocator: which block of the pool holds what. Pure bookkeeping on plain data, no tensors.

Glossary
- *block*: ``block_size`` consecutive token positions of one sequence, in every
  attention layer at once (``kv_cache.KVPool`` holds the tensors); identified by
  its index ``0 .. num_blocks - 1``.
- *block table*: a sequence's blocks in position order: position p lives in
  block ``table[p // block_size]`` at offset ``p % block_size``. Leading entries
  may be ``FREED``: blocks a sliding-window model's sequence gave back once every
  key its next tokens see lay past them.
- *reference count*: how many live sequences' tables hold a block. A block at
  zero is free: on the free list, or, when it holds a cached prefix, *evictable*.
- *prefix scope*: everything besides its tokens that a block's keys and values
  were computed under: the checkpoint, the routing policy, the router's routing
  epoch (it changes whenever a quarantine, repair or release changes what an
  expert computes) and the request's cache salt (``PrefixScope``). Requests of
  different scopes share nothing.
- *prefix hash*: a full block of prompt tokens is named by the SHA-256 digest of
  the digest before it (the scope's, for the first block) and its tokens, so equal
  hashes mean equal scopes and equal prompts up to the block's end, hence equal keys
  and values in every layer. A digest, not Python's ``hash()``: a client must not
  be able to craft a prompt whose block collides with another's (vLLM's advisory
  GHSA-rm76-4mrf-v9r8).
- *prefix cache*: prefix hash -> the block that holds it. A sequence whose prompt
  starts with cached blocks takes them into its table (reference counted) rather
  than computing them again. Evictable blocks are reused least recently used first.

Example: ``pool = BlockPool(4)``; ``a = pool.allocate(2)`` -> ``[0, 1]``;
``pool.publish(0, h)``; ``pool.release(a)`` leaves block 0 evictable under ``h``;
``pool.match([h, h2])`` -> ``[0]`` (referenced again), ``pool.available()`` -> 3.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["BlockPool", "FREED", "PoolExhausted", "PrefixScope", "blocks_for", "prefix_hashes"]

#: a block-table entry whose block was given back (see the glossary)
FREED = -1

#: a prefix hash: a SHA-256 digest (32 bytes)
PrefixHash = bytes


@dataclass(frozen=True)
class PrefixScope:
    """What a block was computed under besides its tokens (see the glossary). Example:
    ``PrefixScope("3f2a9c0d1e4b5a67", "exact", 2, "tenant-a").root()`` -> 32 bytes."""

    #: the checkpoint's fingerprint
    model: str
    #: the routing policy's key (only exact routing is cached today)
    routing: str
    #: the router's routing epoch (``RoutingView.epoch``)
    epoch: int
    #: the request's ``cache_salt`` ("" : none)
    salt: str = ""

    def root(self) -> PrefixHash:
        """The digest the hash chain of a prompt under this scope starts from. Each part is length-prefixed,
        so no two scopes encode alike."""
        digest = hashlib.sha256(b"expertmesh-prefix-v1")
        for part in (self.model, self.routing, str(self.epoch), self.salt):
            raw = part.encode()
            digest.update(struct.pack("<I", len(raw)) + raw)
        return digest.digest()


class PoolExhausted(Exception):
    """Fewer free blocks than asked for (the engine preempts or waits; never shown to a user)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-tokens // block_size)


def prefix_hashes(tokens: Sequence[int], block_size: int, root: PrefixHash) -> list[PrefixHash]:
    """The prefix hash of each full block of ``tokens`` (a partial last block has none), chained from ``root``
    (``PrefixScope.root``): block i's is SHA-256(hash of block i - 1, its tokens as little-endian uint32)."""
    out, prefix = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prefix = hashlib.sha256(prefix + struct.pack(f"<{block_size}I", *tokens[start : start + block_size])).digest()
        out.append(prefix)
    return out


@dataclass
class BlockPool:
    """Reference counts, the free list and the prefix cache of ``num_blocks`` blocks."""

    num_blocks: int
    _free: deque[int] = field(init=False)
    _refs: list[int] = field(init=False)
    _cached: dict[PrefixHash, int] = field(default_factory=dict)  # prefix hash -> block
    _hash_of: dict[int, PrefixHash] = field(default_factory=dict)  # block -> its prefix hash
    _evictable: OrderedDict[int, None] = field(default_factory=OrderedDict)  # cached, unreferenced, oldest use first

    def __post_init__(self) -> None:
        self._free = deque(range(self.num_blocks))
        self._refs = [0] * self.num_blocks

    def available(self) -> int:
        """Blocks ``allocate`` can hand out now (free ones and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.available()

    def cached(self) -> int:
        """Blocks that hold a cached prefix (held or evictable)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with reference count 1; evicts cached prefixes, least recently used first."""
        if n > self.available():
            raise PoolExhausted(f"{n} KV blocks asked for, {self.available()} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence let go of ``blocks``; those no one holds any more become free (evictable if cached)."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"KV block {block} released more often than taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None  # most recently used: evicted last
                else:
                    self._free.append(block)

    def match(self, hashes: Sequence[PrefixHash]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first, each now referenced once more."""
        out = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            out.append(block)
        return out

    def publish(self, block: int, prefix_hash: PrefixHash) -> bool:
        """Offer ``block`` (held, full, written) as the cached holder of ``prefix_hash``. False when
        another block holds that prefix already or ``block`` holds another: nothing changes then."""
        if prefix_hash in self._cached or block in self._hash_of:
            return False
        self._cached[prefix_hash] = block
        self._hash_of[block] = prefix_hash
        return True

    def refs(self, block: int) -> int:
        return self._refs[block]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: the unreferenced cached blocks become free, the held ones stay their
        sequences' and are freed when let go. Returns the prefixes forgotten."""
        forgotten = len(self._cached)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
        return forgotten
