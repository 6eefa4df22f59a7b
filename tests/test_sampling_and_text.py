"""Pure pieces of serving: the sampler and incremental detokenisation."""

import pytest
import torch

from expertmesh.serving.sampling import SamplingParams, make_generator, next_token
from expertmesh.serving.text_stream import TextStream
from expertmesh.tokenizer import save_byte_tokenizer


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert next_token(logits, SamplingParams(), None) == 1


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    logits = torch.zeros(50)
    def draw(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        gen = make_generator(params)
        return [next_token(logits, params, gen) for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=5.0, top_k=1, seed=1), SamplingParams(temperature=5.0, top_p=1e-6, seed=1)):
        gen = make_generator(params)
        assert {next_token(logits, params, gen) for _ in range(30)} == {best}


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=3)
    gen = make_generator(params)
    assert {next_token(logits, params, gen) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize(
    "params, problem",
    [
        (SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        (SamplingParams(temperature=float("nan")), "temperature must be >= 0"),
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (SamplingParams(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_invalid_sampling_params(params, problem):
    assert any(problem in p for p in params.problems())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path, 300)
    return AutoTokenizer.from_pretrained(path)


def _feed(tokenizer, text, stop=()):
    stream = TextStream(tokenizer, stop)
    pieces = []
    for token in tokenizer(text)["input_ids"]:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    return pieces, stream.stopped


def test_multibyte_characters_are_released_whole(tokenizer):
    pieces, _ = _feed(tokenizer, "aé🌍b")
    assert "".join(pieces) == "aé🌍b"
    assert all("\ufffd" not in p for p in pieces)
    assert "🌍" in pieces  # released in one piece once its 4th byte arrived


def test_stop_sequence_ends_the_stream_and_is_not_returned(tokenizer):
    pieces, stopped = _feed(tokenizer, "hello END world", stop=("END",))
    assert stopped
    assert "".join(pieces) == "hello "


def test_held_prefix_of_a_stop_is_released_when_it_does_not_match(tokenizer):
    pieces, stopped = _feed(tokenizer, "an ENx", stop=("END",))
    assert not stopped
    assert "".join(pieces) == "an ENx"
    assert "E" not in pieces[:4]  # "E" waited until "x" proved it was not a stop


def test_stop_across_many_tokens_at_start(tokenizer):
    pieces, stopped = _feed(tokenizer, "STOPrest", stop=("xyz", "STOP"))
    assert stopped and "".join(pieces) == ""
