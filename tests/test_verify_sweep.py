"""``expertmesh verify --sweep``: every MoE family of the installed transformers, tiny and random,
served by real expert groups on Ray Serve and compared with stock transformers.

The pure parts (family discovery, config shrinking, parsing, the table of docs/verified-architectures.md)
are unit-tested; a fast subset, one family per distinct experts layout or gate kind, runs on one Ray cluster for
the module; the full sweep is marked ``sweep`` and is deselected by default."""

import json
import subprocess
import sys

import pytest

from expertmesh.models import families as families_mod
from expertmesh.models.family_config import EXPERTS, MAX_LAYERS, QUIRKS, TOP_K, pick_layers, shrink
from expertmesh.verify import sweep as verify_sweep


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


# -- discovery ------------------------------------------------------------------------------


def test_discover_finds_modeling_files_with_the_experts_decorator():
    sources = {
        "mixtral/modeling_mixtral.py": "@use_experts_implementation\nclass MixtralExperts: ...",
        "mixtral/configuration_mixtral.py": "use_experts_implementation",  # not a modeling file
        "llama/modeling_llama.py": "class LlamaMLP: ...",
        "aria/modeling_aria.py": "from ...integrations.moe import use_experts_implementation",
        "aria/modular_aria.py": "use_experts_implementation",
    }
    assert families_mod.discover(sources) == ["aria", "mixtral"]


def test_installed_families_include_the_verified_six_and_no_dense_model():
    found = families_mod.installed_families()
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= set(found)
    assert "llama" not in found


@pytest.mark.parametrize(
    "family, text_type, expected",
    [
        ("mixtral", None, "text"),  # its own causal LM
        ("qwen3_5_moe", "qwen3_5_moe_text", "vl-text"),  # the text model has a causal LM
        ("qwen3_vl_moe", "qwen3_vl_moe_text", "vl-full"),  # only the image-text model
        ("privacy", None, "none"),  # a token classifier
        ("omni", "omni_text", "none"),
    ],
)
def test_classify(family, text_type, expected):
    causal = {"mixtral", "qwen3_5_moe_text"}
    image_text = {"qwen3_vl_moe"}
    assert families_mod.classify(family, text_type, causal, image_text) == expected


# -- shrinking a config ----------------------------------------------------------------------


DEEPSEEK_LIKE = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "qk_head_dim": 192,
    "v_head_dim": 128,
    "eos_token_id": 1,
    "bos_token_id": 0,
    "tie_word_embeddings": False,
    "use_mamba_kernels": True,
}


