"""deploy/Dockerfile and deploy/Dockerfile.cuda, checked as text (no container engine here):
non-root final user, nothing fetched but from package registries, the pinned torch of the
Makefile, gRPC modules generated in the build, and the entrypoint the chart calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helmchart import CHART, REPO

DOCKERFILES = {"cpu": REPO / "deploy" / "Dockerfile", "cuda": REPO / "deploy" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(ins):
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_final_user_is_non_root(flavor):
    users = [a for w, a in final_stage(instructions(DOCKERFILES[flavor])) if w == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user == "1000", users[-1]
    # The chart's podSecurityContext runs as that uid.
    assert "runAsUser: 1000" in (CHART / "values.yaml").read_text()


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_nothing_downloaded_outside_package_registries(flavor):
    for word, args in instructions(DOCKERFILES[flavor]):
        if word in ("ADD", "COPY"):
            assert "://" not in args, f"{word} {args}: fetches from a URL"
            assert "--from=" in args or not args.startswith("http"), args
        if word == "RUN":
            # `apt-get install ... wget` installs a package; invoking curl/wget/git fetches is banned.
            for cmd in re.split(r"&&|;|\|", args):
                tool = cmd.strip().split(" ")[0] if cmd.strip() else ""
                assert tool not in ("curl", "wget", "git", "aria2c"), f"RUN fetches with {tool}: {cmd.strip()}"
            urls = re.findall(r"https?://[^\s\"']+", args)
            # ${VAR} index URLs come from ARGs, checked below.
            assert not urls, f"RUN names a URL: {urls}"
        if word == "ARG" and "://" in args:
            assert re.search(r"=https://(download\.pytorch\.org/whl/|pypi\.org/simple)", args), (
                f"ARG {args}: not a pip index"
            )


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_builds_the_package_with_pinned_torch_and_generated_protos(flavor):
    ins = instructions(DOCKERFILES[flavor])
    text = " ".join(a for _, a in ins)
    torch = re.search(r"^TORCH_VERSION := (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"TORCH_VERSION={torch}" in [a for w, a in ins if w == "ARG"], "the Makefile's pinned torch"
    assert '"torch==${TORCH_VERSION}"' in text
    assert "grpc_tools.protoc -Iprotos" in text and "pip install ." in text
    final = final_stage(ins)
    assert ("ENTRYPOINT", '["expertmesh"]') in final
    assert any(w == "COPY" and "--from=build" in a for w, a in final), "multi-stage: only the venv is copied"


def test_cpu_base_is_slim_python_and_cuda_base_is_nvidia():
    cpu = dict((a.split("=")[0], a) for w, a in instructions(DOCKERFILES["cpu"]) if w == "ARG")
    cuda = dict((a.split("=")[0], a) for w, a in instructions(DOCKERFILES["cuda"]) if w == "ARG")
    assert cpu["BASE"] == "BASE=python:3.11-slim"
    assert cuda["BASE"].startswith("BASE=nvidia/cuda:")
    for path in DOCKERFILES.values():
        assert (path.parent / f"{path.name}.dockerignore").is_file()
