"""The capacity controller's settings, from ``EXPERTMESH_CAPACITY_<FIELD>`` variables (e.g.
``EXPERTMESH_CAPACITY_REPLICATE_BELOW=0.85``); off by default, ``--capacity`` on ``expertmesh orchestrator`` and
``expertmesh up --orchestrator`` (or ``EXPERTMESH_CAPACITY_ENABLED=true``, the chart's ``orchestrator.capacity``)
turns it on."""

from __future__ import annotations

import argparse

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from expertmesh.config.settings import add_loop_flag, loop_settings

__all__ = ["CapacityConfig", "add_capacity_argument", "capacity_config"]


class CapacityConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_CAPACITY_", extra="forbid", frozen=True)

    enabled: bool = Field(False, description="run the capacity controller in the orchestrator (`--capacity`)")
    scan_interval_s: float = Field(60.0, gt=0, description="seconds between the controller's scans")
    replicate_below: float = Field(
        0.9, gt=0, le=1, description="a layer under this balancedness gets replicas of its busiest group's experts"
    )
    min_gain: float = Field(
        0.01, ge=0, le=1, description="a replica must raise (a retire may lower) a layer's balancedness by this"
    )
    max_changes_per_scan: int = Field(4, ge=0, description="replicate and retire migrations one scan starts")
    max_replicas_per_pair: int = Field(4, ge=1, description="replicas one expert may have")
    retire_below: float = Field(
        0.25, ge=0, lt=1, description="a replica is cold under this fraction of its layer's mean expert load"
    )
    memory_high: float = Field(
        0.9, gt=0, le=1, description="a target group's weights stay at or under this fraction of its budget"
    )
    cooldown_s: float = Field(600.0, ge=0, description="an expert migrated within this many seconds is left alone")
    min_window_tokens: float = Field(
        1000.0, ge=0, description="judge no replica until the routers' load windows hold this many tokens"
    )
    add_busy: float = Field(0.8, gt=0, le=1, description="groups busier on average than this advise a group added")
    remove_busy: float = Field(0.2, ge=0, lt=1, description="groups less busy on average than this advise one removed")
    scans: int = Field(3, ge=1, description="scans in a row a group advice must hold")
    group_cooldown_s: float = Field(900.0, ge=0, description="seconds between two group advices")
    min_groups: int = Field(1, ge=1, description="the controller never advises going below this many groups")
    act_on_groups: bool = Field(
        False,
        description="carry out group advice through the orchestrator's groups (AddGroup / RemoveGroup) where it "
        "can start groups; else the advice is logged only",
    )

    @model_validator(mode="after")
    def _busy_ordered(self) -> "CapacityConfig":
        if self.remove_busy >= self.add_busy:
            raise ValueError(
                f"EXPERTMESH_CAPACITY_REMOVE_BUSY ({self.remove_busy}) must be below "
                f"EXPERTMESH_CAPACITY_ADD_BUSY ({self.add_busy})"
            )
        return self


def add_capacity_argument(parser: argparse.ArgumentParser) -> None:
    add_loop_flag(
        parser, "--capacity", CapacityConfig, "run the capacity controller: replicas of hot experts, cold ones retired"
    )


def capacity_config(args: argparse.Namespace) -> CapacityConfig:
    """The environment's settings, with the controller on when ``--capacity`` was given; a bad setting is one line
    naming its variable."""
    return loop_settings(CapacityConfig, getattr(args, "capacity", None))
