"""The memory model (``orchestrator.placement.memory``) against real checkpoints' configs, their sizes worked out
by hand here from the published shapes; ``expertmesh plan memory``; the planner's refusal of a plan that outgrows
a GPU. Configs only (transformers' own config classes at the published values): no weights are read."""

import json

from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

from expertmesh.bench.placement import synthetic_stats
from expertmesh.cli.main import main
from expertmesh.orchestrator.placement.memory import GB, OVERHEAD_FRACTION, RESERVE_BYTES, ModelSizes, budget
from expertmesh.orchestrator.placement.stats import stats_to_dict


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-30B-A3B's config.json values."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    )


def test_mixtral_8x7b_sizes_by_hand():
    sizes = ModelSizes.of(MixtralConfig())  # the defaults are Mixtral-8x7B's shapes
    h, inter, vocab, layers, kv = 4096, 14336, 32000, 32, 8 * 128
    per_expert = 3 * h * inter  # w1, w3: [inter, h]; w2: [h, inter]
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o (no biases)
    per_layer = attention + 2 * h + h * 8 + 8 * per_expert  # two norms, the gate, eight experts
    total = 2 * vocab * h + layers * per_layer + h  # embeddings, untied LM head, the final norm
    assert (sizes.params_per_expert, sizes.moe_layers, sizes.num_experts) == (per_expert, 32, 8)
    assert sizes.total_params == total == 46_702_792_704  # "46.7B"
    assert sizes.kv_bytes(1, 2) == layers * 2 * 8 * 128 * 2  # 128 KiB per token in bfloat16


def test_deepseek_v3_sizes_by_hand():
    sizes = ModelSizes.of(DeepseekV3Config())  # the defaults are DeepSeek-V3's shapes
    assert sizes.params_per_expert == 3 * 7168 * 2048
    assert (sizes.moe_layers, sizes.num_experts) == (61 - 3, 256)  # first_k_dense_replace = 3
    assert sizes.expert_params == 58 * 256 * 3 * 7168 * 2048  # 653.9B of the 671B
    assert abs(sizes.total_params - 671e9) / 671e9 < 0.001  # published: 671B (its MTP module apart)
    # MLA caches the compressed latent (kv_lora_rank 512) and the shared rotary key (64) per token and layer
    assert sizes.kv_bytes(4096, 2) == 61 * (512 + 64) * 4096 * 2


def test_qwen3_30b_a3b_sizes_by_hand():
    sizes = ModelSizes.of(qwen3_30b_a3b())
    assert sizes.params_per_expert == 3 * 2048 * 768 and (sizes.moe_layers, sizes.num_experts) == (48, 128)
    assert abs(sizes.total_params - 30.5e9) / 30.5e9 < 0.005  # published: 30.5B
    assert sizes.kv_bytes(10, 2) == 48 * 2 * 4 * 128 * 10 * 2


def test_a_sliding_window_layer_holds_only_its_window():
    sizes = ModelSizes("x", 10, 1, 1, 1, kv_elements=(4, 4), kv_window=(None, 8))
    assert sizes.kv_bytes(100, 2) == 2 * (4 * 100 + 4 * 8)


def test_budget_rows_and_fits():
    sizes = ModelSizes(
        "x", total_params=1000, params_per_expert=10, moe_layers=2, num_experts=4, kv_elements=(3,), kv_window=(None,)
    )
    rows = budget(sizes, {"g0": 5, "g1": 3}, batch=2, seq=7, dtype_bytes=2, capacity={"g0": 2 * GB}, router_capacity=10)
    router, g0, g1 = rows
    assert (router.shared, router.kv, router.experts) == ((1000 - 80) * 2, 2 * 3 * 7 * 2, 0)
    assert (
        router.overhead == RESERVE_BYTES + int(OVERHEAD_FRACTION * (router.shared + router.kv)) and router.fits is False
    )
    assert (g0.experts, g0.replicas, g0.fits) == (5 * 10 * 2, 5, True) and g1.fits is None


