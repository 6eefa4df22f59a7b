"""serving.schedule: how many tokens each sequence feeds a step."""

from collections import Counter

from expertmesh.serving.schedule import next_admission, step_tokens


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


def test_admission_takes_a_preempted_sequence_back_first():
    assert next_admission([("a", False), ("b", True), ("c", True)], ["a", "a"]) == 1


def test_admission_serves_the_client_with_the_fewest_active_sequences_first():
    """One client's burst of 16 choices queued ahead of another client's one request: the other goes first
    once the burst's client holds more slots, and each client's own requests keep their order."""
    burst = [("tenant-a", False)] * 16
    assert next_admission([*burst, ("tenant-b", False)], []) == 0, "nobody active: first come, first served"
    assert next_admission([*burst, ("tenant-b", False)], ["tenant-a"]) == 16
    assert next_admission([("a", False), ("b", False), ("a", False)], ["b", "a", "b"]) == 0
    assert next_admission([], ["a"]) is None


def test_admission_shares_slots_fairly_as_they_free():
    """Simulated: 8 slots, client a queues 16 at once, then b queues 4. As a's sequences end one at a time, the
    freed slots go to b until b holds its share (4 of 8)."""
    active, queued = [], [("a", False)] * 16
    while len(active) < 8:
        active.append(queued.pop(next_admission(queued, active))[0])
    queued += [("b", False)] * 4
    for _ in range(4):
        active.remove("a")
        active.append(queued.pop(next_admission(queued, active))[0])
    assert Counter(active) == {"a": 4, "b": 4}
