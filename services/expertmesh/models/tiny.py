"""Tiny random-weight MoE checkpoints, built offline with transformers' own config
classes and ``save_pretrained``.

The tests use them to check every architecture we claim, and the embedded default
(`expertmesh up` with no model) serves one. Sizes follow the notes in
``shared/notes/transformers-moe.md``: each builds in well under a second on a CPU.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

_COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_COMMON_IDS = {k: _COMMON[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _config(config_class: str, sizes: dict[str, Any], **kw: Any):
    """transformers' ``config_class`` from ``_COMMON``, then the architecture's ``sizes``, then ``kw``."""
    import transformers

    return getattr(transformers, config_class)(**{**_COMMON, **sizes, **kw})


#: arch -> a builder of its hand-sized config (keyword arguments override any size).
CONFIG_BUILDERS: dict[str, Callable[..., Any]] = {
    "mixtral": partial(
        _config, "MixtralConfig", {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}
    ),
    "qwen2_moe": partial(
        _config,
        "Qwen2MoeConfig",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": partial(
        _config,
        "Qwen3MoeConfig",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 8,
            "norm_topk_prob": True,
        },
    ),
    "olmoe": partial(_config, "OlmoeConfig", {"intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": partial(
        _config,
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        },
    ),
    "gpt_oss": partial(
        _config,
        "GptOssConfig",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 8},
    ),
    # a dense model: no MoE layers, for the error path
    "llama": partial(_config, "LlamaConfig", {"intermediate_size": 64}),
}


def family_config(family: str, **kw: Any):
    """A tiny config of any MoE family of the installed transformers (``expertmesh.models.families``):
    the family's default (text) config shrunk by ``family_config.shrink``; vision-language
    families give their text config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from expertmesh.models.family_config import shrink

    if family not in CONFIG_MAPPING:
        raise ValueError(f"transformers registers no config class for {family!r}")
    text = CONFIG_MAPPING[family]().get_text_config()
    values = text.to_dict()
    return type(text).from_dict({**values, **shrink(values, family), **_COMMON_IDS, **kw})


#: The MoE architectures `expertmesh verify` is run on in the test suite.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def make_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    with_tokenizer: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` to ``out_dir`` and return the path.

    ``arch``: one of ``CONFIG_BUILDERS`` (hand-sized), else any MoE family of the installed
    transformers (``family_config``).

    ``max_shard_size`` (e.g. ``"20KB"``) produces a sharded checkpoint with an index.
    ``with_tokenizer`` adds a byte-level tokenizer that needs no download.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = (
        CONFIG_BUILDERS[arch](**config_overrides)
        if arch in CONFIG_BUILDERS
        else family_config(arch, **config_overrides)
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_small_params(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if with_tokenizer:
        from expertmesh.models.tokenizer import save_byte_tokenizer

        save_byte_tokenizer(out, vocab_size=config.vocab_size)
    return out


def _randomise_small_params(model, seed: int) -> None:
    """Give biases and correction terms that init to zero random values, so the
    fidelity tests exercise them (a zero bias hides a missing bias)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
