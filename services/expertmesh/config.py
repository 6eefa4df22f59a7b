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
    load_window_s: float = Field(600.0, gt=0, description="sliding window of the router's expert-load statistics")
    load_publish_s: float = Field(10.0, gt=0, description="how often a router writes its load window to a shared store")


class ServingConfig(BaseSettings):
    """The public gRPC API of a router (``expertmesh up``)."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    host: str = Field("127.0.0.1", description="address the Inference gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="its port (0 picks a free one)")
    max_active_sequences: int = Field(32, ge=1, description="sequences decoded together in one step")
    max_queued_requests: int = Field(128, ge=0, description="requests waiting for a slot; beyond: RESOURCE_EXHAUSTED")
    default_max_new_tokens: int = Field(64, ge=1, description="when a request does not say")
    max_new_tokens_cap: int = Field(1024, ge=1, description="requests asking for more are refused")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time in-flight requests get to finish")
