"""A decode step's attention half of each decoder layer in one native op (``cpu_decode_attention.cpp``), to the
bits of the module's own forward.

Why: in a decode step a layer's attention is little arithmetic (four products of a few rows, the rotary
embedding, a paged read of each row's past) reached through a lot of Python: the module's forward, four
``PackedLinear`` calls, transformers' ``apply_rotary_pos_emb`` (a dozen ATen ops), the cache's update, the
attention registry, ``paged_attention``'s plumbing and the kernel, ~0.3 ms a layer on this project's 2-core host
where the products and the attention themselves take ~0.1. The op makes the same kernel calls
(``grouped_linear``, ``paged_decode``) from C++, rotates and stores the new keys and values itself, and returns the
output product.

Which modules (``fuse_decode_attention``): an attention module of the router's model whose four products are on the
grouped kernel (``linear_kernels.PackedLinear`` of a ``grouped_experts.GroupedWeight``) or torch's own (a plain
``nn.Linear``, which the op computes by ``at::linear`` over the same [1, B, in] rows) and whose own forward the op
matches bit for bit on seeded rows, keys and values with the model's rotary embedding (``agrees``: the outputs and
the keys and values it stores, through the ``cpu-paged-decode`` backend the op stands in for). A module whose
forward computes anything else (a norm of the queries, partial rotary, latents, a soft cap, sinks) fails the check
and keeps its forward. A fused
module is the same object with the same parameters; its class becomes a subclass of its own
(``_FusedDecodeAttention`` first), so ``isinstance`` checks, the state dict and the stock forward are unchanged.

When: a packed step whose every sequence feeds one token, on the ``cpu-paged-decode`` backend, in float32, while the
module is not training; any other call (a prompt's chunk, a forward outside the engine) runs the module's own
forward.

Shapes: B decode rows (the step's T tokens), H query heads, h key heads, d / dv key / value width, S pool slots.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch
from torch import nn

from expertmesh.infra.cpu_threads import all_threads_for
from expertmesh.infra.native_kernels import load_cpu_kernel
from expertmesh.models import grouped_experts
from expertmesh.models.grouped_experts import GroupedWeight
from expertmesh.models.linear_kernels import PackedLinear
from expertmesh.serving import cpu_paged_decode
from expertmesh.serving.kv_cache import KVPool, PackedCache
from expertmesh.serving.paged_attention import IMPLEMENTATION, STEP, StepAttention, cpu_paged_decode_attend

__all__ = ["agrees", "fuse_decode_attention", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_lock = threading.Lock()
_PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj")


@functools.cache
def load() -> bool:
    """Whether the op is built (once per machine) and registered (``torch.ops.expertmesh_decode.decode_attention``),
    with the two kernels it calls; never raises (a failed build is logged once, and the modules keep their forward)."""
    if not (grouped_experts.load() and cpu_paged_decode.load()):
        return False
    with _lock:
        return load_cpu_kernel(
            "expertmesh_decode_attention",
            _SOURCE,
            "decode attention op",
            "decode steps run each attention module's own forward",
            lambda: torch.ops.expertmesh_decode.decode_attention,
            log,
        )


#: one product as the op takes it: (packed copy for the grouped kernel or None, outputs, weight for torch's product
#: or None, bias or None)
_Operands = tuple[torch.Tensor | None, int, torch.Tensor | None, torch.Tensor | None]


def _products(module: nn.Module) -> list[_Operands] | None:
    """The module's four products as the op takes them, or None where one is on neither the grouped kernel
    (``PackedLinear`` of a ``GroupedWeight``) nor torch's own (a plain ``nn.Linear``)."""
    found = []
    for name in _PRODUCTS:
        linear = getattr(module, name, None)
        if isinstance(linear, PackedLinear):
            product = linear.product()
            if not isinstance(product, GroupedWeight):
                return None
            packed, outputs = product.operands()
            found.append((packed, outputs, None, linear.bias))
        elif type(linear) is nn.Linear:
            found.append((None, linear.out_features, linear.weight, linear.bias))
        else:
            return None
    return found


def _heads(module: nn.Module) -> int | None:
    """The module's query heads (its query product's outputs over its head width), None where it says neither."""
    width = getattr(module, "head_dim", None)
    q_proj = getattr(module, "q_proj", None)
    if not isinstance(width, int) or width <= 0 or q_proj is None or q_proj.out_features % width:
        return None
    return q_proj.out_features // width


def _fused(
    module: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: PackedCache,
    step: StepAttention,
) -> torch.Tensor | None:
    """[1, T, hidden]: the layer's attention output by the op, or None where this call is not one it takes."""
    products, heads = _products(module), _heads(module)
    layer = module.layer_idx
    if products is None or heads is None or hidden.dim() != 3 or hidden.shape[0] != 1:
        return None
    rows = hidden.shape[1]
    if rows != len(step.sequences) or cos.shape[-2] != rows or cos.dtype != torch.float32:
        return None
    try:
        keys, values = cache.layer_pool(layer)  # [S, h, d], [S, h, dv]
    except KeyError:  # not allocated yet: the module's own forward allocates it at its update
        return None
    batch = step.decode_batch(step.kinds[layer], least=1)
    if batch is None:
        return None
    q, k, v, o = products
    if keys.shape[1] * keys.shape[2] != k[1] or values.shape[1] * values.shape[2] != v[1]:
        return None  # the pool holds other shapes: the module's own update reallocates it
    if cos.shape[-1] != keys.shape[2]:
        return None  # a rotary embedding of part of each head (GLM's): the op rotates whole heads
    scale = getattr(module, "scaling", None)
    scale = keys.shape[2] ** -0.5 if scale is None else float(scale)
    with all_threads_for(rows * max(q[1], o[1]), step.threads):
        out = torch.ops.expertmesh_decode.decode_attention(
            hidden[0],
            *q,
            *k,
            *v,
            *o,
            cos.reshape(rows, -1),
            sin.reshape(rows, -1),
            keys,
            values,
            cache.write_slots,
            batch.tables,
            batch.first_positions,
            batch.lengths,
            heads,
            cache.block_size,
            scale,
        )  # [T, hidden]
    return out[None]


