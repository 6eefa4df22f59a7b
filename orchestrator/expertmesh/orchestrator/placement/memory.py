"""The memory model: what a model needs on each device that serves it, for capacity planning and placement.

Glossary
- *shared bytes*: every parameter but the routed experts (embeddings, attention, norms, gates, shared
  experts, LM head), at the serving dtype. The router holds them.
- *expert bytes*: one routed expert's parameters at the serving dtype; a group or GPU holds (replicas it
  hosts) x that.
- *KV bytes per token*: what the attention layers cache for one token, summed over layers: DeepSeek's MLA
  caches its compressed latent and rotary key (``kv_lora_rank + qk_rope_head_dim``), other attention
  ``2 x KV heads x head dim``; a sliding-window layer holds at most its window of tokens.
- *overhead*: what a device needs beyond weights and cache (CUDA context, activations, allocator slack):
  ``RESERVE_BYTES`` plus ``OVERHEAD_FRACTION`` of what it holds.

``ModelSizes.of(config)`` measures a transformers config (its model built on the meta device: no memory);
``budget`` is the pure part: sizes, a placement's replicas per device, a batch and a length in, one
``DeviceBudget`` per device out.

Example: ``budget(ModelSizes.of(DeepseekV3Config()), {"gpu0": 1856, ...}, batch=8, seq=4096, dtype_bytes=2)``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes a device keeps for itself beyond what the model puts there (CUDA context, cuBLAS workspaces)
RESERVE_BYTES = 1 << 30
#: activations and allocator slack, as a share of the weights and cache a device holds
OVERHEAD_FRACTION = 0.10
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
GB = 1e9

__all__ = ["DTYPE_BYTES", "DeviceBudget", "ModelSizes", "budget"]


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts and cache widths of one model. Example (Mixtral 8x7B): total 46.7e9, 32 MoE layers x 8
    experts of 176,160,768 parameters, 65,536 cached elements per token."""

    model_type: str
    total_params: int
    #: parameters of one routed expert (all of its matrices and biases)
    params_per_expert: int
    moe_layers: int
    num_experts: int
    #: per attention layer: elements it caches per token (keys and values, or MLA's latent and rotary key)
    kv_elements: tuple[int, ...]
    #: per attention layer: tokens it keeps at most (its sliding window), None for all
    kv_window: tuple[int | None, ...]

    @property
    def expert_params(self) -> int:
        return self.params_per_expert * self.moe_layers * self.num_experts

    @property
    def shared_params(self) -> int:
        return self.total_params - self.expert_params

    def kv_bytes(self, seq: int, dtype_bytes: int) -> int:
        """Cache bytes of one sequence of ``seq`` tokens."""
        return dtype_bytes * sum(
            n * (seq if w is None else min(seq, w)) for n, w in zip(self.kv_elements, self.kv_window)
        )

    @classmethod
    def of(cls, config) -> "ModelSizes":
        """The sizes of ``config``'s model (a transformers PretrainedConfig), built on the meta device."""
        import torch
        from transformers import AutoModelForCausalLM

        from expertmesh.models.checkpoint import experts_modules

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        experts = experts_modules(model)
        if not experts:
            raise ValueError(f"{config.model_type} has no MoE layers that use transformers' experts interface")
        _, first = next(iter(experts.values()))
        text = config.get_text_config()
        layers = text.num_hidden_layers
        window = getattr(text, "sliding_window", None) or None
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * layers
        return cls(
            model_type=config.model_type,
            total_params=sum(p.numel() for p in model.parameters()),
            params_per_expert=sum(p.numel() for p in first.parameters()) // first.num_experts,
            moe_layers=len(experts),
            num_experts=first.num_experts,
            kv_elements=tuple(_kv_elements(text) for _ in range(layers)),
            kv_window=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        )


def _kv_elements(text) -> int:
    """Elements one attention layer of ``text`` (a text config) caches per token."""
    if getattr(text, "kv_lora_rank", None):  # MLA: the compressed latent and the shared rotary key
        return text.kv_lora_rank + text.qk_rope_head_dim
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * head_dim


@dataclass(frozen=True)
class DeviceBudget:
    """What one device (the router, a group or a GPU) needs, in bytes, and whether it fits its capacity."""

    name: str
    shared: int
    experts: int
    #: routed-expert replicas it holds
    replicas: int
    kv: int
    overhead: int
    #: bytes of memory it has (None: not known)
    capacity: int | None

    @property
    def total(self) -> int:
        return self.shared + self.experts + self.kv + self.overhead

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity


def _overhead(held: int) -> int:
    return RESERVE_BYTES + int(OVERHEAD_FRACTION * held)


def budget(
    sizes: ModelSizes,
    replicas: dict[str, int],
    batch: int,
    seq: int,
    dtype_bytes: int,
    capacity: dict[str, int] | None = None,
    router_capacity: int | None = None,
) -> list[DeviceBudget]:
    """The router (shared weights, the KV cache of ``batch`` sequences of ``seq`` tokens) first, then each device
    of ``replicas`` (name -> routed-expert replicas it hosts) with its expert weights; ``capacity``: bytes each
    device has, where known."""
    capacity = capacity or {}
    shared = sizes.shared_params * dtype_bytes
    kv = batch * sizes.kv_bytes(seq, dtype_bytes)
    rows = [DeviceBudget("router", shared, 0, 0, kv, _overhead(shared + kv), router_capacity)]
    per_expert = sizes.params_per_expert * dtype_bytes
    for name, count in replicas.items():
        held = count * per_expert
        rows.append(DeviceBudget(name, 0, held, count, 0, _overhead(held), capacity.get(name)))
    return rows


def expert_budget_bytes(capacity: int) -> int:
    """The most expert weights a device of ``capacity`` bytes should hold: what is left after its overhead."""
    return max(0, int((capacity - RESERVE_BYTES) / (1 + OVERHEAD_FRACTION)))
