"""``expertmesh.client``: ``Client`` and ``AsyncClient`` against a real router (Ray Serve expert
groups on the session's Ray, the Inference gRPC server on loopback), and ``expertmesh generate``
over the same server."""

import asyncio
import inspect

import pytest

from expertmesh.cli.main import main
from expertmesh.client import AsyncClient, Client
from expertmesh.config.settings import DataPlaneConfig, ServingConfig
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.platform.data_plane import DataPlane
from expertmesh.platform.router_apis import serve_plane


def _public(cls) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and (not name.startswith("_") or name == "__init__")
    }


def test_async_client_has_every_method_of_client_with_the_same_arguments():
    sync, asynchronous = _public(Client), _public(AsyncClient)
    assert set(sync) == set(asynchronous)
    for name, signature in sync.items():
        assert list(signature.parameters.values()) == list(asynchronous[name].parameters.values()), name
        for p in signature.parameters.values():  # keyword arguments are typed: Unpack[a TypedDict]
            assert p.kind is not p.VAR_KEYWORD or str(p.annotation).startswith("Unpack["), f"{name}(**{p.name})"


def test_options_are_keyword_only_and_checked_before_any_call():
    """A misnamed option is a TypeError before anything is sent (nothing listens on port 1)."""
    with Client("127.0.0.1:1") as client:
        with pytest.raises(TypeError):
            client.generate("Hello", 16)  # max_new_tokens by position: refused, not silently misread
        with pytest.raises(TypeError, match="max_tokens"):
            list(client.generate("Hello", max_tokens=16))
        with pytest.raises(TypeError, match="logits"):
            client.score("Hello", logits=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory, ray_session):
    checkpoint = make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("ckpt"), with_tokenizer=True, vocab_size=300)
    with DataPlane.start(DataPlaneConfig(model=checkpoint, groups=2)) as plane:
        server = serve_plane(plane, ServingConfig(port=0, max_new_tokens_cap=32))
        yield f"127.0.0.1:{server.port}"
        server.drain_and_stop()


ARGS = dict(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=7, stop=(), stop_at_eos=False)


@pytest.mark.slow
def test_both_clients_give_the_same_answers(target):
    with Client(target) as client:
        chunks = list(client.generate([5, 6, 7], **ARGS))
        text = client.generate_text([5, 6, 7], **ARGS)
        score = client.score([5, 6, 7, 8])
        raw = client.score([5, 6, 7, 8], raw_logits=True)
        models = client.models()
        stats = client.load_stats()

    async def run():
        async with AsyncClient(target) as client:
            return (
                [c async for c in client.generate([5, 6, 7], **ARGS)],
                await client.generate_text([5, 6, 7], **ARGS),
                await client.score([5, 6, 7, 8]),
                await client.score([5, 6, 7, 8], raw_logits=True),
                await client.models(),
                await client.load_stats(),
            )

    a_chunks, a_text, a_score, a_raw, a_models, a_stats = asyncio.run(run())
    assert chunks == a_chunks and chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 6
    assert text == a_text == "".join(c.text for c in chunks)  # seeded sampling: the same tokens both times
    assert score == a_score and raw == a_raw and score != raw
    # the KV pool's use is live (a finished sequence's blocks come back at the next step boundary): compare
    # the pool's size, and the rest of the model info whole
    pools = [(m.kv_pool.blocks_total, m.kv_pool.block_size) for m in (*models, *a_models)]
    assert len(set(pools)) == 1 and pools[0][0] > 0
    for m in (*models, *a_models):
        m.ClearField("kv_pool")
    assert models == a_models and models[0].architecture == "qwen2_moe"
    assert '"num_experts"' in stats and '"num_experts"' in a_stats


@pytest.mark.slow
def test_generate_command_streams_and_refuses_bad_input(target, capsys):
    assert main(["generate", "Hello", "--max-tokens", "4", "--target", target]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().endswith("completion tokens]") and "4 completion" in captured.err
    assert main(["generate", "Hello", "--max-tokens", "33", "--target", target]) == 2  # above the cap
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"expertmesh generate: error: {target}: INVALID_ARGUMENT: max_new_tokens 33 is above this server's cap of 32"
    ]
