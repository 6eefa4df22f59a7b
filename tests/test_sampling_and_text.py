"""Pure pieces of serving: the sampler and incremental detokenisation."""

import pytest
import torch

from expertmesh.contracts.errors import NonFiniteLogits
from expertmesh.models.tokenizer import save_byte_tokenizer
from expertmesh.serving.sampling import (
    MIN_TEMPERATURE,
    SamplingParams,
    greedy_tokens,
    make_generator,
    next_token,
    row_argmax,
)
from expertmesh.serving.text_stream import MAX_STOP_BYTES, MAX_STOP_SEQUENCES, TextStream, stop_problems


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
    for params in (
        SamplingParams(temperature=5.0, top_k=1, seed=1),
        SamplingParams(temperature=5.0, top_p=1e-6, seed=1),
    ):
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
        (SamplingParams(temperature=float("nan")), "temperature must be >= 0 and finite"),
        (SamplingParams(temperature=float("inf")), "temperature must be >= 0 and finite"),
        (SamplingParams(temperature=1e-3), "temperature must be 0 or at least 0.01, got 0.001; use 0 for greedy"),
        (SamplingParams(temperature=MIN_TEMPERATURE / 2), "use 0 for greedy"),
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=float("nan")), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=float("inf")), "top_p must be in (0, 1]"),
        (SamplingParams(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_invalid_sampling_params(params, problem):
    assert any(problem in p for p in params.problems())


def test_temperature_floor_is_accepted_also_as_the_float32_a_client_sends():
    as_float32 = float(torch.tensor(MIN_TEMPERATURE, dtype=torch.float32))  # 0.0099999998
    for temperature in (0.0, MIN_TEMPERATURE, as_float32, 1.0):
        assert SamplingParams(temperature=temperature).problems() == []


def test_top_k_above_the_vocabulary_keeps_every_token():
    logits = torch.zeros(4)
    params = SamplingParams(temperature=1.0, top_k=10**9, seed=5)
    gen = make_generator(params)
    assert {next_token(logits, params, gen) for _ in range(200)} == {0, 1, 2, 3}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=1),
    ],
)
def test_non_finite_logits_are_refused_not_sampled(params, bad):
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    logits[2] = bad  # greedy argmax would pick a NaN index, multinomial would draw from NaN
    with pytest.raises(NonFiniteLogits, match="logits held") as err:
        next_token(logits, params, make_generator(params))
    assert err.value.code.name == "INTERNAL"


def test_greedy_tokens_for_a_step_are_next_tokens_row_by_row():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(50, generator=g) for _ in range(7)]
    rows.append(torch.tensor([1.0, 5.0, 5.0, 5.0] + [0.0] * 46))  # a tie goes to the lowest id, as argmax does
    rows.append(torch.full((50,), -2.0))  # all tied
    expected = [next_token(r, SamplingParams(), None) for r in rows]
    assert expected == [int(torch.argmax(r)) for r in rows]  # torch's argmax, ties and all
    assert expected[7:] == [1, 0]
    assert greedy_tokens(rows) == expected
    half = [r.to(torch.bfloat16) for r in rows]  # compared in float32, as next_token does
    assert greedy_tokens(half) == [next_token(r, SamplingParams(), None) for r in half]


