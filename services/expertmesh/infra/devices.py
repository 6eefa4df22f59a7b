"""The device the router's model computes on (``DataPlaneConfig.router_device``).

The router's model (embeddings, attention, gates, LM head) runs where this says;
the dispatcher keeps a layer's hidden states there when the transport can take
them (CUDA IPC to a group on the same GPU) and moves them to host memory for
the others. Expert groups choose their own device (``group serve --gpu``, a
GPU request on Ray).
"""

from __future__ import annotations

import torch

from expertmesh.config.settings import DEVICE_NAME, DEVICE_NAMES
from expertmesh.contracts.errors import DeviceUnavailable


def router_device(name: str, setting: str = "router_device") -> torch.device:
    """``auto``: the first CUDA GPU torch sees, else the CPU; ``cpu``; ``cuda`` or ``cuda:N``, which must exist.
    Errors name ``setting``, as the user wrote it."""
    if not DEVICE_NAME.fullmatch(name):
        raise DeviceUnavailable(f"{setting} {name!r}: {DEVICE_NAMES}")
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"{setting} {name}: this process sees no CUDA GPU (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); use cpu or auto"
        )
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise DeviceUnavailable(f"{setting} {name}: this process sees {count} CUDA GPU(s), cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", index)
