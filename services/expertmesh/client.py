"""Python clients of the expertmesh Inference API, sync and asyncio.

    from expertmesh.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_new_tokens=16):
            print(chunk.text, end="")

``generate`` yields ``Chunk``s (new token ids and text); the last one carries
the finish reason and token usage. ``AsyncClient`` has the same methods as
coroutines / async iterators. Both dial TLS when ``tls`` (default: the
``EXPERTMESH_TLS_*`` environment) names a CA or a client certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

from expertmesh.config import TlsConfig
from expertmesh.security.tls import secure_or_insecure_channel
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    #: "length", "stop", "eos" or "context" on the last chunk, else None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CONTEXT: "context",
}


def generate_request(
    prompt: str | Sequence[int],
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eos: bool = True,
    request_id: str = "",
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(stop=list(stop), stop_at_eos=stop_at_eos, request_id=request_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    request.sampling.temperature = temperature
    request.sampling.top_k = top_k
    if top_p is not None:
        request.sampling.top_p = top_p
    if seed is not None:
        request.sampling.seed = seed
    return request


def _chunk(response: pb.GenerateResponse) -> Chunk:
    if response.WhichOneof("event") == "finished":
        f = response.finished
        return Chunk([], "", _REASONS.get(f.reason), f.usage.prompt_tokens, f.usage.completion_tokens)
    return Chunk(list(response.delta.token_ids), response.delta.text)


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, tls: TlsConfig | None = None):
        self._channel = secure_or_insecure_channel(target, tls=tls)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._timeout = timeout

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Iterator[Chunk]:
        for response in self._stub.Generate(generate_request(prompt, **kwargs), timeout=self._timeout):
            yield _chunk(response)

    def generate_text(self, prompt: str | Sequence[int], **kwargs) -> str:
        return "".join(chunk.text for chunk in self.generate(prompt, **kwargs))

    def score(self, prompt: str | Sequence[int], raw_logits: bool = False) -> pb.ScoreResponse:
        request = pb.ScoreRequest(raw_logits=raw_logits)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self._stub.Score(request, timeout=self._timeout)

    def models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout).models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, tls: TlsConfig | None = None):
        self._channel = secure_or_insecure_channel(target, tls=tls, aio=True)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._timeout = timeout

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[Chunk]:
        async for response in self._stub.Generate(generate_request(prompt, **kwargs), timeout=self._timeout):
            yield _chunk(response)

    async def generate_text(self, prompt: str | Sequence[int], **kwargs) -> str:
        return "".join([chunk.text async for chunk in self.generate(prompt, **kwargs)])

    async def models(self) -> list[pb.ModelInfo]:
        return list((await self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout)).models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
