"""A router from its parts, each given what it needs at construction: the model (stock code and the
checkpoint's non-expert weights), the table watcher keeping its routing view, and the layer dispatcher its
experts calls go to (with the model's gate bias, for the quarantine fallback). Nothing is started here:
the data plane starts the watcher's thread and the heartbeat; tests and ``verify`` step the watcher by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from expertmesh.contracts.routing_table import ModelIdentity
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.router.dispatch.degraded import StockChoice
from expertmesh.router.dispatch.dispatcher import Fallback, LayerDispatcher
from expertmesh.router.dispatch.heartbeat import Heartbeat
from expertmesh.router.dispatch.table_watcher import TableWatcher
from expertmesh.router.model import bind_dispatcher, build_router_model
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.transport.base import Transport
from expertmesh.store import StateStore


@dataclass(frozen=True)
class Router:
    watcher: TableWatcher
    dispatcher: LayerDispatcher
    #: None: a bare dispatcher, called layer by layer (no model)
    model: nn.Module | None


def assemble_router(
    store: StateStore,
    moe_layers: Sequence[int],
    transport: Transport,
    *,
    checkpoint: Checkpoint | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    identity: ModelIdentity | None = None,
    fallback: Fallback = "next_best",
    heartbeat: Heartbeat | None = None,
    poll_s: float = 0.25,
    max_backoff_s: float = 5.0,
    threads: int = 0,
    **dispatch,
) -> Router:
    """The router over ``store``'s routing tables. ``checkpoint``: build its model too (else a bare
    dispatcher). ``identity``: refuse tables made for another model, and groups started from another
    checkpoint (its fingerprint goes with every call). ``threads``: the router's intra-op threads
    (``build_router_model``). ``dispatch``: the rest of
    ``LayerDispatcher``'s settings (timeout, load window, endpoints, breakers, hidden sampler)."""
    model = build_router_model(checkpoint, dtype, device, threads=threads) if checkpoint is not None else None
    gate_bias = GateBias(model) if model is not None else None
    watcher = TableWatcher(
        store,
        moe_layers,
        transport,
        model=identity,
        gate_bias=gate_bias,
        fallback=fallback,
        heartbeat=heartbeat,
        poll_s=poll_s,
        max_backoff_s=max_backoff_s,
    )
    dispatcher = LayerDispatcher(
        watcher,
        transport,
        model_fingerprint=identity.fingerprint if identity is not None else "",
        fallback=fallback,
        gate_bias=gate_bias,
        stock_choice=StockChoice(gate_bias) if gate_bias is not None else None,
        **dispatch,
    )
    if model is not None:
        bind_dispatcher(model, dispatcher)
    return Router(watcher, dispatcher, model)
