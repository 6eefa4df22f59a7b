"""The baselines ``bench serve`` compares the platform with, by name (the interface: ``baselines.base``)."""

from __future__ import annotations

from typing import Literal, get_args

from expertmesh.bench.serve.baselines import generate, vllm
from expertmesh.bench.serve.baselines.base import StartBaseline

__all__ = ["BASELINES", "BaselineName"]

BaselineName = Literal["generate", "vllm"]

#: ``generate`` first when chosen: its first run (each prompt alone) is the reference of agreement
BASELINES: dict[str, StartBaseline] = {"generate": generate.started, "vllm": vllm.started}
assert set(BASELINES) == set(get_args(BaselineName)), "every baseline the type names, and no other"
