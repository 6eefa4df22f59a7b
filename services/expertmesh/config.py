"""Typed configuration of the data plane. Every field can come from YAML or from
an ``EXPERTMESH_<FIELD>`` environment variable (e.g. ``EXPERTMESH_STATE_URL``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DataPlaneConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    model: Path = Field(description="local HuggingFace checkpoint directory (config.json + safetensors)")
    groups: int = Field(2, ge=1, description="expert groups for the default contiguous split")
    placement: Path | None = Field(None, description="placement YAML (groups -> layer/expert pairs); overrides groups")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    state_url: str = Field("memory://", description="memory:// (embedded) or redis://host:port/db")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    group_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per expert group")
    group_host: str = Field("127.0.0.1", description="address group gRPC servers bind; 0.0.0.0 in a cluster")
    dispatch_timeout_s: float = Field(30.0, gt=0, description="deadline of one expert-group call")
