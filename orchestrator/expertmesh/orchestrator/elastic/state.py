"""A group's lifecycle record and the checks a change must pass before anything starts. Pure: no I/O.

Example: ``checked_remove("g0", records, table)`` raises ``GroupChangeRefused`` when ``g0`` is the last group.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from expertmesh.contracts.errors import GroupChangeRefused, GroupNotFound, InvalidRequest
from expertmesh.contracts.routing_table import RoutingTable

__all__ = ["GroupPhase", "GroupRecord", "checked_add", "checked_remove", "next_group_name"]

#: a group name as routing tables, store keys and process names carry it
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class GroupPhase(StrEnum):
    STARTING = "starting"
    FILLING = "filling"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def in_flight(self) -> bool:
        """A change is under way: no other may start."""
        return self in (GroupPhase.STARTING, GroupPhase.FILLING, GroupPhase.DRAINING)


#: the phases each phase may go to
TRANSITIONS: dict[GroupPhase, frozenset[GroupPhase]] = {
    GroupPhase.STARTING: frozenset({GroupPhase.FILLING, GroupPhase.FAILED}),
    GroupPhase.FILLING: frozenset({GroupPhase.SERVING, GroupPhase.FAILED}),
    GroupPhase.SERVING: frozenset({GroupPhase.DRAINING}),
    GroupPhase.DRAINING: frozenset({GroupPhase.STOPPED, GroupPhase.FAILED}),
    GroupPhase.STOPPED: frozenset(),
    # a failed fill leaves a running group with what it got: it may be drained and removed
    GroupPhase.FAILED: frozenset({GroupPhase.DRAINING}),
}


@dataclass(frozen=True)
class GroupRecord:
    """One group as the orchestrator knows it. Times: wall-clock seconds since the epoch, 0 = not yet."""

    name: str
    phase: GroupPhase
    address: str = ""
    pid: int = 0
    #: one line a person can act on (why it failed, or what the last change did)
    reason: str = ""
    #: when the add or remove was asked for
    requested_at: float = 0.0
    #: when it registered (add) / when its last expert left it (remove)
    registered_at: float = 0.0
    #: when the first move onto it was switched in (a router may send it tokens from then on)
    first_listed_at: float = 0.0
    #: when the change finished (SERVING, STOPPED or FAILED)
    finished_at: float = 0.0
    moves_planned: int = 0
    moves_done: int = 0
    #: bytes of expert weights the change's moves copied (the planner's price)
    bytes_moved: int = 0
    #: the group process's exit status once STOPPED
    exit_code: int | None = None

    def entering(self, phase: GroupPhase, **changes) -> GroupRecord:
        if phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"group {self.name}: no transition from {self.phase} to {phase}")
        return replace(self, phase=phase, **changes)

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "phase": self.phase.value}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "GroupRecord":
        """Raises ValueError for a record this version cannot read (a field or phase it does not know)."""
        fields = json.loads(raw)
        try:
            return cls(**{**fields, "phase": GroupPhase(fields["phase"])})
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a group record: {err}") from None


def next_group_name(taken: Iterable[str]) -> str:
    """``g<N>``, N one above the highest ``g<n>`` in ``taken`` (g0 when none)."""
    numbers = [int(m.group(1)) for name in taken if (m := re.fullmatch(r"g(\d+)", name))]
    return f"g{max(numbers) + 1 if numbers else 0}"


def _no_change_in_flight(records: Mapping[str, GroupRecord]) -> None:
    busy = sorted(r.name for r in records.values() if r.phase.in_flight)
    if busy:
        record = records[busy[0]]
        raise GroupChangeRefused(
            f"group {record.name} is {record.phase} ({record.moves_done}/{record.moves_planned} moves); one group "
            "change at a time: wait for it (`expertmesh groups list`) and retry"
        )


def checked_add(name: str | None, records: Mapping[str, GroupRecord], endpoints: Iterable[str]) -> str:
    """The name the new group gets (``name``, or the next free ``g<N>``), given the known ``records`` and the
    groups the store lists. Raises InvalidRequest (a bad or taken name) or GroupChangeRefused (a change in flight)."""
    _no_change_in_flight(records)
    live = {n for n, r in records.items() if r.phase is not GroupPhase.STOPPED} | set(endpoints)
    if not name:
        return next_group_name(live | set(records))
    if not NAME.match(name):
        raise InvalidRequest(
            f"group name {name!r} is not valid: use 1-40 lower-case letters, digits and '-', starting and ending "
            "with a letter or digit"
        )
    if name in live:
        raise InvalidRequest(
            f"group {name!r} exists already; pick another name or leave it out (next: "
            f"{next_group_name(live | set(records))})"
        )
    return name


def checked_remove(name: str, records: Mapping[str, GroupRecord], table: RoutingTable | None) -> GroupRecord:
    """The record of the group to remove. Raises GroupNotFound (unknown or already stopped) or
    GroupChangeRefused (a change in flight, the last group, no routing table)."""
    record = records.get(name)
    if record is None or record.phase is GroupPhase.STOPPED:
        known = sorted(n for n, r in records.items() if r.phase is not GroupPhase.STOPPED)
        raise GroupNotFound(f"no running expert group {name!r}; the groups: {', '.join(known) or 'none'}")
    _no_change_in_flight(records)
    if table is None:
        raise GroupChangeRefused("no routing table in the state store yet; start the expert groups first")
    others = [n for n, r in records.items() if n != name and r.phase is GroupPhase.SERVING]
    if not others:
        raise GroupChangeRefused(
            f"group {name!r} is the last expert group; every expert needs one: add another group first "
            "(`expertmesh groups add`)"
        )
    return record