def test_shrink_keeps_every_moe_option_on():
    out = shrink(DEEPSEEK_LIKE)
    assert out["hidden_size"] == 32 and out["vocab_size"] == 128
    assert out["n_routed_experts"] == EXPERTS and out["num_experts_per_tok"] == TOP_K
    assert out["n_group"] == 2 and out["topk_group"] == 1, "group-limited top-k stays group-limited"
    assert out["n_shared_experts"] == 1, "shared experts stay"
    assert out["first_k_dense_replace"] == 1, "a dense first layer stays"
    assert out["num_key_value_heads"] == out["num_attention_heads"], "multi-head attention stays multi-head"
    assert out["qk_head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    assert out["num_hidden_layers"] >= 3
    assert out["use_mamba_kernels"] is False


def test_shrink_sets_expert_counts_a_default_config_leaves_unset():
    out = shrink({"num_hidden_layers": 4, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None})
    assert out["num_experts"] == EXPERTS and out["top_k_experts"] == TOP_K and out["moe_intermediate_size"] == 16


def test_shrink_leaves_switched_off_options_off():
    out = shrink({"num_hidden_layers": 2, "q_lora_rank": None, "shared_expert_intermediate_size": 0, "num_experts": 1})
    assert "q_lora_rank" not in out and "shared_expert_intermediate_size" not in out
    assert "num_experts" not in out, "one routed expert is the family's choice"


def test_pick_layers_keeps_one_layer_of_each_kind():
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * 10
    mlp = ["dense"] * 2 + ["sparse"] * 38
    values = {"num_hidden_layers": 40, "layer_types": kinds, "mlp_layer_types": mlp}
    picked = pick_layers(values)
    assert picked == sorted(picked) and len(picked) <= MAX_LAYERS
    assert {kinds[i] for i in picked} == {"linear_attention", "full_attention"}
    assert {mlp[i] for i in picked} == {"dense", "sparse"}
    out = shrink(values)
    assert out["layer_types"] == [kinds[i] for i in picked] and out["num_hidden_layers"] == len(picked)


def test_shrink_remaps_layer_index_lists_and_per_layer_configs():
    values = {
        "num_hidden_layers": 8,
        "layer_types": ["a", "a", "b", "a", "a", "a", "a", "a"],
        "mlp_only_layers": [2, 7],
        "per_layer_config": {"02": {"head_dim": 512}, "07": {"head_dim": 512}},
        "head_dim": 256,
    }
    out = shrink(values)
    kept = pick_layers(values)
    assert out["mlp_only_layers"] == [kept.index(2)]
    assert out["per_layer_config"] == {str(kept.index(2)).zfill(2): {"head_dim": 8}}


def test_shrink_applies_the_family_quirks_last():
    family, quirk = next(iter(QUIRKS.items()))
    out = shrink({"num_hidden_layers": 40, "head_dim": 128}, family)
    assert all(out[k] == v for k, v in quirk.items())


# -- parsing, verdicts, the table ---------------------------------------------------------------


def test_parse_families():
    assert verify_sweep.parse_families(None, ["a", "b"]) == ["a", "b"]
    assert verify_sweep.parse_families("b, a", ["a", "b"]) == ["b", "a"]
    with pytest.raises(ValueError, match="llama is not an MoE family.*choose from a,b"):
        verify_sweep.parse_families("a,llama", ["a", "b"])
    with pytest.raises(ValueError, match="nothing given"):
        verify_sweep.parse_families(",", ["a"])


@pytest.mark.parametrize(
    "diff, same, dtype, expected",
    [
        (0.0, True, "float32", "exact"),
        (2e-5, True, "float32", "differs"),
        (0.0, False, "float32", "differs"),
        (9e-3, True, "bfloat16", "exact"),
        (2e-2, True, "bfloat16", "differs"),
    ],
)
def test_verdict(diff, same, dtype, expected):
    assert verify_sweep.verdict(diff, same, dtype) == expected


def test_markdown_table_from_the_json():
    rows = [
        {
            "family": "mixtral",
            "result": "exact",
            "max_abs_diff": 0.0,
            "tokens_identical": True,
            "reason": "",
            "layout": "gate+up fused",
            "gate": "TopKRouter",
            "shared_expert": False,
            "runs": "causal LM",
        },
        {
            "family": "aria",
            "result": "unsupported",
            "max_abs_diff": None,
            "tokens_identical": None,
            "reason": "X | Y",
            "layout": "",
            "gate": "",
            "shared_expert": True,
            "runs": "text model",
        },
    ]
    bf16 = [{**rows[0], "dtype": "bfloat16", "result": "differs", "max_abs_diff": 0.5, "tokens_identical": False}]
    table = verify_sweep.render_markdown([rows, bf16], "expertmesh verify --sweep --json s.json")
    lines = table.splitlines()
    assert lines[0] == (
        "Generated by `expertmesh verify --sweep --json s.json` (1 of 2 exact in float32, 0 of 1 exact in bfloat16):"
    )
    assert lines[2].startswith("| family | runs | experts layout | gate | shared expert | float32 |")
    assert (
        lines[4].startswith("| aria | text model |") and "unsupported: X / Y" in lines[4] and "| not run |" in lines[4]
    )
    assert lines[5] == (
        "| mixtral | causal LM | gate+up fused | TopKRouter |  | exact | 0 | differs (greedy tokens differ) | 0.5 |"
    )


def test_markdown_flag_renders_json_files(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(
        json.dumps([{"family": "olmoe", "result": "exact", "max_abs_diff": 1e-7, "layout": "l", "gate": "g"}])
    )
    result = _run("verify", "--markdown", path, "--markdown-command", "make sweep")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "| olmoe |  | l | g |  | exact | 1e-07 |"


@pytest.mark.parametrize("names", ["nope", "mixtral,llama"])
def test_bad_families_exit_2_with_one_line_naming_the_choices(names):
    result = _run("verify", "--sweep", "--families", names)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("expertmesh verify: error: --families: ") and "choose from " in lines[0]
    assert "mixtral" in lines[0].split("choose from ")[1].split(",")


# -- served by expert groups on Ray Serve --------------------------------------------------------

#: One family per distinct experts layout or gate kind (see docs/verified-architectures.md), less the four that
#: tests/test_fidelity.py already serves the same way (``verify.compare`` through Serve groups, float32,
#: three groups): mixtral (per-expert w1/w2/w3 on disk, softmax top-k), qwen2_moe (gated shared expert),
#: deepseek_v3 (sigmoid, score-correction bias, group-limited top-k, dense first layer) and gpt_oss
#: (transposed, biased, interleaved gate/up).
FAST_SUBSET = (
    "nemotron_h",  # up-only experts (relu2), Mamba hybrid
    "granitemoehybrid",  # stacked on disk, Mamba + attention
    "lfm2_moe",  # expert bias, convolution hybrid
    "kimi_linear",  # a regex source pattern for per-expert tensors
    "inkling2",  # a fused tensor converted whole (interleave), a vision-language family's text model
    "lara_mini",  # a fused tensor split into several parameters, linear attention
    "zaya",  # a router MLP before the logits linear, with a skip class (E + 1 logits)
    "hunyuan_v1_moe",  # a gate wrapping its linear
    "ergo",  # a subclass of the interface's class wrapping work around it (a per-expert output norm): on the router
)


@pytest.fixture(scope="module")
def sweep_selected(request):
    """The full sweep runs only when asked for (``-m sweep``): another ``-m`` given to pytest
    replaces the ``-m "not sweep"`` of the pytest config, and must not start an hour-long sweep."""
    expr = request.config.getoption("markexpr") or ""
    if "sweep" not in expr or "not sweep" in expr:
        pytest.skip("the full sweep runs only when selected with -m sweep (it takes an hour on 2 cores)")


def _config(dtype):
    """Two groups: every expert tensor is cut between groups, and both replicas start at once on 2 cores."""
    from pathlib import Path

    from expertmesh.config.settings import DataPlaneConfig

    return DataPlaneConfig(model=Path("."), groups=2, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAST_SUBSET)
def test_fast_subset_is_exact(ray_session, tmp_path, family):
    result = verify_sweep.run_family(family, _config("float32"), tmp_path, timeout_s=600)
    assert result.result == "exact", result
    assert result.max_abs_diff <= verify_sweep.SWEEP_TOLERANCE["float32"] and result.tokens_identical


@pytest.mark.sweep
@pytest.mark.timeout(4 * 3600)  # ~60 families, each a tiny checkpoint served by two groups
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_sweep(sweep_selected, ray_session, dtype):
    """Every family; the target: >= 90 % of the text causal-LM families exact, the rest explained."""
    results = verify_sweep.sweep(families_mod.installed_families(), _config(dtype))
    runnable = [r for r in results if r.runs not in ("", "full model")]
    exact = [r for r in runnable if r.result == "exact"]
    assert len(exact) >= 0.9 * len(runnable), [r for r in runnable if r.result != "exact"]
    assert all(r.reason for r in results if r.result != "exact")


# -- checkpoint layouts the sweep found -----------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, key, expected",
    [
        ("mlp.experts.*.gate_proj.weight", "model.layers.0.mlp.experts.12.gate_proj.weight", 12),
        (r"\.experts.*.w1.weight", "model.layers.1.mlp.experts.7.w1.weight", 7),  # a regex pattern (Kimi-Linear)
        (r"mlp\.experts\.w13_weight", "model.layers.1.mlp.experts.w13_weight", None),  # stored whole (Inkling 2)
    ],
)
def test_expert_index_of_a_source_key(pattern, key, expected):
    from expertmesh.models.checkpoint import _expert_index

    assert _expert_index(pattern, key) == expected


def test_a_split_feeds_every_piece():
    from types import SimpleNamespace

    from expertmesh.models.checkpoint import _targets_of

    split = SimpleNamespace(target_patterns=["attn.in_proj_qkv", "attn.in_proj_z", "attn.in_proj_b"])
    assert _targets_of("model.layers.0.attn.in_proj_qkv.weight", split) == [
        "model.layers.0.attn.in_proj_qkv.weight",
        "model.layers.0.attn.in_proj_z.weight",
        "model.layers.0.attn.in_proj_b.weight",
    ]
    assert _targets_of("model.layers.0.mlp.experts.down_proj", None) == ["model.layers.0.mlp.experts.down_proj"]
