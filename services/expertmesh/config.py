"""Typed configuration of the data plane. Every field can come from YAML or from
an ``EXPERTMESH_<FIELD>`` environment variable (e.g. ``EXPERTMESH_STATE_URL``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DataPlaneConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    model: Path = Field(description="local HuggingFace checkpoint directory (config.json + safetensors)")
    groups: int = Field(2, ge=1, description="expert groups for the default contiguous split")
    placement: Path | None = Field(None, description="placement YAML (groups -> layer/expert pairs); overrides groups")
    gpu_placement: Path | None = Field(None, description="placement JSON of `expertmesh plan` (replicas on GPUs, shares)")
    topology: Path | None = Field(None, description="topology YAML the GPU placement refers to")
    group_per: Literal["gpu", "island"] = Field("gpu", description="with gpu_placement: one expert group per GPU or per NVLink island")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    state_url: str = Field("memory://", description="memory:// (embedded) or redis://host:port/db")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    group_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per expert group")
    group_host: str = Field("127.0.0.1", description="address group gRPC servers bind; 0.0.0.0 in a cluster")
    group_budget_bytes: int | None = Field(
        None, ge=1, description="bytes of expert weights one group may hold; LoadExperts past it is refused (unset: unlimited)"
    )
    dispatch_timeout_s: float = Field(30.0, gt=0, description="deadline of one expert-group call")
    load_window_s: float = Field(600.0, gt=0, description="sliding window of the router's expert-load statistics")
    load_publish_s: float = Field(10.0, gt=0, description="how often a router writes its load window to a shared store")
    heartbeat_s: float = Field(1.0, gt=0, description="how often a router reports the routing-table version it serves")


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


def add_data_plane_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that starts a data plane shares (``up``, ``verify``, benchmarks)."""
    parser.add_argument("--model", type=Path, help="local checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--groups", type=int, default=2, help="expert groups (default contiguous split)")
    parser.add_argument("--placement", type=Path, help="placement YAML (groups -> layer/expert pairs) instead of --groups")
    parser.add_argument("--gpu-placement", type=Path, help="placement JSON of `expertmesh plan` (needs --topology)")
    parser.add_argument("--topology", type=Path, help="topology YAML the GPU placement was planned for")
    parser.add_argument("--group-per", choices=["gpu", "island"], default="gpu", help="with --gpu-placement")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    parser.add_argument(
        "--state-url", default=os.environ.get("EXPERTMESH_STATE_URL", "memory://"), help="memory:// or redis://host:port/db"
    )


def data_plane_config(args: argparse.Namespace) -> DataPlaneConfig:
    from expertmesh.embedded import default_checkpoint

    if args.model is None:
        print("[expertmesh] using the embedded tiny model (random weights)", flush=True, file=sys.stderr)
    return DataPlaneConfig(
        model=args.model or default_checkpoint(),
        groups=args.groups,
        placement=args.placement,
        gpu_placement=args.gpu_placement,
        topology=args.topology,
        group_per=args.group_per,
        dtype=args.dtype,
        ray_address=args.ray_address,
        state_url=args.state_url,
    )
