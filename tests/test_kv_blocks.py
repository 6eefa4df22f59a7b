"""The KV block allocator on plain data: allocation, reference counts, the prefix cache's hashes
and its least-recently-used eviction, exhaustion; and the automatic pool size's memory bound."""

import hashlib
import struct
from functools import partial

import pytest

from expertmesh.serving import kv_blocks
from expertmesh.serving.kv_blocks import BlockPool, PoolExhausted, PrefixScope, blocks_for

ROOT = PrefixScope("f00d", "exact", 0).root()
prefix_hashes = partial(kv_blocks.prefix_hashes, root=ROOT)


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_release_return_blocks_to_the_free_list():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.available() == 1 and pool.used() == 3
    pool.release(a[:2])
    assert pool.available() == 3
    b = pool.allocate(3)
    assert len(set(b)) == 3 and a[2] not in b, "a held block is never handed out twice"


def test_exhaustion_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(PoolExhausted, match="2 KV blocks asked for, 1 free of 2"):
        pool.allocate(2)
    assert pool.available() == 1


def test_a_block_released_more_often_than_taken_is_an_error():
    pool = BlockPool(1)
    pool.release(pool.allocate(1))
    with pytest.raises(ValueError, match="released more often"):
        pool.release([0])


def test_prefix_hashes_chain_the_blocks_before():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3, "the partial last block has no hash"
    b = prefix_hashes([1, 2, 3, 4, 9, 9], 2)
    assert a[:2] == b[:2] and a[2] != b[2]
    c = prefix_hashes([0, 0, 3, 4], 2)
    assert c[1] != a[1], "the same block after a different prefix is another prefix"


def test_a_prefix_hash_is_the_sha256_of_its_parent_and_its_tokens():
    """Collision resistant, as vLLM's fix of GHSA-rm76-4mrf-v9r8: Python's ``hash()`` of a token tuple is a
    64-bit value the same in every process, so a client could search for a prompt whose block collides with
    another tenant's and be served their keys and values."""
    first, second = prefix_hashes([7, 8, 9, 10], 2)
    assert first == hashlib.sha256(ROOT + struct.pack("<2I", 7, 8)).digest()
    assert second == hashlib.sha256(first + struct.pack("<2I", 9, 10)).digest()
    assert isinstance(first, bytes) and len(first) == 32


def test_every_part_of_the_scope_changes_every_hash():
    """The checkpoint, the routing, the routing epoch and the cache salt are each part of a block's name: the
    same tokens under another of any of them share nothing."""
    base = PrefixScope("f00d", "exact", 3, "a")
    scopes = [
        base,
        PrefixScope("beef", "exact", 3, "a"),
        PrefixScope("f00d", "prefer", 3, "a"),
        PrefixScope("f00d", "exact", 4, "a"),
        PrefixScope("f00d", "exact", 3, "b"),
        PrefixScope("f00d", "exact", 3, ""),
        PrefixScope("f00d", "exact3", 0, "a"),  # parts are length-prefixed: no two scopes encode alike
    ]
    chains = [kv_blocks.prefix_hashes([1, 2, 3, 4], 2, s.root()) for s in scopes]
    assert len({h for chain in chains for h in chain}) == 2 * len(scopes)
    assert kv_blocks.prefix_hashes([1, 2, 3, 4], 2, base.root()) == chains[0], "deterministic"


def test_shared_blocks_are_reference_counted():
    pool = BlockPool(3)
    (h,) = prefix_hashes([1, 2], 2)
    (block,) = pool.allocate(1)
    assert pool.publish(block, h)
    assert pool.match([h]) == [block] and pool.refs(block) == 2
    pool.release([block])
    assert pool.refs(block) == 1 and pool.available() == 2, "still held by the second sequence"
    pool.release([block])
    assert pool.refs(block) == 0 and pool.available() == 3 and pool.cached() == 1, "free, but still cached"
    assert pool.match([h]) == [block] and pool.available() == 2, "taken back from the evictable set"


def test_match_stops_at_the_first_missing_prefix():
    pool = BlockPool(4)
    h = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    blocks = pool.allocate(3)
    pool.publish(blocks[0], h[0])
    pool.publish(blocks[2], h[2])
    assert pool.match(h) == [blocks[0]]


def test_publish_keeps_the_first_holder_of_a_prefix():
    pool = BlockPool(2)
    (h,) = prefix_hashes([1, 2], 2)
    a, b = pool.allocate(2)
    assert pool.publish(a, h) and not pool.publish(b, h) and not pool.publish(a, h[::-1])
    pool.release([b])
    assert pool.cached() == 1 and pool.match([h]) == [a]


def test_a_reset_forgets_every_prefix_and_frees_the_unheld_blocks_only():
    pool = BlockPool(3)
    h = prefix_hashes([1, 1, 2, 2], 2)
    held, let_go = pool.allocate(2)
    assert pool.publish(held, h[0]) and pool.publish(let_go, h[1])
    pool.release([let_go])
    assert pool.available() == 2 and pool.cached() == 2
    assert pool.reset_prefix_cache() == 2
    assert pool.cached() == 0 and pool.match(h) == [] and pool.available() == 2 and pool.refs(held) == 1
    pool.release([held])  # no longer cached: it goes to the free list, not the evictable set
    assert pool.available() == 3 and pool.cached() == 0 and sorted(pool.allocate(3)) == [0, 1, 2]


def test_eviction_reuses_the_least_recently_used_cached_block_first():
    pool = BlockPool(3)
    h = prefix_hashes([1, 1, 2, 2, 3, 3], 2)
    blocks = pool.allocate(3)
    for block, prefix in zip(blocks, h):
        pool.publish(block, prefix)
    pool.release([blocks[1]])  # released first: least recently used
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert pool.match([h[0]]) == [blocks[0]]  # used again: now the most recent
    pool.release([blocks[0]])
    assert pool.allocate(1) == [blocks[1]]
    assert pool.match([h[1]]) == [], "an evicted block's prefix is gone from the cache"
    assert pool.allocate(1) == [blocks[2]] and pool.allocate(1) == [blocks[0]]
    assert pool.cached() == 0 and pool.available() == 0


def test_an_automatic_cpu_pool_stays_within_the_containers_memory_limit():
    from expertmesh.serving.kv_cache import host_free_bytes

    gib = 1 << 30
    assert host_free_bytes(64 * gib, None, None) == 64 * gib, "not in a cgroup v2 container"
    assert host_free_bytes(64 * gib, "max\n", f"{gib}\n") == 64 * gib, "a container without a limit"
    assert host_free_bytes(64 * gib, f"{8 * gib}\n", f"{3 * gib}\n") == 5 * gib, "a pod limited to 8 GiB, 3 in use"
    assert host_free_bytes(2 * gib, f"{8 * gib}\n", f"{gib}\n") == 2 * gib, (
        "the node has less free than the limit allows"
    )
    assert host_free_bytes(64 * gib, f"{gib}\n", f"{2 * gib}\n") == 0
