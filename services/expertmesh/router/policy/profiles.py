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

Pure: arrays in, arrays out; ``load_profiles`` / ``save_profiles`` beside them do the store I/O, and
``read_profiles_file`` / ``write_profiles_file`` a file's: a JSON list of profile records, which
``expertmesh profile build --out`` writes and ``expertmesh up --profiles``, ``profile show --file`` and
``plan --profiles`` read (``read_profiles_file`` also takes an object of domain -> record, as
``profile show --json`` prints).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.store import StateStore

log = logging.getLogger(__name__)

FIELDS = ("domain", "moe_layers", "choices", "share", "lift")


class ProfileFileError(ExpertMeshError):
    """A profiles file cannot be read or written, is not a set of profiles, or fits another model."""


@dataclass(frozen=True, eq=False)
class DomainProfile:
    domain: str
    moe_layers: tuple[int, ...]
    choices: np.ndarray  # [L] expert choices counted per layer
    share: np.ndarray  # [L, E]
    lift: np.ndarray  # [L, E]

    def row(self, layer: int) -> int:
        return self.moe_layers.index(layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "moe_layers": list(self.moe_layers),
            "choices": self.choices.tolist(),
            "share": self.share.tolist(),
            "lift": self.lift.tolist(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> "DomainProfile":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, record: Any) -> "DomainProfile":
        """A record as ``to_dict`` writes it -> its profile, or ValueError saying which field is wrong."""
        return _checked_profile(record)


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
    """Every readable profile in ``store``; one that is not (a bad writer, another version) is logged and
    left out, so requests of the other domains are still served."""
    profiles = {}
    for domain, raw in store.profiles().items():
        try:
            profiles[domain] = DomainProfile.from_json(raw)
        except (ValueError, TypeError, KeyError) as err:  # json's and from_dict's: the record is unusable
            log.warning(
                "skipping the unreadable capability profile of domain %r in the state store: %s", domain[:64], err
            )
    return profiles


# -- the profiles file -------------------------------------------------------------------------


def write_profiles_file(path: str | Path, profiles: Mapping[str, DomainProfile]) -> None:
    records = [profiles[d].to_dict() for d in sorted(profiles)]
    try:
        Path(path).write_text(json.dumps(records) + "\n")
    except OSError as err:
        raise ProfileFileError(f"cannot write the profiles file {path}: {err.strerror}") from None


def read_profiles_file(path: str | Path) -> dict[str, DomainProfile]:
    """The profiles in ``path``, every record checked; anything wrong is one ProfileFileError line that
    names the file, the domain and the field."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ProfileFileError(f"profiles file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileFileError(f"profiles file {path}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ProfileFileError(f"profiles file {path}: not JSON ({err.msg}, line {err.lineno})") from None
    if isinstance(document, dict):
        document = list(document.values())
    if not isinstance(document, list) or not document:
        raise ProfileFileError(
            f"profiles file {path}: expected a non-empty JSON list of profile records "
            "(as `expertmesh profile build --out` writes)"
        )
    profiles: dict[str, DomainProfile] = {}
    for number, record in enumerate(document, 1):
        try:
            profile = DomainProfile.from_dict(record)
        except ValueError as err:
            name = record.get("domain") if isinstance(record, dict) else None
            where = f"profile {name!r}" if isinstance(name, str) and name.strip() else f"record {number}"
            raise ProfileFileError(f"profiles file {path}: {where}: {err}") from None
        if profile.domain in profiles:
            raise ProfileFileError(f"profiles file {path}: two profiles of {profile.domain!r}")
        profiles[profile.domain] = profile
    first, *rest = profiles.values()
    for other in rest:
        if other.moe_layers != first.moe_layers or other.share.shape != first.share.shape:
            raise ProfileFileError(
                f"profiles file {path}: the profiles of {first.domain!r} and {other.domain!r} "
                "were built on different models"
            )
    return profiles


def fit_problem(profiles: Mapping[str, DomainProfile], moe_layers: tuple[int, ...], num_experts: int) -> str | None:
    """Why ``profiles`` do not fit a model with these MoE layers and experts, or None."""
    for profile in profiles.values():
        if profile.moe_layers != tuple(moe_layers) or profile.share.shape[1] != num_experts:
            return (
                f"built on another model (MoE layers {list(profile.moe_layers)} x {profile.share.shape[1]} experts; "
                f"this one has MoE layers {list(moe_layers)} x {num_experts} experts)"
            )
    return None


def _checked_profile(record: Any) -> DomainProfile:
    """``DomainProfile.from_dict``: the store's records and a file's are read by this one check."""
    if not isinstance(record, dict):
        raise ValueError(f"expected an object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in record]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if not isinstance(record["domain"], str) or not record["domain"].strip():
        raise ValueError("domain must be a non-empty string")
    layers = record["moe_layers"]
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
        or len(set(layers)) != len(layers)
    ):
        raise ValueError("moe_layers must be a non-empty list of distinct layer numbers")
    L = len(layers)

    def numbers(name: str, ndim: int) -> np.ndarray:
        shape = f"[{L}]" if ndim == 1 else f"[{L} x experts]"
        try:
            values = np.asarray(record[name], dtype=np.float64)
        except (TypeError, ValueError):
            values = None
        if values is None or values.ndim != ndim or values.shape[0] != L or values.size == 0:
            raise ValueError(f"{name} must be a {shape} array of numbers (one row per MoE layer)")
        if not np.isfinite(values).all() or (values < 0).any():
            raise ValueError(f"{name} must hold finite numbers >= 0")
        return values

    choices, share, lift = numbers("choices", 1), numbers("share", 2), numbers("lift", 2)
    if lift.shape != share.shape:
        raise ValueError(f"lift is {lift.shape[0]} x {lift.shape[1]}, share {share.shape[0]} x {share.shape[1]}")
    sums = share.sum(axis=1)
    if not np.all(np.isclose(sums, 1.0, atol=1e-6) | (sums == 0)):
        raise ValueError("each row of share must sum to 1 (the layer's expert choices, as fractions)")
    return DomainProfile(record["domain"], tuple(layers), choices, share, lift)