class _FusedDecodeAttention:
    """The mixin a fused module's class puts before its own: a decode step's call by the op, any other by the
    module's own forward (``super().forward``)."""

    def forward(self, *args, **kwargs):
        step, cache = kwargs.get(STEP), kwargs.get("cache", kwargs.get("past_key_values"))
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if (
            isinstance(step, StepAttention)
            and isinstance(cache, PackedCache)
            and step.decode_only
            and step.attend is cpu_paged_decode_attend
            and step.implementation == "sdpa"
            and not self.training
            and isinstance(hidden, torch.Tensor)
            and hidden.dtype == torch.float32
            and embeddings is not None
        ):
            out = _fused(self, hidden, embeddings[0], embeddings[1], cache, step)
            if out is not None:
                return out, None
        return super().forward(*args, **kwargs)


@functools.cache
def _fused_class(cls: type) -> type:
    return type(f"FusedDecode{cls.__name__}", (_FusedDecodeAttention, cls), {"__module__": cls.__module__})


def agrees(module: nn.Module, kinds: tuple[str, ...], window: int | None, rotary: nn.Module | None = None) -> bool:
    """Whether the op computes what ``module``'s own forward (not yet fused) does on a decode step of three
    sequences (pasts of 3, 6 and 1 positions in a pool of blocks of 4; seeded rows, keys and values): the same output
    and the same keys and values stored, bit for bit. ``kinds``/``window``: the model's layer kinds and sliding
    window. ``rotary``: the model's rotary embedding module, whose cos and sin at those positions the step is
    handed (a model rotating part of each head fails here, as its steps would fall back); None: seeded angles over
    whole heads."""
    from expertmesh.serving.attention_backends import ATTENTION_BACKENDS, StepLayout, attention_metadata

    products, heads = _products(module), _heads(module)
    if products is None or heads is None or not isinstance(getattr(module, "layer_idx", None), int):
        return False
    k_out, v_out = products[1][1], products[2][1]
    width = module.head_dim
    if k_out % width or v_out % (k_out // width):
        return False
    kv_heads = k_out // width
    generator = torch.Generator().manual_seed(0)
    pool = KVPool(num_blocks=4, block_size=4)
    pool.allocate(module.layer_idx + 1, ((kv_heads, width), (kv_heads, v_out // kv_heads)), torch.float32)
    for tensor in pool.tensors(module.layer_idx):
        tensor.normal_(generator=generator)
    metadata = attention_metadata([[0], [1, 2], [3]], [3, 6, 1], [1, 1, 1], pool.block_size)
    layout = StepLayout("sdpa", kinds, window, torch.float32)
    hidden = torch.randn(1, 3, module.q_proj.in_features, generator=generator)  # [1, T, hidden]
    if rotary is not None:
        with torch.no_grad():
            cos, sin = rotary(hidden, torch.tensor([[3, 6, 1]]))  # [1, T, rotated width]
    else:
        angles = torch.rand(1, 3, width // 2, generator=generator) * 100
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)  # [1, T, d]
    before = [t.clone() for t in pool.tensors(module.layer_idx)]
    config, own = module.config, module.config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        cache, step = ATTENTION_BACKENDS["cpu-paged-decode"].plan(metadata, pool, layout)
        with torch.no_grad():
            stock, _ = type(module).forward(module, hidden, (cos, sin), None, cache=cache, **{STEP: step})
            stored = [t.clone() for t in pool.tensors(module.layer_idx)]
            for tensor, saved in zip(pool.tensors(module.layer_idx), before):
                tensor.copy_(saved)
            cache, step = ATTENTION_BACKENDS["cpu-paged-decode"].plan(metadata, pool, layout)
            fused = _fused(module, hidden, cos, sin, cache, step)
    except Exception as err:  # a forward that takes other arguments, shapes the op refuses: not this path
        log.debug("decode attention: %s keeps its forward (%s)", type(module).__name__, err)
        return False
    finally:
        config._attn_implementation = own
    return (
        fused is not None
        and torch.equal(fused, stock)
        and all(torch.equal(a, b) for a, b in zip(pool.tensors(module.layer_idx), stored))
    )


def fuse_decode_attention(model: nn.Module, kinds: tuple[str, ...], window: int | None) -> int:
    """Every attention module of ``model`` (a module with the four products and a ``layer_idx``) for which ``agrees``
    holds computes its decode steps by the op; returns how many do (0 where the op does not build)."""
    candidates = [
        module
        for module in model.modules()
        if all(isinstance(getattr(module, name, None), nn.Module) for name in _PRODUCTS)
        and isinstance(getattr(module, "layer_idx", None), int)
    ]
    if not candidates or not load():
        return 0
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    rotary = rotaries[0] if len(rotaries) == 1 else None  # one for every layer: the cos and sin its steps get
    fused = 0
    for module in candidates:
        if isinstance(module, _FusedDecodeAttention):
            fused += 1
        elif agrees(module, kinds, window, rotary):
            module.__class__ = _fused_class(type(module))
            fused += 1
    if fused < len(candidates):
        log.info(
            "decode attention: %d of %d attention modules on the fused op (the others keep their forward)",
            fused,
            len(candidates),
        )
    return fused