def test_row_argmax_is_torchs_argmax_row_by_row():
    """The host's vectorised argmax (numpy's) picks torch's ids: the first of tied maxima, +Inf over any finite
    value, a NaN over everything (the first NaN), a row of -Inf its first id; on strided rows too. No rows give no
    ids, and rows of no scores are refused (IndexError) as torch refuses them."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-3, 4, (64, 300), generator=g).float()  # many ties
    rows[0, 7] = float("inf")
    rows[1, 9], rows[1, 4] = float("nan"), float("inf")
    rows[2, 11], rows[2, 12] = float("nan"), float("nan")
    rows[3] = float("-inf")
    rows[4, 5], rows[4, 6] = float("inf"), float("inf")
    rows[5] = torch.randn(300, generator=g)
    for scores in (rows, rows[::3], rows[:, 1::2], torch.randn(8, 32000, generator=g), rows[:1]):
        assert row_argmax(scores) == scores.argmax(dim=-1).tolist()
    assert row_argmax(rows)[:5] == [7, 9, 11, 0, 5]
    assert row_argmax(rows[:0]) == [] == rows[:0].argmax(dim=-1).tolist()  # no rows: no ids
    for empty in (torch.empty(2, 0), torch.empty(0, 0)):  # rows of no scores: refused as torch refuses them
        with pytest.raises(IndexError):
            empty.argmax(dim=-1)
        with pytest.raises(IndexError, match="no scores"):
            row_argmax(empty)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_greedy_tokens_leave_non_finite_or_ragged_steps_to_next_token(bad):
    rows = [torch.tensor([0.1, 3.0, -1.0]), torch.tensor([2.0, 1.0, 0.0])]
    assert greedy_tokens(rows) == [1, 0]
    rows[1][2] = bad
    assert greedy_tokens(rows) is None  # next_token, row by row, refuses only the bad row
    assert greedy_tokens([torch.tensor([0.1, 3.0]), torch.tensor([2.0, 1.0, 0.0])]) is None
    assert greedy_tokens([torch.zeros(0)]) is None
    assert greedy_tokens([]) is None


def test_logits_that_overflow_when_divided_by_the_temperature_are_refused():
    logits = torch.tensor([0.0, 1e37])  # finite, but / 0.01 is Inf in float32
    params = SamplingParams(temperature=MIN_TEMPERATURE, seed=1)
    with pytest.raises(NonFiniteLogits, match="0 NaN and 1 Inf"):
        next_token(logits, params, make_generator(params))


@pytest.mark.parametrize(
    "stop, problem",
    [
        (("x",) * (MAX_STOP_SEQUENCES + 1), f"stop has 17 sequences; at most {MAX_STOP_SEQUENCES} are allowed"),
        (("ok", ""), "stop[1] is empty"),
        (("é" * (MAX_STOP_BYTES // 2 + 1),), f"stop[0] is 258 bytes of UTF-8; at most {MAX_STOP_BYTES} are allowed"),
    ],
)
def test_invalid_stop_sequences(stop, problem):
    assert any(problem in p for p in stop_problems(stop))


def test_stop_sequences_at_the_limits_are_accepted():
    assert stop_problems(("é" * (MAX_STOP_BYTES // 2),) * MAX_STOP_SEQUENCES) == []
    assert stop_problems(()) == []


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


class _MergedBytesTokenizer:
    """Tokens of several bytes each, as BPE vocabularies merge them (the byte tokenizer above has one byte a
    token, so no token there can both complete a stop and start a multi-byte character)."""

    def __init__(self, pieces: list[bytes]):
        self._pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self._pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_a_stop_completed_by_a_token_that_starts_a_multibyte_character_is_not_leaked():
    """The token "D\\xc3" completes "END" and starts "é": the stream used to wait for the next byte, and when
    generation ended there (a length limit) the flush released "END" and a replacement character."""
    tokenizer = _MergedBytesTokenizer([b"hello EN", b"D\xc3", b"\xa9 more"])
    stream = TextStream(tokenizer, ("END",))
    assert stream.push(0) == "hello "
    assert stream.push(1) == "" and stream.stopped
    assert stream.flush() == ""
    # without a stop in it, the incomplete character still waits for its byte
    stream = TextStream(tokenizer, ("XYZ",))
    assert stream.push(0) == "hello EN" and stream.push(1) == "" and stream.push(2) == "Dé more"


def _llama_style_tokenizer():
    """A SentencePiece-style tokenizer as Llama's and Mixtral's are (``▁`` for a space, byte-fallback tokens, the
    decoder dropping the text's first space): the first id of a window decodes without its space, which is what
    the incremental decode's context ids are for."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁hello", "▁world", "a", "é", "▁!"]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    core.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class _WholeDecode(TextStream):
    """The stream as it was: every id decoded again on every token (the reference the windows must agree with)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        super().__init__(tokenizer, stop)
        self._reference = tokenizer

    def _text(self) -> str:
        return self._reference.decode(self._ids, skip_special_tokens=True)


def test_the_released_text_is_the_whole_decodes_while_each_token_decodes_a_few(tokenizer):
    """``TextStream`` decodes each token with the last few ids only (prefix and read offsets) and releases, token
    by token, exactly what a stream decoding every id again releases (``_WholeDecode``), stops included: on the
    project's byte-level tokenizer and a SentencePiece-style one, over random ids (special tokens, bytes that make
    no character, characters split across tokens). A stream of whole characters decodes at most 4 ids a call,
    however long it grows."""
    import random

    llama = _llama_style_tokenizer()
    rng = random.Random(0)
    for tok in (tokenizer, llama):
        for trial in range(40):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
            stop = (tok.decode(ids[3:5], skip_special_tokens=True)[:2],) if trial % 4 == 0 else ()
            stop = tuple(s for s in stop if s)
            streams = TextStream(tok, stop), _WholeDecode(tok, stop)
            for token in ids:
                pieces = [stream.push(token) for stream in streams]
                assert pieces[0] == pieces[1] and streams[0].stopped == streams[1].stopped, (ids, stop)
                if streams[0].stopped:
                    break
            assert streams[0].flush() == streams[1].flush()

    class Counting:
        def __init__(self, tok):
            self.tok, self.lengths = tok, []

        def decode(self, ids, skip_special_tokens=True):
            self.lengths.append(len(ids))
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    for tok, word in ((tokenizer, "a b c é".encode()), (llama, None)):
        counting = Counting(tok)
        stream = TextStream(counting)
        ids = tok("hello é world " * 40)["input_ids"] if word else [260, 261, 262, 263] * 100
        text = "".join(stream.push(t) for t in ids) + stream.flush()
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert max(counting.lengths) <= 4, f"a call decoded {max(counting.lengths)} of {len(ids)} ids"


def test_a_rust_backed_tokenizer_is_decoded_by_its_library_as_transformers_would(tokenizer):
    """``text_stream._decoder``: the ``tokenizers`` library's own decode for a transformers tokenizer backed by it
    with no space clean-up (the same text as ``decode`` over random ids, special tokens and split characters
    included); ``decode`` itself where transformers would do more (clean-up asked for) or for any other object."""
    import random

    from expertmesh.serving.text_stream import _decoder

    rng = random.Random(1)
    llama = _llama_style_tokenizer()
    for tok in (tokenizer, llama):
        decode = _decoder(tok)
        assert decode.func.__self__ is tok._tokenizer  # the library's own
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    llama.clean_up_tokenization_spaces = True
    assert _decoder(llama).func.__self__ is llama  # transformers' decode, its clean-up included
    merged = _MergedBytesTokenizer([b"a", b"\xc3\xa9"])
    assert _decoder(merged)([0, 1]) == "a\u00e9"
