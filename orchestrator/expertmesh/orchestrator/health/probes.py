"""The probe inputs: per MoE layer, the hidden states every replica of every
expert of that layer computes in a check.

Recorded when routers sample real traffic (``router.hidden_sample``,
``EXPERTMESH_HIDDEN_SAMPLE_TOKENS``), seeded otherwise (the fallback, and what a
deployment without traffic gets). A check's record says which it used.

A recorded sample is *pinned*: the monitor copies one into the state store's
``health_probes`` hash and probes with that same input round after round, so a
healthy replica's figures do not move at all and every change is its weights'
(the same property the seeded probe has). Every ``probe_refresh_s`` it pins a
fresh sample, in the round that judged every replica of the layer healthy on the
old one: each replica is probed on both, judged on the old, and given a new
baseline on the new (``HealthMonitor._rotate``), so a replica that went bad is
never re-baselined as it is now.

Pure parts (``seeded``, ``from_samples``, ``digest``) take tensors and return
them; ``recorded``, ``load_pinned`` and ``pin`` read and write the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from enum import StrEnum

import torch

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.store import StateStore
from expertmesh.store.samples import decode as decode_sample
from expertmesh.store.samples import encode as encode_sample

log = logging.getLogger(__name__)

#: fewer recorded rows than this make histograms of a handful of values: the seeded probe serves instead
MIN_RECORDED_ROWS = 16


class ProbeSource(StrEnum):
    RECORDED = "recorded"
    SEEDED = "seeded"


@dataclass(frozen=True, eq=False)
class Probe:
    layer: int
    #: [T, H]: as recorded (the router's dtype), or float32 seeded; cast to each group's dtype to send
    hidden: torch.Tensor
    source: ProbeSource
    #: identifies the input (``digest``): a baseline holds it, and compares only with checks on the same
    digest: str
    #: wall-clock seconds it was pinned; 0 for a seeded probe
    pinned_at: float = 0.0

    def to_bytes(self) -> bytes:
        """A JSON header line, then the tensor in ``state.samples``' form (no pickle)."""
        header = {"layer": self.layer, "source": self.source.value, "digest": self.digest, "pinned_at": self.pinned_at}
        return json.dumps(header).encode() + b"\n" + encode_sample(self.hidden)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Probe:
        head, _, body = raw.partition(b"\n")
        d = json.loads(head)
        return cls(
            d["layer"],
            decode_sample(body, f"pinned probe of layer {d['layer']}"),
            ProbeSource(d["source"]),
            d["digest"],
            d["pinned_at"],
        )


def digest(hidden: torch.Tensor, source: ProbeSource) -> str:
    """A short hash of the input's dtype, shape and bytes."""
    t = hidden.detach().contiguous()
    h = hashlib.sha256(f"{source}:{t.dtype}:{list(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def seeded(layer: int, hidden_size: int, tokens: int, seed: int) -> Probe:
    """[tokens, hidden_size] standard-normal hidden states seeded by ``seed + layer`` (RMS about 1 per row, as
    the normalisation before every supported MoE block makes them); the same arguments, the same probe."""
    generator = torch.Generator().manual_seed(seed + layer)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    return Probe(layer, hidden, ProbeSource.SEEDED, digest(hidden, ProbeSource.SEEDED))


def from_samples(layer: int, samples: list[torch.Tensor], tokens: int, at: float) -> Probe | None:
    """The routers' samples [rows_i, H] (one dtype, one H) -> at most ``tokens`` of their rows, evenly spread
    over them; None with fewer than MIN_RECORDED_ROWS rows in all."""
    if not samples:
        return None
    rows = torch.cat(samples)  # [R, H]
    if rows.shape[0] < MIN_RECORDED_ROWS:
        return None
    if rows.shape[0] > tokens:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, tokens).round().long()]
    return Probe(layer, rows, ProbeSource.RECORDED, digest(rows, ProbeSource.RECORDED), at)


def recorded(store: StateStore, layer: int, hidden_size: int, tokens: int, at: float) -> Probe | None:
    """A probe from what the routers published for ``layer`` (a sample that does not decode, or has another
    hidden size or dtype than the first, is left out with a warning)."""
    samples: list[torch.Tensor] = []
    for router, raw in sorted(store.hidden_samples(layer).items()):
        try:
            sample = decode_sample(raw, f"router {router}'s hidden-state sample of layer {layer}")
        except InvalidRequest as err:
            log.warning("health: %s", err)
            continue
        if sample.shape[1] != hidden_size or (samples and sample.dtype != samples[0].dtype):
            log.warning(
                "health: router %s's sample of layer %d is %s %s, not [rows, %d]%s; left out",
                router,
                layer,
                list(sample.shape),
                sample.dtype,
                hidden_size,
                f" {samples[0].dtype}" if samples else "",
            )
            continue
        samples.append(sample)
    return from_samples(layer, samples, tokens, at)


def load_pinned(store: StateStore, hidden_size: int) -> dict[int, Probe]:
    """layer -> its pinned probe (one that does not decode or has another hidden size is ignored)."""
    pinned = {}
    for field, raw in store.health_probes().items():
        try:
            probe = Probe.from_bytes(raw)
        except (InvalidRequest, ValueError, KeyError) as err:
            log.warning("health: pinned probe %s is unreadable, ignored: %s", field, err)
            continue
        if probe.hidden.shape[1] == hidden_size:
            pinned[probe.layer] = probe
    return pinned


def pin(store: StateStore, probe: Probe) -> None:
    store.save_health_probe(probe.layer, probe.to_bytes())
