"""The drift controller's settings, from ``EXPERTMESH_DRIFT_<FIELD>`` variables (e.g.
``EXPERTMESH_DRIFT_SCAN_INTERVAL_S=60``); ``--drift`` on ``expertmesh orchestrator``
and ``expertmesh up --orchestrator`` turns the loop on. The watermark defaults are
the field report's this product follows; the others are ours."""

from __future__ import annotations

import argparse

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from expertmesh.config.settings import add_loop_flag, loop_settings


class DriftConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_DRIFT_", extra="forbid")

    enabled: bool = Field(False, description="run the drift loop in the orchestrator (`--drift`)")
    scan_interval_s: float = Field(300.0, gt=0, description="seconds between the loop's scans")
    high_watermark: float = Field(
        0.90, gt=0, le=1, description="a group above this level (max of memory, busy) is too full"
    )
    low_watermark: float = Field(0.40, ge=0, lt=1, description="only groups below this level take experts")
    consecutive_scans: int = Field(3, ge=1, description="scans in a row a trigger must hold before anything moves")
    experts_per_move: int = Field(2, ge=1, description="least-used experts a full group gives away when it fires")
    cooldown_s: float = Field(
        1800.0, ge=0, description="an expert moved (by anyone) within this many seconds stays put"
    )
    min_window_tokens: float = Field(
        1000.0, ge=0, description="move nothing until the routers' load windows hold this many tokens (busiest layer)"
    )
    rebalance: bool = Field(False, description="also re-plan layers whose balancedness stays below rebalance_below")
    rebalance_below: float = Field(
        0.8, gt=0, le=1, description="balancedness (mean / max group load) that triggers a re-plan"
    )
    rebalance_min_gain: float = Field(
        0.05,
        ge=0,
        le=1,
        description="keep a layer whose balancedness is within this of the planner's (`plan --min-gain`)",
    )
    dry_run: bool = Field(False, description="decide and record, but never start a migration")
    measured_memory: bool = Field(
        True,
        description="a group's memory level is also its measured memory in use over its size (Describe: the GPU's "
        "used / total, or the process's resident bytes over its container's limit), when that is higher",
    )

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> "DriftConfig":
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"EXPERTMESH_DRIFT_LOW_WATERMARK ({self.low_watermark}) must be below "
                f"EXPERTMESH_DRIFT_HIGH_WATERMARK ({self.high_watermark})"
            )
        return self


def add_drift_argument(parser: argparse.ArgumentParser) -> None:
    add_loop_flag(parser, "--drift", DriftConfig, "run the drift controller: move experts off groups that stay full")


def drift_config(args: argparse.Namespace) -> DriftConfig:
    """The environment's settings, with the loop on when ``--drift`` was given; a bad setting is
    one line naming its variable."""
    return loop_settings(DriftConfig, args.drift)
