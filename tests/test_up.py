"""`expertmesh up` as a person runs it (the `make run` path): a real process tree
with local Ray or an existing Ray cluster, queried with the CLI and the client,
stopped with SIGTERM, which drains in-flight requests first."""

import os
import re
import signal
import subprocess
import sys

import grpc
import pytest

from expertmesh.client import Client
from expertmesh.infra.ports import free_port
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import RayHead, Up

pytestmark = pytest.mark.slow
BIN = os.path.dirname(sys.executable)


def test_up_with_no_arguments_serves_the_embedded_model_and_drains_on_sigterm(tmp_path):
    up = Up(env={"EXPERTMESH_HOME": str(tmp_path)})
    try:
        assert f"on {up.target}" in up.banner and "expertmesh generate" in up.banner
        assert (tmp_path / "tiny-mixtral-v1" / "tokenizer.json").is_file()
        cli = subprocess.run(
            [os.path.join(BIN, "expertmesh"), "generate", "Hello", "--max-tokens", "8", "--target", up.target],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert "completion tokens]" in cli.stderr

        with Client(up.target) as client:
            stream = client.generate([5, 6, 7], max_new_tokens=300, stop_at_eos=False)
            next(stream)
            code = None
            up.proc.send_signal(signal.SIGTERM)
            up.wait_for_stderr("draining in-flight requests")
            try:
                client.generate_text([1, 2], max_new_tokens=2)
            except grpc.RpcError as err:
                code = err.code()
            assert code == grpc.StatusCode.UNAVAILABLE, "new requests are refused while draining"
            rest = list(stream)
            assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 300
        assert up.proc.wait(timeout=90) == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    for line in ("draining in-flight requests", "drained", "stopping expert groups"):
        up.wait_for_stderr(re.escape(line))


def test_up_joins_an_existing_ray_cluster(tmp_path, monkeypatch):
    # A cluster with token authentication, as multi-node Ray runs by default: `up` must present the token.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", os.urandom(16).hex())
    ray_port = free_port()
    head = RayHead(ray_port)
    try:
        model = make_tiny_checkpoint("olmoe", tmp_path / "olmoe", with_tokenizer=True, vocab_size=300)
        up = Up("--model", str(model), "--groups", "2", "--ray-address", f"127.0.0.1:{ray_port}")
        try:
            with Client(up.target) as client:
                (info,) = client.models()
                assert info.architecture == "olmoe" and list(info.groups) == ["g0", "g1"]
                assert len(client.generate_text("abc", max_new_tokens=4, stop_at_eos=False)) > 0
        finally:
            assert up.stop() == 0
        up.wait_for_stderr(re.escape(f"starting Ray (127.0.0.1:{ray_port})"))
        # The cluster outlives `up`, and `up` took its expert groups with it.
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; from ray import serve; ray.init(address=%r, logging_level='ERROR');"
                "print(sorted(serve.status().applications))" % f"127.0.0.1:{ray_port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        assert "expertmesh-groups" not in probe.stdout
    finally:
        head.stop()


def test_up_with_an_unreachable_ray_cluster_fails_fast():
    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", "up", "--ray-address", f"127.0.0.1:{free_port()}", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("expertmesh up: error: cannot reach the Ray cluster at 127.0.0.1:")
    )
