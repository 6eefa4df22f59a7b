"""``deploy/gpu-bench/run.sh``, the one-shot benchmark for a lent GPU machine, run here on CPU so that
it works the day a GPU is lent: real processes (the script, ``bench dispatch``, the group processes it
starts), with Ray, redis-py and the OpenTelemetry SDK unimportable as on that machine. What cannot be
had here: the GPU (``DEVICE=cpu``) and Python 3.12 for the carried wheels (none are carried: this
environment has the same packages)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import environment_without_gpu_machine_absentees

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_run_script_runs_here_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = environment_without_gpu_machine_absentees(tmp_path) | {
        "OUT": str(out),
        "DEVICE": "cpu",
        "DTYPE": "float32",
        "BATCHES": "1",
        "MODELS": "tiny",
        "TRANSPORTS": "auto",
        "REPEATS": "1",
        "BENCH_ARGS": "--prefill-tokens 16 --decode-steps 2",
        "SERVE_ARGS": "--clients 2 --requests-per-client 1 --max-new-tokens 4 --prompt-tokens 16",
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "SITE": str(tmp_path / "site"),
    }
    result = subprocess.run(
        ["bash", "deploy/gpu-bench/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    environment = (out / "env.txt").read_text()
    assert (
        "ray: absent" in environment and "imports ok: transformers, expertmesh.cli.main, expertmesh.v1" in environment
    )
    data = json.loads((out / "dispatch-tiny-auto.json").read_text())
    assert data["setup"]["device"] == "cpu" and data["setup"]["transports"] == {"g0": "shm", "g1": "shm"}
    assert data["agreement"]["passed"]
    assert [p["name"] for p in data["phases"]] == ["prefill 16", "decode b=1"]
    serve = json.loads((out / "serve-tiny.json").read_text())
    assert serve["setup"]["device"] == "cpu" and serve["agreement"]["passed"]
    assert "groups as plain processes" in serve["setup"]["platform"]
    assert "done: 2 JSON file(s)" in (out / "summary.txt").read_text()
    assert result.stdout.count("same answers: PASS") == 2  # the tables come back in the run's output tail
