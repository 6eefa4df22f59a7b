"""Requests a fault sends itself, beside the clients' steady traffic, timed as theirs are (``traffic.Request``):
over gRPC with prompts of the fault's choosing (long ones, whose blocks the prefix cache keeps), and over the
OpenAI-compatible HTTP API with a routing policy (a path the gRPC traffic does not take). The HTTP client is
the standard library's: ``expertmesh bench`` needs no HTTP package of its own."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from expertmesh.bench.chaos.traffic import Request, complete

#: sends one request: given ``arrived(n)`` to call per streamed chunk, returns what the request answered
Send = Callable[[Callable[[int], None]], list[int]]


class ProbeFailed(Exception):
    """A probe request failed: ``str(err)`` is "CODE: details", as the clients' failures are counted."""


def probe(index: int, send: Send) -> Request:
    """One request made by ``send``, kept as a ``Request`` of client ``index`` (its reference's index)."""
    import grpc

    sent, times, tokens, error = time.monotonic(), [], [], None
    try:
        tokens = send(lambda n: times.append(time.monotonic()))
    except grpc.RpcError as err:
        error = f"{err.code().name}: {err.details()}"
    except ProbeFailed as err:
        error = str(err)
    return Request(index, sent, time.monotonic(), tuple(tokens), error, tuple(times))


def grpc_send(client, prompt: list[int], max_new_tokens: int) -> Send:
    """A greedy completion of exactly ``max_new_tokens`` tokens over gRPC (``client``: an open ``Client``)."""
    return lambda arrived: complete(client, prompt, max_new_tokens, arrived)


def http_send(url: str, body: dict, timeout_s: float) -> Send:
    """A streamed ``/v1/completions`` of ``body`` at the router's HTTP API ``url``; what it answered is the
    completion's text as UTF-8 bytes (the HTTP API streams text, not token ids)."""

    def send(arrived: Callable[[int], None]) -> list[int]:
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        text = []
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ProbeFailed(f"{chunk['error'].get('code')}: {chunk['error'].get('message')}")
                    piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                    if piece:
                        text.append(piece)
                        arrived(1)
        except urllib.error.HTTPError as err:
            raise ProbeFailed(f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise ProbeFailed(f"HTTP: {err}") from None
        return list("".join(text).encode())

    return send


class LivenessWatch:
    """``GET /health/live`` every ``every_s`` on a thread of its own until ``stop``: the longest it took to
    answer (a failure or a timeout counts as its whole wait)."""

    def __init__(self, url: str, every_s: float = 0.05, timeout_s: float = 10.0):
        self._url, self._every, self._timeout = f"{url}/health/live", every_s, timeout_s
        self._stop = threading.Event()
        self.longest_s = 0.0
        self.checks = 0
        self._thread = threading.Thread(target=self._run, name="chaos-liveness", daemon=True)

    def start(self) -> "LivenessWatch":
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop watching; the longest wait."""
        self._stop.set()
        self._thread.join()
        return self.longest_s

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            started = time.monotonic()
            try:
                with urllib.request.urlopen(self._url, timeout=self._timeout) as response:
                    response.read()
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                pass  # counted as its whole wait
            self.longest_s = max(self.longest_s, time.monotonic() - started)
            self.checks += 1
