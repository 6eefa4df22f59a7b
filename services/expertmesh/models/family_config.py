"""Shrinking a model family's default config to a tiny one that keeps its MoE shape.

``shrink(values)`` takes the family's default (text) config as a plain dict
(``config.to_dict()``) and returns the overrides that make it tiny: small
widths, few layers, eight experts, top-2, while every MoE-relevant option the
family has stays switched on as the family ships it: shared experts, dense
first layers, group-limited top-k (``n_group`` > 1 stays > 1), biases, hybrid
attention/SSM layer patterns. Pure: plain data in, plain data out.

Layer-indexed options (``layer_types``, ``mlp_layer_types``, per-layer head
counts, ...) are cut to a subset of the original layers that still holds every
distinct per-layer combination, so a hybrid model keeps each kind of layer.
"""

from __future__ import annotations

from typing import Any

#: Widths and counts: key -> tiny value, applied where the family's config has the key set.
SIZES: dict[str, int] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
    "dense_intermediate_size": 64,
    "prefix_dense_intermediate_size": 64,
    "moe_intermediate_size": 16,
    "moe_hidden_size": 16,
    "shared_expert_intermediate_size": 48,
    "shared_experts_intermediate_size": 48,
    "shared_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 48,
    "max_position_embeddings": 64,
    "model_max_length": 64,
    "sliding_window": 8,
    "sliding_window_size": 8,
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "o_lora_rank": 16,
    "o_groups": 2,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "rotary_dim": 8,
    # sparse-attention indexers
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "index_topk_blocks": 2,
    "index_block_size": 8,
    "index_kpool": 4,
    "indexer_n_heads": 2,
    "indexer_head_dim": 16,
    "indexer_kv_heads": 1,
    # linear attention
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    # state-space layers: heads x head dim = expand x hidden
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_num_heads": 8,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "ssm_state_size": 8,
    "chunk_size": 16,
    "n_groups": 2,
    "mamba_n_groups": 1,
    # other low-rank or side widths
    "hc_lowrank": 8,
    "gated_norm_rank": 4,
    "loop_gate_rank": 4,
    "router_hidden_size": 16,
    "hidden_size_per_layer_input": 8,
    "ple_embed_dim": 16,
    "swa_head_dim": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "d_rel": 4,
    "rel_extent": 16,
    "block_size": 16,
}

_MOE_WIDTHS = ("moe_intermediate_size",)
#: Expert counts and top-k: eight experts (four per group where top-k is group-limited), two chosen.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
EXPERTS = 8
TOP_K = 2
VOCAB = 128
#: Most layers a tiny model keeps; fewer when fewer already show every kind of layer.
MAX_LAYERS = 6
MIN_LAYERS = 3

#: Options whose value is a list with one entry per decoder layer.
LAYER_LISTS = (
    "layer_types",
    "mlp_layer_types",
    "indexer_types",
    "layers_block_type",
    "layer_rope_theta",
    "num_attention_heads_per_layer",
    "no_rope_layers",
)
#: Options whose value is a list of layer indices.
LAYER_INDEX_LISTS = ("mlp_only_layers", "ple_layer_ids", "kv_source_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id")


