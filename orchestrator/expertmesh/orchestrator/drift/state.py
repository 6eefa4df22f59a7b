"""What the drift controller observes, remembers between scans and decides: plain
data, no I/O (the glossary is in the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.migration.state import Migration

Pair = tuple[int, int]

# -- observed ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSample:
    """One group's Describe answer at one scan."""

    group: str
    weight_bytes: int
    #: 0 = no budget
    budget_bytes: int
    #: cumulative seconds with a Dispatch computing since the group's server started
    busy_seconds: float
    #: bytes of one of its experts' weights (experts of one model are all alike); 0 when it holds none
    expert_bytes: int
    #: memory measured where it computes: bytes in use and the device's (or container's) size; 0: not measured
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0


@dataclass(frozen=True)
class ExpertLoad:
    layer: int
    expert: int
    #: tokens that chose it over the routers' load windows, every router summed
    tokens: float


@dataclass(frozen=True)
class Observation:
    #: wall-clock seconds of the scan
    at: float
    table: RoutingTable
    #: the groups that answered Describe
    groups: tuple[GroupSample, ...]
    #: every (layer, expert) the load windows count; empty when no router has published one
    loads: tuple[ExpertLoad, ...]
    #: the model's experts per token (0 when no router has published a load window)
    top_k: int
    #: every migration record in the store (running ones, and ended ones for the cooldown)
    migrations: tuple[Migration, ...]


# -- remembered ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BusySample:
    seconds: float
    at: float


@dataclass(frozen=True)
class DriftState:
    """What one scan leaves for the next. Fresh (all empty) at start: a restarted
    orchestrator counts its scans anew, which only delays a move."""

    #: group -> scans in a row above the high watermark
    scans_above: Mapping[str, int] = field(default_factory=dict)
    #: layer -> scans in a row below the rebalance threshold
    scans_below: Mapping[int, int] = field(default_factory=dict)
    #: group -> its busy-time counter at the last scan, to difference
    busy: Mapping[str, BusySample] = field(default_factory=dict)


# -- decided ---------------------------------------------------------------------------------


class Trigger(StrEnum):
    HIGH_WATERMARK = "high_watermark"
    REBALANCE = "rebalance"


class Hold(StrEnum):
    """Why a trigger that fired moves nothing."""

    #: a migration runs on the group, or the batch of moves in flight is full
    IN_FLIGHT = "in_flight"
    #: the load windows hold fewer than min_window_tokens tokens
    LOW_TRAFFIC = "low_traffic"
    #: every candidate expert moved within cooldown_s
    COOLDOWN = "cooldown"
    #: no group below the low watermark with room lacks the candidates
    NO_TARGET = "no_target"
    #: the planner keeps the layer as it is (gain below rebalance_min_gain)
    NO_GAIN = "no_gain"


@dataclass(frozen=True)
class Move:
    layer: int
    expert: int
    source: str
    target: str


@dataclass(frozen=True)
class Decision:
    trigger: Trigger
    #: one line a person can act on, with the figures behind it
    detail: str
    move: Move | None = None
    #: set exactly when ``move`` is None
    hold: Hold | None = None


@dataclass(frozen=True)
class GroupUtilisation:
    group: str
    #: the larger of weight_bytes / budget_bytes and the measured memory in use / its size (``DriftConfig.
    #: measured_memory``); None with neither a budget nor a measurement
    memory: float | None
    #: busy fraction since the previous scan; None on the first scan or after a restart
    busy: float | None
    weight_bytes: int
    budget_bytes: int
    #: scans in a row above the high watermark, this one included
    scans_above: int

    @property
    def level(self) -> float:
        return max(self.memory or 0.0, self.busy or 0.0)

    def describe(self) -> str:
        memory = "no budget" if self.memory is None else f"memory {self.memory:.0%}"
        busy = "busy ?" if self.busy is None else f"busy {self.busy:.0%}"
        return f"{self.group} ({memory}, {busy})"


@dataclass(frozen=True)
class LayerBalance:
    layer: int
    balancedness: float
    #: scans in a row below the rebalance threshold, this one included (0 when rebalance is off)
    scans_below: int


@dataclass(frozen=True)
class Scan:
    """One scan's figures and decisions."""

    groups: tuple[GroupUtilisation, ...]
    layers: tuple[LayerBalance, ...]
    window_tokens: float
    decisions: tuple[Decision, ...]
