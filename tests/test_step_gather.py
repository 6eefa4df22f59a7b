"""StepGather: sequences of one step meet at each MoE layer and go out as one dispatch."""

import threading

import pytest
import torch

from expertmesh.router.step_gather import StepGather


class RecordingDispatch:
    def __init__(self, fail_on_layer=None):
        self.calls = []
        self.fail_on_layer = fail_on_layer

    def __call__(self, layer, hidden, index, weights, positions=None, links=()):
        self.calls.append((layer, hidden.shape[0]))
        if layer == self.fail_on_layer:
            raise RuntimeError("group down")
        return hidden * 10 + layer  # a per-row function, so each participant can check its rows


def _run(gather, participants, layers, rows_of):
    results, errors = {}, {}

    def participant(p):
        try:
            hidden = torch.full((rows_of(p), 4), float(p))
            out = hidden
            for layer in layers(p):
                out = gather.experts(layer, out, torch.zeros(rows_of(p), 2, dtype=torch.long), torch.ones(rows_of(p), 2))
            results[p] = out
        except Exception as err:
            errors[p] = err
        finally:
            gather.leave()

    threads = [threading.Thread(target=participant, args=(p,)) for p in range(participants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a participant is stuck"
    return results, errors


def test_one_dispatch_per_layer_with_everyones_rows():
    dispatch = RecordingDispatch()
    results, errors = _run(StepGather(dispatch, 5), 5, lambda p: [0, 1, 2], lambda p: p + 1)
    assert not errors
    assert dispatch.calls == [(0, 15), (1, 15), (2, 15)]
    for p, out in results.items():
        expected = ((torch.full((p + 1, 4), float(p)) * 10 + 0) * 10 + 1) * 10 + 2
        assert torch.equal(out, expected)


def test_a_participant_that_leaves_early_is_not_waited_for():
    dispatch = RecordingDispatch()
    # participant 0 runs no MoE layer at all (e.g. it failed before the first one)
    results, errors = _run(StepGather(dispatch, 3), 3, lambda p: [] if p == 0 else [0, 1], lambda p: 2)
    assert not errors
    assert dispatch.calls == [(0, 4), (1, 4)]


def test_a_failed_dispatch_reaches_every_participant():
    dispatch = RecordingDispatch(fail_on_layer=1)
    results, errors = _run(StepGather(dispatch, 4), 4, lambda p: [0, 1, 2], lambda p: 1)
    assert set(errors) == {0, 1, 2, 3}
    assert all("group down" in str(e) for e in errors.values())
    assert dispatch.calls == [(0, 4), (1, 4)]


def test_single_participant_dispatches_immediately():
    dispatch = RecordingDispatch()
    gather = StepGather(dispatch, 1)
    out = gather.experts(3, torch.ones(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    assert torch.equal(out, torch.full((2, 4), 13.0))
    gather.leave()


def test_diverging_layers_are_an_error():
    gather = StepGather(RecordingDispatch(), 2)
    blocker = threading.Thread(
        target=gather.experts, args=(0, torch.ones(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)), daemon=True
    )
    blocker.start()
    for _ in range(100):
        if gather._pending:
            break
        threading.Event().wait(0.01)
    with pytest.raises(RuntimeError, match="diverged"):
        gather.experts(1, torch.ones(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    gather.leave()
    gather.leave()
    blocker.join(timeout=5)
