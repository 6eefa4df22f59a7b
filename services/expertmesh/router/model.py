"""The router's model: stock transformers code and weights for everything but
the routed experts, which are never materialised here.

Built on the meta device; each experts module loses its stacked expert
parameters; then the non-expert weights are read from the checkpoint, keeping
transformers' fp32 rules for gates in bf16 (``build_router_model``). The model's
experts calls reach the expert groups once it is bound to a dispatcher
(``bind_dispatcher``), which is built after it (it takes the model's gate bias).
``experts_answered_by`` lends those calls to a stand-in for a while: the engine's warm-up answers them
with zeros (``ZeroExperts``), so no group is called and nothing the dispatcher counts changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from expertmesh.contracts.errors import CheckpointError
from expertmesh.infra import row_sums
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.models.linear_kernels import BLAS_MAX_ELEMENTS, LinearKernel, choose_linear_kernel, pack_linears
from expertmesh.models.rms_norm import fuse_rms_norms
from expertmesh.models.weight_layout import input_major, prefers_input_major
from expertmesh.router.dispatch.dispatcher import LayerDispatcher
from expertmesh.router.dispatch.experts_impl import IMPLEMENTATION


def build_router_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device = torch.device("cpu"),
    linear_kernel: LinearKernel | None = None,
    threads: int = 0,
) -> nn.Module:
    """The router's model of ``checkpoint`` on ``device``; its ``nn.Linear`` products on ``linear_kernel``
    (``linear_kernels``; None: the device's best). ``threads``: the router's intra-op threads, which its large
    products take in a step narrowed to fewer (0: the caller's)."""
    model = checkpoint.skeleton(IMPLEMENTATION, dtype)
    for layer, (_, module) in experts_modules(model).items():
        for name in checkpoint.spec.expert_params:
            module._parameters[name] = None
        module._expertmesh_layer = layer
    model.to_empty(device="cpu")
    # Non-persistent buffers (rotary inv_freq, Gemma 4's embed_scale) are not in the checkpoint and
    # to_empty leaves them garbage; transformers' own init recomputes them. Before the load: the
    # init also draws the module's parameters, which the checkpoint's then replace.
    for module in model.modules():
        if getattr(module, "_non_persistent_buffers_set", None):
            model._init_weights(module)

    # from_pretrained keeps some modules in fp32 at low precision (e.g. DeepSeek-V3's gate); do the same.
    fp32_patterns = list(model._get_dtype_plan(dtype))
    dtype_of = {
        key: (torch.float32 if any(p in key for p in fp32_patterns) else dtype) if t.is_floating_point() else t.dtype
        for key, t in model.state_dict().items()
    }
    state = checkpoint.non_expert_state(dtype_of)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in getattr(model, "all_tied_weights_keys", {})]
    if missing:
        raise CheckpointError(f"{checkpoint.path} lacks router weights: {missing[:5]}")
    model.tie_weights()
    model.to(device)  # read on the host first: safetensors and the fp32 rules above work there
    model.requires_grad_(False)
    model.eval()
    kernel = linear_kernel or choose_linear_kernel(device, dtype, grouped=True)
    if torch.device(device).type == "cpu":
        row_sums.load()  # the groups' partial sums are added on the host each layer
    if kernel == "blas":
        _lay_out_head(model, device)
    # attention, shared experts, gates and the head: every step reads them all (the smallest stay on blas)
    pack_linears(model, kernel, BLAS_MAX_ELEMENTS if kernel == "onednn-packed" else 0, threads)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        fuse_rms_norms(model)  # each norm one op, where it gives the module's own bits
    return model


def _lay_out_head(model: nn.Module, device: torch.device) -> None:
    """The LM head's weight input-major where the device prefers it (``weight_layout``) and torch's own kernel
    multiplies by it: every decode step reads all of it for a few rows. Not when it is tied to the input
    embeddings, whose lookups read it by rows."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or not prefers_input_major(device) or getattr(head, "weight", None) is None:
        return
    if embeddings is not None and head.weight.data_ptr() == embeddings.weight.data_ptr():
        return
    head.weight = nn.Parameter(input_major(head.weight.detach()), requires_grad=False)


def bind_dispatcher(model: nn.Module, dispatcher: LayerDispatcher) -> nn.Module:
    """``model``'s experts calls go to ``dispatcher``, and each forward is a step boundary of its own unless
    the serving engine's step holds it."""
    for _, module in experts_modules(model).values():
        module._expertmesh_dispatcher = dispatcher
    model._expertmesh_dispatcher = dispatcher
    model.register_forward_pre_hook(lambda module, *_: module._expertmesh_dispatcher.on_forward())
    return model


class ZeroExperts:
    """A stand-in for the dispatcher whose every experts call sums to zero: the forward runs every kernel of
    the router's own (embeddings, attention, norms, gates, shared experts, LM head) and no expert group's."""

    def experts(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.zeros_like(hidden)  # [T, H]

    def on_forward(self) -> None:
        pass


@contextmanager
def experts_answered_by(model: nn.Module, stand_in) -> Iterator[None]:
    """Within: the experts calls (and forward boundaries) of ``model``, if bound (``bind_dispatcher``), go to
    ``stand_in`` rather than its dispatcher; a model computing its experts itself is left as it is. The
    caller must be the model's only user meanwhile (the engine's thread, before it serves)."""
    holders = [module for _, module in experts_modules(model).values() if hasattr(module, "_expertmesh_dispatcher")]
    if hasattr(model, "_expertmesh_dispatcher"):
        holders.append(model)
    own = [holder._expertmesh_dispatcher for holder in holders]
    for holder in holders:
        holder._expertmesh_dispatcher = stand_in
    try:
        yield
    finally:
        for holder, dispatcher in zip(holders, own):
            holder._expertmesh_dispatcher = dispatcher
