"""The KV cache manager: which cache slots each request's past occupies, and which prompt blocks the prefix cache
keeps. Two implementations behind one interface (``KVCacheManager``), chosen by the engine for the model:

- ``PagedKVCacheManager``: the packed step's pool (``kv_blocks.BlockPool`` for the bookkeeping, ``kv_cache.KVPool``
  for the tensors, allocated up front): a block table per request, admission by blocks, prefix caching, sliding
  windows giving back their blocks;
- ``DynamicKVCacheManager``: the per-sequence fallback: a transformers ``DynamicCache`` per request.

It touches no model and schedules nothing: the scheduler asks it whether a request fits and for the blocks of
its next tokens; the model runner reads a request's cache (``cache_of``); after a step the scheduler offers the
request's computed prompt blocks to the prefix cache (``cache_computed``) and frees the finished.

Glossary (the pool's: ``serving.kv_blocks``)
- *block table*: a request's blocks in position order; leading entries ``FREED`` once a sliding-window model's
  request gave them back.
- *cached blocks* (``RequestBlocks.num_cached``): its leading prompt blocks the prefix cache holds (shared or
  offered by it).
- *cacheable*: its computed blocks may still be offered: no step of it since it was admitted ran in another
  routing epoch than its prefix hashes name, or served a token of it by a quarantine fallback (degraded).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
from transformers import DynamicCache

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.serving.kv_blocks import FREED, BlockPool, PoolExhausted, PrefixScope, blocks_for, prefix_hashes
from expertmesh.serving.kv_cache import KVPool, auto_cache_bytes, layer_shapes, token_bytes
from expertmesh.serving.request import GenerationRequest, Request

__all__ = ["DynamicKVCacheManager", "KVCacheManager", "KVUsage", "PagedKVCacheManager", "RequestBlocks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVUsage:
    """The KV pool at the latest step boundary (``Engine.kv_usage``)."""

    blocks_total: int
    blocks_used: int
    block_size: int
    #: allocated slots no token fills yet (the rest of each request's last block, reserved prompt) / allocated
    fragmentation: float
    blocks_used_peak: int = 0
    preemptions: int = 0
    #: prompt tokens looked up in the prefix cache, and those found there
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass
class KVCounters:
    """Since start (the metrics' totals): prompt tokens looked up in the prefix cache and found, blocks held at
    most, requests preempted for blocks."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    peak_blocks: int = 0
    preemptions: int = 0


class KVCacheManager(Protocol):
    """What the scheduler, the model runner and the engine need of a KV cache (see the module)."""

    block_size: int

    def check_fits(self, params: GenerationRequest, max_context: int) -> None:
        """InvalidRequest when the whole cache could never hold ``params`` (it would wait for ever)."""

    def admit(self, request: Request, epoch: int) -> bool:
        """Give ``request`` the cache of all its tokens so far (cached prefix blocks first, setting its computed
        tokens to theirs); False, and nothing taken, when they do not fit now. ``epoch``: the routing epoch it
        is admitted in."""

    def blocks_needed(self, request: Request) -> int:
        """Blocks ``request`` lacks for its tokens so far (0: none)."""

    def available(self) -> int:
        """Blocks free to take now."""

    def grow(self, request: Request, blocks: int) -> None:
        """``blocks`` more for ``request`` (``blocks_needed`` of them, checked against ``available``)."""

    def slide(self, request: Request) -> None:
        """Give back the blocks wholly behind the window its next token sees (a sliding-window model's)."""

    def free(self, request: Request, preempted: bool = False) -> None:
        """Let go of everything ``request`` holds (finished, failed, or ``preempted``: counted)."""

    def cache_of(self, request: Request) -> list[int] | DynamicCache:
        """What the model runner computes ``request``'s tokens with: its block table, or its own cache."""

    def cache_computed(self, request: Request, step_epoch: int | None, degraded: bool) -> None:
        """After a step of ``request`` (in routing epoch ``step_epoch``, None: unknown; ``degraded``: a token
        of it was served by a quarantine fallback), offer its computed prompt blocks to the prefix cache."""

    def rollback(self, request: Request) -> None:
        """``request``'s computed tokens went back (the consistency guard computes one again)."""

    def usage(self, running: list[Request]) -> KVUsage | None:
        """The pool's use now (None: no pool)."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; the prefixes forgotten."""


@dataclass
class RequestBlocks:
    """One request's share of the paged pool (see the glossary)."""

    table: list[int] = field(default_factory=list)
    num_freed: int = 0
    #: the prefix hash of each full block of its prompt, and the routing epoch they name (None: none computed)
    hashes: list[bytes] = field(default_factory=list)
    hashes_epoch: int | None = None
    num_cached: int = 0
    cacheable: bool = True


class PagedKVCacheManager:
    """The packed step's pool: ``num_blocks`` blocks of ``block_size`` slots (see the module)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        prefix_caching: bool = True,
        window: int | None = None,
        model_fingerprint: str = "",
    ):
        """``window``: tokens every layer sees when every layer is sliding-window (blocks behind it go back)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tensors = KVPool(num_blocks, block_size, device)
        self.prefix_caching = prefix_caching
        self.window = window
        self._fingerprint = model_fingerprint
        self._blocks: dict[Request, RequestBlocks] = {}
        self.counters = KVCounters()

    @classmethod
    def for_model(
        cls, model, block_size: int, cache_bytes: int | None, max_active: int, max_context: int, **kwargs
    ) -> "PagedKVCacheManager":
        """A pool of ``cache_bytes`` for ``model`` (None: ``kv_cache.auto_cache_bytes``, at most what ``max_active``
        requests of the whole context need)."""
        block_bytes = token_bytes(model.config.get_text_config(), model.dtype) * block_size
        if cache_bytes:
            num_blocks = cache_bytes // block_bytes
        else:  # no more than the count admission could ever fill
            num_blocks = min(
                auto_cache_bytes(model.device) // block_bytes, max_active * blocks_for(max_context, block_size)
            )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes {cache_bytes} holds no KV block: "
                f"one block of {block_size} tokens takes {block_bytes} bytes"
            )
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB)", num_blocks, block_size, num_blocks * block_bytes / 2**20)
        manager = cls(num_blocks, block_size, model.device, **kwargs)
        text = model.config.get_text_config()
        manager.tensors.allocate(text.num_hidden_layers, layer_shapes(text), model.dtype)
        return manager

    def _of(self, request: Request) -> RequestBlocks:
        return self._blocks.setdefault(request, RequestBlocks())

    def check_fits(self, params: GenerationRequest, max_context: int) -> None:
        tokens = min(len(params.prompt_ids) + (0 if params.score_only else params.max_new_tokens), max_context)
        size, total = self.block_size, self.pool.num_blocks
        if blocks_for(tokens, size) > total:
            raise InvalidRequest(
                f"the prompt ({len(params.prompt_ids)} tokens) and its new tokens need {blocks_for(tokens, size)} "
                f"KV blocks of {size} tokens; the KV pool (kv_cache_bytes) holds {total} ({total * size} tokens)"
            )

    def admit(self, request: Request, epoch: int) -> bool:
        size, tokens, blocks = self.block_size, request.num_tokens, self._of(request)
        routing = request.params.routing
        # A routing policy other than exact changes the gates, hence every later layer's keys and values: only
        # stock-routed prompts share blocks.
        stock_routed = routing is None or routing.policy.is_exact
        if self.prefix_caching and stock_routed and blocks.hashes_epoch != epoch:
            scope = PrefixScope(self._fingerprint, "exact", epoch, request.params.cache_salt)
            blocks.hashes, blocks.hashes_epoch = prefix_hashes(request.params.prompt_ids, size, scope.root()), epoch
        # Score wants every prompt position's logits, and at least one token must go through the model
        reusable = [] if request.needs_prompt_rows else blocks.hashes[: (tokens - 1) // size]
        shared = self.pool.match(reusable)
        try:
            own = self.pool.allocate(blocks_for(tokens, size) - len(shared))
        except PoolExhausted:
            self.pool.release(shared)
            return False
        self.counters.prefix_queries += len(reusable) * size
        self.counters.prefix_hits += len(shared) * size
        blocks.table, blocks.num_freed, blocks.num_cached = shared + own, 0, len(shared)
        blocks.cacheable = True  # its blocks are all computed (or matched) anew from here
        request.num_computed_tokens = len(shared) * size
        return True

    def blocks_needed(self, request: Request) -> int:
        return max(0, blocks_for(request.num_tokens, self.block_size) - len(self._of(request).table))

    def available(self) -> int:
        return self.pool.available()

    def grow(self, request: Request, blocks: int) -> None:
        self._of(request).table += self.pool.allocate(blocks)

    def slide(self, request: Request) -> None:
        if self.window is None:
            return
        blocks = self._of(request)
        drop = max(0, request.num_computed_tokens - self.window + 1) // self.block_size
        if drop > blocks.num_freed:
            self.pool.release(blocks.table[blocks.num_freed : drop])
            blocks.table[blocks.num_freed : drop] = [FREED] * (drop - blocks.num_freed)
            blocks.num_freed = drop

    def free(self, request: Request, preempted: bool = False) -> None:
        blocks = self._blocks.pop(request, None)
        if blocks is not None:
            self.pool.release(blocks.table[blocks.num_freed :])
        self.counters.preemptions += preempted

    def cache_of(self, request: Request) -> list[int]:
        return self._of(request).table

    def cache_computed(self, request: Request, step_epoch: int | None, degraded: bool) -> None:
        blocks = self._of(request)
        # Keys and values computed around a quarantined expert, or in another epoch than the one its prefix
        # hashes name (the quarantines changed between its admission and this step), are never shared.
        if step_epoch is None or step_epoch != blocks.hashes_epoch or degraded:
            blocks.cacheable = False
        if not self.prefix_caching or not blocks.cacheable:
            return
        full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        for j in range(max(blocks.num_cached, blocks.num_freed), min(full, len(blocks.hashes))):
            self.pool.publish(blocks.table[j], blocks.hashes[j])
        blocks.num_cached = max(blocks.num_cached, full)

    def rollback(self, request: Request) -> None:
        pass  # its slots past the computed tokens are written over by the next step

    def usage(self, running: list[Request]) -> KVUsage:
        used, size = self.pool.used(), self.block_size
        tables = [(r, self._of(r)) for r in running]
        allocated = sum(len(b.table) - b.num_freed for _, b in tables) * size
        unfilled = sum(len(b.table) * size - r.num_computed_tokens for r, b in tables)  # given-back blocks were full
        c = self.counters
        c.peak_blocks = max(c.peak_blocks, used)
        return KVUsage(
            self.pool.num_blocks,
            used,
            size,
            unfilled / allocated if allocated else 0.0,
            c.peak_blocks,
            c.preemptions,
            c.prefix_queries,
            c.prefix_hits,
        )

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    @contextmanager
    def scratch(self, blocks: int) -> Iterator[list[int]]:
        """``blocks`` blocks of the pool for a forward no request owns (the engine's warm-up), given back when the
        block exits: no request holds them, no counter counts them, none is offered to the prefix cache. Taken
        at a step boundary on the engine's thread, before it serves: no cached prefix is evicted then."""
        taken = self.pool.allocate(blocks)
        try:
            yield taken
        finally:
            self.pool.release(taken)


class DynamicKVCacheManager:
    """The per-sequence fallback's: a transformers ``DynamicCache`` per request, nothing shared, nothing bounded
    but the number of running requests."""

    block_size = 0

    def __init__(self, model_config):
        self._config = model_config
        self._caches: dict[Request, DynamicCache] = {}

    def check_fits(self, params: GenerationRequest, max_context: int) -> None:
        pass

    def admit(self, request: Request, epoch: int) -> bool:
        self._caches[request] = DynamicCache(config=self._config)
        request.num_computed_tokens = 0
        return True

    def blocks_needed(self, request: Request) -> int:
        return 0

    def available(self) -> int:
        return 0

    def grow(self, request: Request, blocks: int) -> None:
        pass

    def slide(self, request: Request) -> None:
        pass

    def free(self, request: Request, preempted: bool = False) -> None:
        self._caches.pop(request, None)

    def cache_of(self, request: Request) -> DynamicCache:
        return self._caches[request]

    def cache_computed(self, request: Request, step_epoch: int | None, degraded: bool) -> None:
        pass

    def rollback(self, request: Request) -> None:
        self._caches[request].crop(request.num_computed_tokens)

    def usage(self, running: list[Request]) -> None:
        return None

    def reset_prefix_cache(self) -> int:
        return 0