#: What the generic rules cannot know, per family: options that must agree with each other
#: (checked by the config class) or defaults that leave a layer kind out.
QUIRKS: dict[str, dict[str, Any]] = {
    # the head dim of its sliding layers must equal qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": {"head_dim": 16},
    # head_dim defaults to None, which its attention does not derive
    "hunyuan_v1_moe": {"head_dim": 8, "num_experts": 8, "moe_topk": 2},
    # default layer types: all Mamba, or unset; keep attention layers in
    "granitemoehybrid": {
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    },
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"]},
    # a looped block of whole residual blocks
    "inkling2_loop": {"n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1, "loop_layer_index_end": 2},
    # its indexed-attention layers need the sparse-attention indexer configured
    "qwen4_exp": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
}


def _set(values: dict[str, Any], key: str) -> bool:
    """Whether ``key`` is an option the family uses (present with a value, not switched off)."""
    value = values.get(key)
    return value is not None and not isinstance(value, bool) and value != 0


def _tiny_widths(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, tiny in SIZES.items():
        value = values.get(key)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [tiny] * len(value)  # e.g. per-modality expert widths
        elif _set(values, key) and isinstance(value, int):
            out[key] = tiny
        elif value is None and key in _MOE_WIDTHS and key in values:
            out[key] = tiny  # an MoE width left unset with the expert count (Gemma 4)
    if _set(values, "num_key_value_heads"):
        heads, kv = values.get("num_attention_heads") or 1, values["num_key_value_heads"]
        # keep the attention kind: multi-head, multi-query or grouped
        out["num_key_value_heads"] = SIZES["num_attention_heads"] if kv == heads else 1 if kv == 1 else 2
    if _set(values, "qk_head_dim"):
        out["qk_head_dim"] = out.get("qk_nope_head_dim", 0) + out.get("qk_rope_head_dim", 0) or SIZES["head_dim"]
    return out


def _tiny_experts(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A count left unset (None) in the default config turns the family's MoE off or leaves it to the
    # checkpoint: set it. A count of 1 is a family's choice (one routed expert) and stays.
    for key in EXPERT_COUNT_KEYS:
        if key in values and (values[key] is None or values[key] > 1):
            out[key] = EXPERTS
    for key in TOP_K_KEYS:
        if key in values and not isinstance(values[key], bool):
            out[key] = TOP_K if values[key] is None else min(values[key], TOP_K)
    if "enable_moe_block" in values:
        out["enable_moe_block"] = True
    for groups, chosen in (("n_group", "topk_group"), ("num_expert_group", "topk_group")):
        if _set(values, groups) and values[groups] > 1:
            out[groups] = 2  # group-limited top-k stays on: 2 groups of 4, top-k drawn from 1
            if _set(values, chosen):
                out[chosen] = 1
    for key in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        if _set(values, key):
            out[key] = min(values[key], 2)
        elif key in values and values[key] is None:
            out[key] = 1  # unset: the checkpoint decides, and dots1's ship one
    return out


def _scale_rope(values: dict[str, Any]) -> dict[str, Any]:
    """Rotary sections that must add up to half the head dim (multimodal RoPE) follow the tiny head dim."""
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return {}
    half = SIZES["head_dim"] // 2
    sections = [1] * len(rope["mrope_section"])
    sections[-1] = half - (len(sections) - 1)
    return {"rope_parameters": {**rope, "mrope_section": sections}}


def pick_layers(values: dict[str, Any]) -> list[int]:
    """Original layer indices the tiny model keeps: the first layer of each distinct per-layer
    combination of the layer-indexed options, in order, topped up with the layers that follow."""
    total = int(values.get("num_hidden_layers") or 1)
    lists = [values[k] for k in LAYER_LISTS if isinstance(values.get(k), list) and len(values[k]) == total]
    seen: set[tuple] = set()
    picked: list[int] = []
    for i in range(total):
        signature = tuple(repr(v[i]) for v in lists)
        if signature not in seen:
            seen.add(signature)
            picked.append(i)
    picked = picked[:MAX_LAYERS]
    for i in range(total):
        if len(picked) >= min(total, max(MIN_LAYERS, len(picked))):
            break
        if i not in picked:
            picked.append(i)
    return sorted(picked)


def _layer_options(values: dict[str, Any], layers: list[int]) -> dict[str, Any]:
    total = int(values.get("num_hidden_layers") or 1)
    n = len(layers)
    new_index = {old: new for new, old in enumerate(layers)}
    out: dict[str, Any] = {"num_hidden_layers": n}
    for key in LAYER_LISTS:
        value = values.get(key)
        if isinstance(value, list) and len(value) == total:
            out[key] = [value[i] for i in layers]
    for key in LAYER_INDEX_LISTS:
        value = values.get(key)
        if isinstance(value, list):
            out[key] = [new_index[i] for i in value if i in new_index]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        width = len(next(iter(per_layer)))
        out["per_layer_config"] = {
            str(new_index[int(k)]).zfill(width): {
                x: y for x, y in {**v, **_tiny_widths({**values, **v})}.items() if x in v
            }
            for k, v in per_layer.items()
            if int(k) in new_index
        }
    # dense first layers: keep one
    for key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if _set(values, key):
            out[key] = 1
    if _set(values, "moe_layer_end_index"):
        out["moe_layer_end_index"] = n - 1
    if _set(values, "max_window_layers"):
        out["max_window_layers"] = n
    # periodic hybrids (Jamba): attention every other layer, experts every other layer
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        if _set(values, period) and values[period] > 1:
            out[period], out[offset] = 2, 1
    if _set(values, "loop_layer_index_start"):  # a looped block inside the stack (Inkling 2 Loop)
        out["loop_layer_index_start"], out["loop_layer_index_end"] = 1, n - 1
    return out


def _token_ids(values: dict[str, Any]) -> dict[str, Any]:
    """Special tokens inside the tiny vocabulary: ids already below it stay, others get 0, 1, 2 ..."""
    out: dict[str, Any] = {}
    for fallback, key in enumerate(_TOKEN_IDS):
        value = values.get(key)
        if isinstance(value, int) and value >= VOCAB:
            out[key] = fallback
        elif isinstance(value, list):
            out[key] = [v if v < VOCAB else fallback for v in value]
    return out


def shrink(values: dict[str, Any], family: str = "") -> dict[str, Any]:
    """Overrides that make the config ``values`` (``family``'s default, as a dict) tiny."""
    out: dict[str, Any] = {"vocab_size": VOCAB}
    for key in ("vocab_size_per_layer_input", "unpadded_vocab_size"):
        if _set(values, key):
            out[key] = VOCAB
    out.update(_tiny_widths(values))
    out.update(_tiny_experts(values))
    out.update(_scale_rope(values))
    out.update(_layer_options(values, pick_layers(values)))
    out.update(_token_ids(values))
    if values.get("use_mamba_kernels"):
        out["use_mamba_kernels"] = False  # CUDA-only kernels; the torch path is the reference
    out.update(QUIRKS.get(family, {}))
    return out
