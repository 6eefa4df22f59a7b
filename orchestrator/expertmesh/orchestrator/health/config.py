"""The health monitor's settings, from ``EXPERTMESH_HEALTH_<FIELD>`` variables (e.g.
``EXPERTMESH_HEALTH_INTERVAL_S=60``); ``--health-monitor`` on ``expertmesh orchestrator``
and ``expertmesh up --orchestrator`` turns the loop on (``--health-port`` is another thing:
the plaintext gRPC health port). Interval and probe size are the
issue's; the thresholds are ours, set so that a replica computing what it computed
at its baseline (probes are deterministic: the figures of a healthy replica do not
move at all on one device) never trips them, while a scaled or overwritten expert does."""

from __future__ import annotations

import argparse

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from expertmesh.config.settings import add_loop_flag, loop_settings


class HealthConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_HEALTH_", extra="forbid")

    enabled: bool = Field(False, description="run the health loop in the orchestrator (`--health-monitor`)")
    interval_s: float = Field(600.0, gt=0, description="seconds between the loop's checks")
    tokens: int = Field(
        1000, ge=16, le=65536, description="probe hidden states sent to each replica of each expert per check"
    )
    seed: int = Field(
        0,
        ge=0,
        description="seed of the seeded probe (layer l uses seed + l), used where routers record no hidden states",
    )
    probe_refresh_s: float = Field(
        3600.0,
        gt=0,
        description="seconds before the monitor pins a fresh sample of the routers' recorded hidden states as a "
        "layer's probe",
    )
    probe_concurrency: int = Field(4, ge=1, le=256, description="expert groups probed at once")
    round_probe_rows: int = Field(
        0,
        ge=0,
        description="probe rows (tokens x replicas) one round sends at most: whole layers, those that must be "
        "checked first, then the longest unchecked (`health.sampling`); 0: every replica every round",
    )
    probe_batch_bytes: int = Field(
        64 << 20,
        ge=1,
        description="hidden-state bytes of one probe Dispatch (a group's experts of a layer share calls up to this)",
    )
    histogram_bins: int = Field(20, ge=2, le=256, description="bins of the output-norm and activation histograms")
    kl_suspect: float = Field(0.05, gt=0, description="KL(baseline || now) above this makes a replica suspect")
    kl_quarantine: float = Field(0.5, gt=0, description="KL(baseline || now) above this quarantines a replica at once")
    mean_shift_suspect: float = Field(
        0.05,
        gt=0,
        description="relative change of the mean output norm against the baseline that makes a replica suspect",
    )
    replica_deviation: float = Field(
        0.05,
        gt=0,
        description="relative distance of a replica's output norms from its replicas' median that makes it suspect",
    )
    suspect_checks: int = Field(2, ge=1, description="checks in a row with findings that turn suspect into quarantined")
    probation_checks: int = Field(3, ge=1, description="clean checks after a repair before a replica serves again")
    auto_repair: bool = Field(
        True,
        description="repair replicas the monitor quarantined at its next check (operator quarantines wait for release)",
    )

    anomaly_rounds: bool = Field(
        True,
        description="run an early round on the experts a router's anomaly record implicates (routers with "
        "anomaly_action health_round write them; `health.anomalies`)",
    )
    anomaly_poll_s: float = Field(2.0, gt=0, description="seconds between reads of the routers' anomaly records")
    anomaly_cooldown_s: float = Field(
        300.0,
        ge=0,
        description="seconds after an early round on an expert before another anomaly may start one on it",
    )
    anomaly_max_age_s: float = Field(
        600.0, gt=0, description="anomaly records older than this are not acted on (read late, or at a restart)"
    )

    @model_validator(mode="after")
    def _kl_ordered(self) -> "HealthConfig":
        if self.kl_suspect >= self.kl_quarantine:
            raise ValueError(
                f"EXPERTMESH_HEALTH_KL_SUSPECT ({self.kl_suspect}) must be below "
                f"EXPERTMESH_HEALTH_KL_QUARANTINE ({self.kl_quarantine})"
            )
        return self


def add_health_argument(parser: argparse.ArgumentParser) -> None:
    add_loop_flag(
        parser,
        "--health-monitor",
        HealthConfig,
        "run the expert health monitor: probe every replica, quarantine and repair bad ones",
    )


def health_config(args: argparse.Namespace) -> HealthConfig:
    """The environment's settings, with the loop on when ``--health-monitor`` was given; a bad
    setting is one line naming its variable."""
    return loop_settings(HealthConfig, args.health_monitor)
