"""The command line as a user runs it: a real `expertmesh` process."""

import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "expertmesh.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_verify_passes_with_three_groups(tiny_checkpoints):
    result = _run("verify", "--model", tiny_checkpoints("qwen2_moe"), "--groups", 3, "--tokens", 16)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("PASS qwen2_moe float32 groups=3 tokens=16: max |Δ logits| = ")
    assert "greedy 16 tokens identical" in result.stdout
    assert "starting 3 expert groups on Ray Serve" in result.stderr, "long steps show progress"


def _one_error_line(result):
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_verify_missing_checkpoint_exits_2_with_one_line(tmp_path):
    line = _one_error_line(_run("verify", "--model", tmp_path / "absent"))
    assert line == f"expertmesh verify: error: checkpoint directory {tmp_path / 'absent'} does not exist"


def test_verify_dense_checkpoint_exits_2(tiny_checkpoints):
    assert "has no MoE layers" in _one_error_line(_run("verify", "--model", tiny_checkpoints("llama")))


def test_verify_bad_placement_exits_2_before_starting_ray(tiny_checkpoints, tmp_path):
    placement = tmp_path / "p.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"a": {"*": [0, 1, 2]}}}))
    line = _one_error_line(_run("verify", "--model", tiny_checkpoints("mixtral"), "--placement", placement))
    assert "leaves 2 experts unhosted: layer 0 expert 3, layer 1 expert 3" in line


def test_verify_too_many_groups_exits_2(tiny_checkpoints):
    line = _one_error_line(_run("verify", "--model", tiny_checkpoints("mixtral"), "--groups", 5))
    assert "--groups 5 is more than the 4 experts per layer" in line
