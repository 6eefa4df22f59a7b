"""Expert capability profiles: how much each query domain uses each expert, per MoE layer.

Built from the router's token counts by (domain, layer, expert) (``LoadSnapshot.domain_load``) over a run
of labelled queries (``expertmesh profile build``), stored in the state store, read by the ``prefer`` and
``restrict`` routing policies.

Glossary
- *share[row, e]*: of the expert choices the domain's tokens made at MoE layer ``row``, the fraction that
  chose expert ``e`` (a row sums to 1).
- *overall share*: the same over every profiled domain together.
- *lift[row, e]*: share / overall share: 2 means the domain uses the expert twice as often as traffic in
  general; an expert no profiled traffic used has lift 1 (no evidence either way).

Pure: arrays in, arrays out; ``load_profiles`` / ``save_profiles`` beside them do the store I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from expertmesh.state import StateStore


@dataclass(frozen=True, eq=False)
class DomainProfile:
    domain: str
    moe_layers: tuple[int, ...]
    choices: np.ndarray  # [L] expert choices counted per layer
    share: np.ndarray  # [L, E]
    lift: np.ndarray  # [L, E]

    def row(self, layer: int) -> int:
        return self.moe_layers.index(layer)

    def to_json(self) -> str:
        return json.dumps(
            {
                "domain": self.domain,
                "moe_layers": list(self.moe_layers),
                "choices": self.choices.tolist(),
                "share": self.share.tolist(),
                "lift": self.lift.tolist(),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "DomainProfile":
        d = json.loads(text)
        return cls(
            d["domain"],
            tuple(d["moe_layers"]),
            np.asarray(d["choices"], dtype=np.float64),
            np.asarray(d["share"], dtype=np.float64),
            np.asarray(d["lift"], dtype=np.float64),
        )


def build_profiles(domain_load: Mapping[str, np.ndarray], moe_layers: tuple[int, ...]) -> dict[str, DomainProfile]:
    """domain -> load [L, E] (expert choices of its tokens) -> domain -> profile. Domains with no
    counts are left out."""
    loads = {d: np.asarray(v, dtype=np.float64) for d, v in domain_load.items() if np.asarray(v).sum() > 0}
    if not loads:
        return {}
    total = sum(loads.values())  # [L, E]
    overall = _shares(total)
    profiles = {}
    for domain, load in sorted(loads.items()):
        share = _shares(load)
        lift = np.divide(share, overall, out=np.ones_like(share), where=overall > 0)
        profiles[domain] = DomainProfile(domain, tuple(moe_layers), load.sum(axis=1), share, lift)
    return profiles


def _shares(load: np.ndarray) -> np.ndarray:
    """load [L, E] -> each row divided by its sum (a row of zeros stays zeros)."""
    sums = load.sum(axis=1, keepdims=True)
    return np.divide(load, sums, out=np.zeros_like(load), where=sums > 0)


def lookup(profiles: Mapping[str, DomainProfile], domain: str) -> DomainProfile | None:
    """The profile of ``domain``, or of its top level (``legal/contract`` -> ``legal``), or None."""
    return profiles.get(domain) or profiles.get(domain.split("/")[0])


def save_profiles(store: StateStore, profiles: Mapping[str, DomainProfile]) -> None:
    for domain, profile in profiles.items():
        store.save_profile(domain, profile.to_json().encode())


def load_profiles(store: StateStore) -> dict[str, DomainProfile]:
    return {domain: DomainProfile.from_json(raw) for domain, raw in store.profiles().items()}
