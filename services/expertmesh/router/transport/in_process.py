"""Calls to a group that runs in this very process (``expertmesh up --groups-as in-process``): the group
computes in this process, no copy and no wake-up of another process: on the calling thread, or, where the
transport shares out a layer's calls (``infra.compute_lanes``), side by side with the layer's other calls on a
helper thread and the calling thread.

On a host of a few cores the router and its groups share the same cores anyway; over shared memory each MoE
layer's call still costs a frame each way, a sleeping process woken on each side (whose first op after a
sleep runs on cold caches) and the group's own framing. In the router's process the call is a function
call: the group's ``compute`` (the same one every other path ends in: its checks, its Dispatch slots, its
statistics) reads the router's rows where they lie and its partial sums are the reply.

Which group a route reaches is the group's own answer to the Transports RPC: its shared-memory token (a
secret each group server draws at start) is looked up among the groups this process runs (``Lookup``).
Only the very server that answered matches it: a group stopped, or restarted at the same address, is not
found, and the call goes down the route's list to the paths any group serves.
"""

from __future__ import annotations

from typing import Callable, Protocol

import grpc
import torch
from opentelemetry import context

from expertmesh.infra.compute_lanes import ComputeLanes, Work
from expertmesh.router.transport.base import GroupReply, GroupRequest, PathBroken, TransportError

NAME = "in-process"

#: Rows of a call from which its sender computes it at once at all the lanes' threads (``ComputeLanes.run_wide``)
#: instead of queuing it to be computed beside the layer's other calls, one thread each. Side by side, a layer
#: waits for its larger call (a prompt chunk's calls differ by tens of rows) and each call's own ops run on one
#: thread; at this size a call's products keep two threads busy alone. Measured on this project's 2-core host,
#: the 214M Mixtral's 8 layers, two groups of 4 experts (``grouped_silu_glu_call``): 128 / 256 / 480 tokens a
#: layer 33.6 / 61.1 / 113.9 ms side by side against 31.7 / 58.3 / 105.0 one after the other at two threads; in
#: ``up --groups-as in-process``, a 480-token prompt's step 234-247 ms against 201-216, and 8 clients of 480-token
#: prompts 439-462 against 407-429 ms a token. Decode steps (at most 64 rows a call) keep the lanes: there
#: side by side is the faster (8 sequences 28.3-30.1 against 31.3 ms a step).
WIDE_CALL_ROWS = 128


class InProcessGroup(Protocol):
    """What a group in this process computes a call with (``expert_group.service.ExpertGroupServicer``)."""

    def compute(
        self,
        layer: int,
        version: int,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        parent=None,
        model: str = "",
    ) -> torch.Tensor:
        """hidden [T, H], ids [T, K], weights [T, K] -> partial sums [T, H]; raises the group's refusals."""
        ...

    def attempt(
        self, transport: str, call: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor | None, grpc.StatusCode, str]:
        """``call()`` counted as one call of ``transport``: (partial sums, OK, "") or (None, status, message) of
        its refusal, as the wire carries it back. Never raises."""
        ...


#: the group of this process whose server drew a shared-memory token (None: no group here drew it)
Lookup = Callable[[bytes], "InProcessGroup | None"]


class _Done:
    """A call already answered (or failed) when ``send`` returned: the group computed on the sending thread."""

    transport = NAME

    def __init__(self, reply: GroupReply | None, error: TransportError | None = None):
        self._reply, self._error = reply, error

    def result(self) -> GroupReply:
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply

    def wait(self, timeout_s: float) -> bool:
        return True

    def cancel(self) -> None:
        pass


class _OnLane:
    """A call queued to be computed side by side with the layer's other calls (``ComputeLanes``): by a lane, or
    by the thread that waits on it (``result``), which helps with whatever is queued meanwhile."""

    transport = NAME

    def __init__(self, lanes: ComputeLanes, work: Work):
        self._lanes, self._work = lanes, work

    def result(self) -> GroupReply:
        self._lanes.wait(self._work)
        return self._work.result().result()

    def wait(self, timeout_s: float) -> bool:
        return self._lanes.wait(self._work, max(0.0, timeout_s))

    def cancel(self) -> None:
        self._lanes.cancel(self._work)


class InProcessPath:
    """One group of this process, found by the token its server drew (``lookup``) at each call: a group that
    stopped since is PathBroken, and the call goes another way (and finds it gone). With ``lanes``, a call is
    queued there and computed side by side with the layer's other calls (one of ``WIDE_CALL_ROWS`` rows or more:
    at once, on the sending thread at all the lanes' threads); without, on the sending thread."""

    name = NAME

    def __init__(self, token: bytes, lookup: Lookup, lanes: Callable[[], ComputeLanes | None] = lambda: None):
        """``lanes()``: the lanes the calls of this process share (made at the first call that asks, from the
        sending thread's intra-op threads), or None: each call on the sending thread."""
        self._token, self._lookup, self._lanes = token, lookup, lanes

    def send(self, request: GroupRequest, timeout_s: float) -> _Done | _OnLane:
        group = self._lookup(self._token)
        if group is None:
            raise PathBroken("the group no longer runs in this process")
        # The OpenTelemetry context is the sending thread's: the group's span nests under the call's wherever
        # the call is computed.
        parent = context.get_current()

        def answered() -> _Done:
            partial, code, message = group.attempt(
                NAME,
                lambda: group.compute(
                    request.layer,
                    request.table_version,
                    request.rows(),
                    request.expert_ids,
                    request.weights,
                    parent,
                    model=request.model,
                ),
            )
            if partial is None:  # the group's refusal, as the other paths carry it back; never out of the step
                return _Done(None, TransportError(code, message))
            return _Done(GroupReply(partial, request.row_bytes))

        lanes = self._lanes()
        if lanes is None:
            return answered()
        if request.tokens.numel() >= WIDE_CALL_ROWS:
            return lanes.run_wide(answered)
        return _OnLane(lanes, lanes.submit(answered))

    def prepare(self, deadline: float) -> None:
        if self._lookup(self._token) is None:
            raise PathBroken("the group no longer runs in this process")

    def close(self) -> None:
        pass
