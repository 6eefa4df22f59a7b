"""What a router publishes of its load window to the state store, and how readers add the routers up: a small
*pulse* every interval, the whole snapshot (the *detail*) seldom.

Glossary
- *pulse*: the window's tokens per expert, ``load`` [L, E], with the model's shape (``LoadPulse``): all the control
  loops read each scan (drift, capacity, ``kubectl expertmesh experts``, the chaos bench). Written every
  ``load_publish_s`` to the store's ``load`` hash. At most ``4 L E`` bytes of counts before compression (DeepSeek-V3's
  58 x 256: 59 KB; 38 KB compressed for a router's 600 s window at 1000 tokens/s).
- *detail*: the whole ``LoadSnapshot`` (``to_bytes``: co-activation as its upper triangle, positions, domains,
  relative positions, experts per token), written to the ``load_detail`` hash on a router's first publish, every
  ``DETAIL_EVERY``-th after it and when it stops: what ``expertmesh stats export`` reads, each router's window as of
  its last detail, at most ``DETAIL_EVERY x load_publish_s`` old (600 s at the defaults, the window's length). At
  most ``4 L (E (E - 1) / 2 + (P + R + D) E)`` bytes of counts plus ``experts_per_token``, ``D`` domains being at
  most ``MAX_DOMAINS`` plus the classifier taxonomy's top-level ones (3.7 MB compressed for the window above).
- *reader*: whoever adds the routers' records up (``summed_pulses``, ``summed_details``). Both records are whole
  states, not deltas: a reader that starts late, or reads seldom, is current at its first read. A reader that needs
  the load alone reads pulses and decompresses nothing else.

- *inflow budget*: the bytes a second the whole fleet of routers may write here (``load_inflow_budget_bytes_s``).
  Each router spaces its publishes so that, with as many routers as heartbeat in the store, they stay within it
  (``publish_interval_s``): every ``load_publish_s`` while the fleet is small, less often as it grows, never less
  often than every half window.
- *stale*: a record written more than ``STALE_AFTER_WINDOWS`` windows ago (the router's wall clock). Every count in
  it has left its window since, and a live router rewrites its record at least every half window, so a stale
  record is a router gone (crashed, or stopped and never restarted under its id): readers leave it out, and the
  orchestrator deletes it (``orchestrator.retention``). Without this the store kept every router that ever ran, and
  its last window counted for ever.

Scaling: the store's inflow is at most the budget whatever the number of routers. A router's own counts cannot
shrink with the fleet (its load and co-activation are dense once it has served a few thousand tokens: at a fixed
total traffic split over 8 times the routers, a DeepSeek-V3 pulse shrinks 17 %, a detail 28 %), and deltas would need
an append log with a cursor per reader (the store keeps each router's latest bytes, and the drift loop reads every
300 s while routers write every 10 s). What grows instead is a record's age: the records are whole windows, not
deltas, so a router publishing less often loses no count, only freshness. With the defaults (10 s, 512 KiB/s, 600 s
windows) at DeepSeek-V3's shape (38 KB pulses, a 3.7 MB detail every 60th, about 10 KB/s a router), routers publish
every 10 s up to about 50 of them, every 25 s at 128 and every 200 s at 1,024, still more often than the drift
loop's 300 s scan; details are ``DETAIL_EVERY`` publishes apart, so older in the same proportion.

Upgrades: a pulse reader reads a whole snapshot too (the same ``moe_layers``, ``shape`` and ``load`` members, and
only those are decompressed), so routers from before pulses keep counting in the control loops; ``stats export``
counts only routers that write details. Readers from before pulses cannot read them: upgrade the orchestrator
first.

Example::

    >>> p = LoadPulse((0, 1), 2, 1, np.array([[3.0, 1.0], [0.0, 4.0]]))
    >>> total = summed_pulses({"r1": p.to_bytes(), "r2": p.to_bytes()})
    >>> total.load.tolist()
    [[6.0, 2.0], [0.0, 8.0]]
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import reduce
from typing import TypeVar

import numpy as np

from expertmesh.contracts.count_codec import pack_counts, unpack_counts
from expertmesh.contracts.load_window import LoadSnapshot, LoadWindow

__all__ = [
    "DETAIL_EVERY",
    "STALE_AFTER_WINDOWS",
    "LoadPulse",
    "publish_interval_s",
    "stale_routers",
    "summed_details",
    "summed_pulses",
]

log = logging.getLogger(__name__)

#: a router writes its detail on its first publish and every this many after (with a pulse each time): at the
#: default 10 s a publish, once a 600 s window, so about every token it counts is in one of its details
DETAIL_EVERY = 60

#: a record written longer ago than this many of its windows is a router gone: twice the window, so a live router
#: (which rewrites its record every half window at the least) is never taken for one under clocks some minutes apart
STALE_AFTER_WINDOWS = 2.0


def publish_interval_s(
    base_s: float, routers: int, bytes_per_publish: float, budget_bytes_s: float, window_s: float
) -> float:
    """Seconds between one router's publishes so that ``routers`` routers writing ``bytes_per_publish`` each time
    (a pulse, plus its share of the detail every ``DETAIL_EVERY``-th) put at most ``budget_bytes_s`` into the store:
    ``base_s`` while that is within the budget, longer as the fleet grows, at most half the window (beyond that the
    budget is exceeded rather than a live router's record let go stale). ``budget_bytes_s`` 0: no budget.

    >>> publish_interval_s(10.0, 128, 100_000.0, 512 * 1024, 600.0)
    24.4140625
    >>> publish_interval_s(10.0, 16, 100_000.0, 512 * 1024, 600.0), publish_interval_s(10.0, 10**6, 1e5, 1.0, 600.0)
    (10.0, 300.0)
    """
    if budget_bytes_s <= 0:
        return base_s
    spaced = max(1, routers) * max(0.0, bytes_per_publish) / budget_bytes_s
    return max(base_s, min(spaced, window_s / 2))


@dataclass(frozen=True, eq=False)
class LoadPulse:
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    load: np.ndarray  # [L, E] float64 tokens per expert over the window
    #: wall-clock seconds the router wrote it, and its window's length (0: unknown, a router from before they were
    #: written; such a record is never stale)
    written_at: float = 0.0
    window_s: float = 0.0

    @classmethod
    def of(cls, window: LoadWindow, written_at: float) -> "LoadPulse":
        """The window's pulse now (sums its load buckets, nothing else), stamped with the wall clock."""
        return cls(window.moe_layers, window.num_experts, window.top_k, window.load(), written_at, window.window_s)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            moe_layers=np.array(self.moe_layers, dtype=np.int64),
            shape=np.array([self.num_experts, self.top_k], dtype=np.int64),
            load=pack_counts(self.load),
            written=np.array([self.written_at, self.window_s], dtype=np.float64),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LoadPulse":
        """A pulse, or the load of a whole snapshot's bytes (``LoadSnapshot.to_bytes``, an older router's window)
        without decompressing the rest of it."""
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            moe_layers = tuple(int(v) for v in z["moe_layers"])
            num_experts, top_k = (int(v) for v in z["shape"][:2])
            load = unpack_counts(z["load"])
            written_at, window_s = _written(z)
        if load.shape != (len(moe_layers), num_experts):
            raise ValueError(f"a pulse's load is {load.shape}, not {len(moe_layers)} MoE layers x {num_experts}")
        return cls(moe_layers, num_experts, top_k, load, written_at, window_s)

    def __add__(self, other: "LoadPulse") -> "LoadPulse":
        if (self.moe_layers, self.num_experts) != (other.moe_layers, other.num_experts):
            raise ValueError("load pulses of different models cannot be added")
        return LoadPulse(
            self.moe_layers,
            self.num_experts,
            self.top_k,
            self.load + other.load,
            max(self.written_at, other.written_at),
            max(self.window_s, other.window_s),
        )


def _written(z) -> tuple[float, float]:
    """(written_at, window_s) of an opened record; (0, 0) for a record without them."""
    if "written" not in z.files:
        return 0.0, 0.0
    written_at, window_s = (float(v) for v in z["written"][:2])
    return written_at, window_s


Record = TypeVar("Record", LoadPulse, LoadSnapshot)


def stale_routers(pulses: Mapping[str, bytes], now: float) -> list[str]:
    """The routers whose pulse (the store's ``loads()``) is stale at wall-clock ``now``, sorted; reads each record's
    stamp alone (no counts decompressed). An unreadable record is not stale: ``summed_pulses`` logs it."""
    gone = []
    for router in sorted(pulses):
        try:
            with np.load(io.BytesIO(pulses[router]), allow_pickle=False) as z:
                written_at, window_s = _written(z)
        except (ValueError, KeyError, OSError, zipfile.BadZipFile):
            continue
        if written_at > 0 and now - written_at > STALE_AFTER_WINDOWS * window_s:
            gone.append(router)
    return gone


def summed_pulses(published: Mapping[str, bytes], now: float | None = None) -> LoadPulse | None:
    """The routers' pulses (the store's ``loads()``: router id -> bytes) added up; None when there are none.
    A record that cannot be read, or is of another model than the first one read, is logged and left out; given
    ``now`` (wall clock), so is a stale one."""
    return _summed(_fresh(published, published, now), LoadPulse.from_bytes, "pulse")


def summed_details(
    published: Mapping[str, bytes], pulses: Mapping[str, bytes] | None = None, now: float | None = None
) -> LoadSnapshot | None:
    """The routers' details (the store's ``load_details()``) added up, as ``summed_pulses``; given their ``pulses``
    and ``now``, without the details of routers whose pulse is stale (details carry no stamp of their own)."""
    return _summed(_fresh(published, pulses or {}, now), LoadSnapshot.from_bytes, "detail")


def _fresh(published: Mapping[str, bytes], pulses: Mapping[str, bytes], now: float | None) -> Mapping[str, bytes]:
    if now is None:
        return published
    gone = set(stale_routers(pulses, now))
    return {router: data for router, data in published.items() if router not in gone}


def _summed(published: Mapping[str, bytes], decode: Callable[[bytes], Record], what: str) -> Record | None:
    records = []
    for router in sorted(published):
        try:
            record = decode(published[router])
        except (ValueError, KeyError, OSError, zipfile.BadZipFile) as err:
            log.warning("leaving out router %r's unreadable load %s: %s", router[:64], what, err)
            continue
        if records and (record.moe_layers, record.num_experts) != (records[0].moe_layers, records[0].num_experts):
            log.warning("leaving out router %r's load %s: another model's shape than the others'", router[:64], what)
            continue
        records.append(record)
    return reduce(lambda a, b: a + b, records) if records else None
