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

Scaling: per-router bytes far smaller, the store's inflow still linear in routers. Each router writes a pulse where
it wrote its whole window before (DeepSeek-V3's shape: 38 KB against 7.7 MB every 10 s, ``bench scale``) and a
detail once a window. A router's load and co-activation are dense once it has served a few thousand tokens (at a
fixed total traffic split over 8 times the routers, a DeepSeek-V3 pulse shrinks 17 %, a detail 28 %), so no form of
a router's own counts grows sub-linearly; that needs the routers' counts summed before the store. Not deltas
either: the store keeps each router's latest bytes (a hash field, last writer wins) and the drift loop reads every
300 s while routers write every 10 s, so a reader would miss 29 deltas in 30; deltas need an append log with a
cursor per reader.

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

__all__ = ["DETAIL_EVERY", "LoadPulse", "summed_details", "summed_pulses"]

log = logging.getLogger(__name__)

#: a router writes its detail on its first publish and every this many after (with a pulse each time): at the
#: default 10 s a publish, once a 600 s window, so about every token it counts is in one of its details
DETAIL_EVERY = 60


@dataclass(frozen=True, eq=False)
class LoadPulse:
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    load: np.ndarray  # [L, E] float64 tokens per expert over the window

    @classmethod
    def of(cls, window: LoadWindow) -> "LoadPulse":
        """The window's pulse now (sums its load buckets, nothing else)."""
        return cls(window.moe_layers, window.num_experts, window.top_k, window.load())

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            moe_layers=np.array(self.moe_layers, dtype=np.int64),
            shape=np.array([self.num_experts, self.top_k], dtype=np.int64),
            load=pack_counts(self.load),
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
        if load.shape != (len(moe_layers), num_experts):
            raise ValueError(f"a pulse's load is {load.shape}, not {len(moe_layers)} MoE layers x {num_experts}")
        return cls(moe_layers, num_experts, top_k, load)

    def __add__(self, other: "LoadPulse") -> "LoadPulse":
        if (self.moe_layers, self.num_experts) != (other.moe_layers, other.num_experts):
            raise ValueError("load pulses of different models cannot be added")
        return LoadPulse(self.moe_layers, self.num_experts, self.top_k, self.load + other.load)


Record = TypeVar("Record", LoadPulse, LoadSnapshot)


def summed_pulses(published: Mapping[str, bytes]) -> LoadPulse | None:
    """The routers' pulses (the store's ``loads()``: router id -> bytes) added up; None when there are none.
    A record that cannot be read, or is of another model than the first one read, is logged and left out."""
    return _summed(published, LoadPulse.from_bytes, "pulse")


def summed_details(published: Mapping[str, bytes]) -> LoadSnapshot | None:
    """The routers' details (the store's ``load_details()``) added up, as ``summed_pulses``."""
    return _summed(published, LoadSnapshot.from_bytes, "detail")


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