def test_plan_memory_reports_deepseek_v3_on_8_gpus_of_80_gb(tmp_path, capsys):
    model = tmp_path / "dsv3"
    DeepseekV3Config().save_pretrained(model)
    topology = tmp_path / "topo.yaml"
    gpus = ", ".join(f"{{id: {i}, memory_gb: 80}}" for i in range(8))
    topology.write_text(f"nodes:\n  - name: n0\n    islands:\n      - {{name: nvl-0, gpus: [{gpus}]}}\n")
    assert (
        main(
            [
                "plan",
                "memory",
                "--model",
                str(model),
                "--topology",
                str(topology),
                "--batch",
                "8",
                "--seq",
                "4096",
                "--dtype",
                "float8",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    router, *devices = report["devices"]
    assert router["kv"] == 8 * 61 * 576 * 4096 and router["shared"] == report["shared_params"]
    assert [d["replicas"] for d in devices] == [58 * 256 // 8] * 8
    assert all(d["experts"] == 1856 * 3 * 7168 * 2048 and d["fits"] is False for d in devices)  # 81.7 GB each
    assert (
        main(["plan", "memory", "--model", str(model), "--topology", str(topology), "--batch", "8", "--seq", "4096"])
        == 0
    )
    table = capsys.readouterr().out
    assert "deepseek_v3: 671.0B parameters" in table and table.count(" NO") == 8


def test_the_planner_refuses_a_plan_that_outgrows_a_gpu(tmp_path, capsys):
    model = tmp_path / "mixtral"
    MixtralConfig(num_hidden_layers=3).save_pretrained(model)  # 8 experts of 176M parameters per layer
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(stats_to_dict(synthetic_stats(3, 8, 2, 1.0, 3, seed=5))))
    topology = tmp_path / "topo.yaml"
    plan = [
        "plan",
        "--stats",
        str(stats),
        "--topology",
        str(topology),
        "--redundant",
        "0",
        "--out",
        str(tmp_path / "p.json"),
        "--model",
        str(model),
    ]
    topology.write_text(
        "nodes:\n  - name: n0\n    islands:\n      - {name: a, gpus: [{id: 0, memory_gb: 2}, {id: 1, memory_gb: 2}]}\n"
    )
    assert main(plan) == 2  # 12 experts of 0.35 GB (bfloat16) on each 2 GB GPU
    assert (
        "puts 4.2 GB of bfloat16 expert weights on GPU 0 (2 GB, less its overhead) and 1 more"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "p.json").exists()
    topology.write_text(
        "nodes:\n  - name: n0\n    islands:\n      - {name: a, gpus: [{id: 0, memory_gb: 8}, {id: 1, memory_gb: 8}]}\n"
    )
    assert main(plan) == 0 and (tmp_path / "p.json").exists()
    assert main(["plan", "--stats", str(stats)]) == 2
    assert "plan needs --topology, --redundant" in capsys.readouterr().err


def test_groups_on_gpus_get_their_memory_as_a_default_expert_budget(tmp_path):
    import numpy as np

    from expertmesh.contracts.gpu_plan import Placement
    from expertmesh.orchestrator.placement.memory import expert_budget_bytes
    from expertmesh.orchestrator.placement.to_groups import groups_from_placement
    from expertmesh.orchestrator.topology_discovery import load_topology_file

    topology = tmp_path / "topo.yaml"
    topology.write_text(
        "nodes:\n  - name: n0\n    islands:\n      - {name: a, gpus: [{id: 0, memory_gb: 80}, {id: 1, memory_gb: 0}]}\n"
    )
    shares = np.zeros((1, 2, 2))
    shares[0, 0, 0] = shares[0, 1, 1] = 1.0
    layout = groups_from_placement(Placement((0, 1), shares), load_topology_file(topology), (0,))
    assert layout.hardware["gpu-0"].expert_budget_bytes == expert_budget_bytes(80 * 10**9)
    assert layout.hardware["gpu-1"].expert_budget_bytes is None  # memory not stated: no budget
    island = groups_from_placement(Placement((0, 1), shares), load_topology_file(topology), (0,), per="island")
    assert island.hardware["n0-a"].memory_bytes == 80 * 10**9
