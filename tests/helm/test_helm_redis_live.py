"""The chart's bundled Redis run as rendered, against a real redis-server on this machine: the ACL init
container's command writes the ACL file from the generated Secret's passwords, redis-server starts with the
container's arguments (TLS on, the chart's generated certificate), its readiness probe answers, and each
platform pod's rendered Redis settings (user, password file, CA file, URL) open the store with exactly its
component's rights. What cannot run here is replaced by paths: the mounted Secrets are files under a temporary
folder, and the Service name is localhost (the certificate names both)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helmchart import template_args

from expertmesh.config.settings import RedisAuthConfig
from expertmesh.contracts.errors import StoreAccessDenied
from expertmesh.infra.ports import free_port
from expertmesh.store import QuarantinedReplica, open_store

FULLNAME = "em-expertmesh"
ENTRY = QuarantinedReplica(0, 1, "g0", "quarantined", "odd outputs", 1.0, False)


def _one(docs, kind, name):
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _platform_pods(docs):
    """(component, first container, volumes) of every expertmesh pod but Redis (the Ray head for the groups)."""
    for d in docs:
        if d["kind"] == "Deployment":
            tpl = d["spec"]["template"]
        elif d["kind"] == "RayService":
            tpl = d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
        else:
            continue
        yield (
            tpl["metadata"]["labels"]["app.kubernetes.io/component"],
            tpl["spec"]["containers"][0],
            tpl["spec"]["volumes"],
        )


@pytest.fixture(scope="module")
def rendered(helm):
    res = helm(*template_args(None))
    assert res.returncode == 0, res.stderr
    return res.docs


@pytest.fixture(scope="module")
def bundled_redis(rendered, tmp_path_factory):
    """(the rendered documents, a path mapper, the port) of the chart's Redis running here."""
    root = tmp_path_factory.mktemp("chart-redis")
    port = free_port()
    mounts = {
        "/etc/expertmesh-redis/users": root / "users",
        "/etc/redis-acl": root / "acl",
        "/etc/redis-tls": root / "tls",
        "/data": root / "data",
    }
    for folder in mounts.values():
        folder.mkdir()
    for key, value in _one(rendered, "Secret", f"{FULLNAME}-redis-auth")["data"].items():
        (mounts["/etc/expertmesh-redis/users"] / key).write_bytes(base64.b64decode(value))
    for key, value in _one(rendered, "Secret", f"{FULLNAME}-redis-tls")["data"].items():
        (mounts["/etc/redis-tls"] / key).write_bytes(base64.b64decode(value))

    def here(text: str) -> str:
        for mount, folder in mounts.items():
            text = re.sub(rf"{re.escape(mount)}(?=/|\s|$)", str(folder), text)
        return text

    pod = _one(rendered, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["expertmesh"]
    argv = [sys.executable, "-m", "expertmesh.cli.main", *(here(a) for a in init["args"])]
    subprocess.run(argv, check=True, timeout=120)
    (redis,) = pod["containers"]
    command = here(redis["args"][0]).replace("--tls-port 6379", f"--tls-port {port}")
    command = command.replace("exec redis-server", f"exec {shutil.which('redis-server')} --bind 127.0.0.1")
    proc = subprocess.Popen(["sh", "-c", command], stdout=subprocess.DEVNULL)
    probe = here(" ".join(redis["readinessProbe"]["exec"]["command"][2:])).replace(
        "redis-cli ", f"redis-cli -p {port} "
    )
    deadline = time.monotonic() + 30
    while subprocess.run(["sh", "-c", probe]).returncode != 0:
        assert time.monotonic() < deadline and proc.poll() is None, "the rendered Redis never passed its probe"
        time.sleep(0.2)
    yield here, port
    proc.kill()
    proc.wait()


def _auth(container, volumes, here, root: Path) -> tuple[str, RedisAuthConfig]:
    """(the URL, the Redis settings) the rendered container would open the store with, its mounts mapped here."""
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # the pod's redis-auth volume: one key of the Secret, as the file "password"
    (volume,) = [v for v in volumes if v["name"] == "redis-auth"]
    (item,) = volume["secret"]["items"]
    assert env["EXPERTMESH_REDIS_PASSWORD_FILE"] == f"/etc/expertmesh-redis/{item['path']}"
    password = root / f"{item['key']}.password"
    shutil.copy(here(f"/etc/expertmesh-redis/users/{item['key']}"), password)
    ca = env["EXPERTMESH_REDIS_CA_FILE"].replace("/etc/expertmesh-tls/redis/", "/etc/redis-tls/")
    auth = RedisAuthConfig(username=env["EXPERTMESH_REDIS_USERNAME"], password_file=password, ca_file=here(ca))
    return env["EXPERTMESH_STATE_URL"], auth


def test_each_pod_opens_the_charts_redis_with_its_own_rights(rendered, bundled_redis, tmp_path):
    here, port = bundled_redis
    seen = set()
    # the orchestrator first: it writes what the others then read
    for component, container, volumes in sorted(_platform_pods(rendered), key=lambda pod: pod[0] != "orchestrator"):
        url, auth = _auth(container, volumes, here, tmp_path)
        assert url == f"rediss://{FULLNAME}-redis:6379/0"
        store = open_store(f"rediss://localhost:{port}/0", redis_auth=auth)
        try:
            if component == "orchestrator":
                store.set_quarantined(ENTRY)
            else:
                with pytest.raises(StoreAccessDenied, match=f"user '{component}'"):
                    store.set_quarantined(ENTRY)
            if component == "router":
                assert store.quarantined() == {(0, 1, "g0"): ENTRY}
            if component == "expert-group":
                store.set_endpoint("g0", "10.0.0.1:50061")
                store.routing_table()
        finally:
            store.close()
        seen.add(component)
    assert seen == {"router", "orchestrator", "expert-group"}
