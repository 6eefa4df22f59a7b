"""One MoE dispatch per layer for all sequences of a decode step.

Under continuous batching every active sequence runs its own forward pass (its
own KV cache, so attention is exactly what it would be alone), each in its own
thread. At each MoE layer the threads meet here: the last one to arrive sends
everybody's tokens to the expert groups as one dispatch, and each thread takes
back its rows. All participants pass the MoE layers in the same order, so only
one layer is ever pending.

A participant that finishes its forward (or fails) ``leave``s, so the others
never wait for it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

# (layer, hidden [T, H], top_k_index [T, K], top_k_weights [T, K], positions [T] or None, links) -> [T, H]
DispatchFn = Callable[..., torch.Tensor]


class StepGather:
    def __init__(self, dispatch: DispatchFn, participants: int):
        self.size = participants
        self._dispatch = dispatch
        self._cond = threading.Condition()
        self._active = participants
        self._layer: int | None = None
        # (hidden [n_i, H], top_k_index [n_i, K], top_k_weights [n_i, K], positions [n_i] | None,
        #  trace context | None) per arrived participant
        self._pending: list[tuple] = []
        self._round = 0
        self._results: dict[int, list[torch.Tensor] | BaseException] = {}
        self._collected: dict[int, int] = {}  # round -> participants that took their result
        self._participants_of: dict[int, int] = {}  # round -> participants in it

    def experts(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        positions: torch.Tensor | None = None,
        trace_context=None,
    ) -> torch.Tensor:
        """Called by each participant at each MoE layer; returns its own [n_i, H] expert output.

        ``trace_context``: the participant's span, linked from the shared dispatch's spans.
        """
        with self._cond:
            if self._pending and layer != self._layer:
                raise RuntimeError(f"step participants diverged: layer {layer} while layer {self._layer} is pending")
            self._layer = layer
            my_round, my_slot = self._round, len(self._pending)
            self._pending.append((hidden, top_k_index, top_k_weights, positions, trace_context))
            if len(self._pending) >= self._active:
                self._flush()
            while my_round not in self._results:
                self._cond.wait()
            result = self._results[my_round]
            self._collected[my_round] += 1
            if self._collected[my_round] == self._participants_of[my_round]:
                del self._results[my_round], self._collected[my_round], self._participants_of[my_round]
        if isinstance(result, BaseException):
            raise result
        return result[my_slot]

    def leave(self) -> None:
        """A participant's forward pass is over; stop waiting for it."""
        with self._cond:
            self._active -= 1
            if self._pending and len(self._pending) >= self._active:
                self._flush()

    def _flush(self) -> None:
        """Dispatch the pending layer for everyone (lock held: the others are waiting anyway)."""
        pending, self._pending = self._pending, []
        sizes = [p[0].shape[0] for p in pending]
        positions = [p[3] for p in pending]
        try:
            out = self._dispatch(
                self._layer,
                torch.cat([p[0] for p in pending]),  # [sum n_i, H]
                torch.cat([p[1] for p in pending]),  # [sum n_i, K]
                torch.cat([p[2] for p in pending]),  # [sum n_i, K]
                None if any(x is None for x in positions) else torch.cat(positions),  # [sum n_i]
                [p[4] for p in pending if p[4] is not None],
            )
            result: list[torch.Tensor] | BaseException = list(torch.split(out, sizes))
        except BaseException as err:  # every participant of the round must see the failure
            result = err
        self._results[self._round] = result
        self._collected[self._round] = 0
        self._participants_of[self._round] = len(pending)
        self._round += 1
        self._cond.notify_all()
