"""Hub model ids (``--model ORG/NAME [--revision R]``) through the real ``huggingface_hub``.

Only the network is faked: a Hub cache laid out as ``huggingface_hub`` lays it out
(``models--ORG--NAME/{blobs,snapshots/<sha>,refs/<branch>}``, snapshot files symlinked to blobs)
under a temporary ``HF_HUB_CACHE``, holding a real tiny checkpoint, stands in for an earlier
download. "No network" is a Hub endpoint on a loopback port nobody listens on.
"""

import hashlib
import os
import subprocess
import sys

import pytest

from expertmesh.contracts.errors import CheckpointError
from expertmesh.models.hub import resolve_model
from expertmesh.models.resolve import data_plane_config

REPO = "tiny-org/tiny-mixtral"


def cache_model(cache, repo: str, checkpoint, commit: str, refs=("main",)):
    """Put ``checkpoint``'s files into ``cache`` as one snapshot of ``repo`` at ``commit``."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_checkpoints):
    cache = tmp_path / "hub"
    main = cache_model(cache, REPO, tiny_checkpoints("mixtral"), "a" * 40)
    tagged = cache_model(cache, REPO, tiny_checkpoints("mixtral", seed=1), "b" * 40, refs=("v1",))
    return cache, main, tagged


def _cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache):
    cache, main, tagged = hub_cache
    assert resolve_model(REPO, cache_dir=cache).path == main
    assert resolve_model(REPO, cache_dir=cache).name == REPO
    assert resolve_model(REPO, "v1", cache_dir=cache).path == tagged  # a tag or branch: its refs file
    assert resolve_model(REPO, "b" * 40, cache_dir=cache).path == tagged  # a commit: its snapshot


def test_a_local_directory_stays_as_it_is(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    assert resolve_model(str(path)).path == path and resolve_model(str(path)).name is None
    with pytest.raises(CheckpointError, match="--revision applies to Hub ids"):
        resolve_model(str(path), "main")


def test_the_command_line_serves_the_snapshot_under_the_hub_id(hub_cache, monkeypatch):
    """``data_plane_config`` resolves once: the router and every group get the snapshot's path."""
    from huggingface_hub import constants

    from expertmesh.cli.main import build_parser

    cache, main, _ = hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    config = data_plane_config(build_parser().parse_args(["up", "--model", REPO]))
    assert (config.model, config.model_name) == (main, REPO)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"HF_HUB_OFFLINE": "1"},
            "tiny-org/absent@v2 is not in the local Hub cache and HF_HUB_OFFLINE is set: fetch it first with "
            "`hf download tiny-org/absent --revision v2`",
        ),
        (
            {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
            "cannot download tiny-org/absent@v2 from the Hub (",
        ),
    ],
)
def test_a_model_not_cached_without_network_exits_2_saying_how_to_fetch_it(tmp_path, env, expected):
    result = _cli(
        "verify", "--model", "tiny-org/absent", "--revision", "v2", env={"HF_HUB_CACHE": str(tmp_path), **env}
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertmesh verify: error: "), result.stderr
    assert expected in lines[0]
    assert "hf download tiny-org/absent --revision v2" in lines[0]


@pytest.mark.slow
def test_verify_runs_a_hub_id_from_the_cache(hub_cache):
    """Router and groups (on Ray Serve) load the one snapshot and match stock transformers on it."""
    cache, _, _ = hub_cache
    result = _cli(
        "verify", "--model", REPO, "--groups", 2, "--tokens", 8, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("PASS mixtral float32 groups=2 tokens=8")
