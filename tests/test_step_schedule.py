"""serving.schedule: how many tokens each sequence feeds a step."""

from expertmesh.serving.schedule import step_tokens


def test_decoders_feed_one_token_and_prompts_fill_the_rest_oldest_first():
    pending = [1, 40, 1, 30, 20]
    decoding = [True, False, True, False, False]
    assert step_tokens(pending, decoding, 64) == [1, 40, 1, 22, 0]


def test_everything_fits():
    assert step_tokens([5, 1, 7], [False, True, False], 512) == [5, 1, 7]


def test_a_prompt_moves_on_even_when_decoders_fill_the_budget():
    assert step_tokens([1, 1, 1, 9, 9], [True, True, True, False, False], 2) == [1, 1, 1, 1, 0]


def test_a_one_token_rest_of_prompt_is_still_a_prompt():
    """A prompt's last token is fed like any prompt token (its logits then choose the first new one)."""
    assert step_tokens([1, 3], [False, False], 2) == [1, 1]


def test_empty():
    assert step_tokens([], [], 8) == []
