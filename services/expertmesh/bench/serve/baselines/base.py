"""What a baseline is: something other than the platform serving the same prompts under the same load shape.

Glossary
--------
baseline
    ``Baseline``: a way to serve the run's prompts that the platform is compared with, opened once per
    measurement by its registry entry (``BASELINES[name](setup)``, a context manager: it may load a model
    in this process, or start a server of its own and stop it on exit), then asked for its ``runs`` once
    per repeat, interleaved with the platform's.
load shape
    ``Load``: N clients, R requests each in turn, exactly M greedy tokens a request (no stop at
    end-of-sequence); request r of client c is prompt ``r * N + c`` of the work.
baseline run
    ``BaselineRun``: one row of the report, its requests as their callers saw them (``TimedRequest``:
    when sent, when each chunk of tokens came, which tokens).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from expertmesh.bench.serve.stats import TimedRequest

__all__ = ["Baseline", "BaselineRun", "BaselineSetup", "Load", "StartBaseline"]


@dataclass(frozen=True)
class Load:
    """The load shape every side of a run gets (see the module's glossary)."""

    clients: int  # N
    requests_per_client: int  # R
    max_new_tokens: int  # M


@dataclass(frozen=True)
class BaselineSetup:
    """What a baseline serves and how: the platform's own checkpoint, dtype and device."""

    model: Path  # the checkpoint folder
    dtype: str  # float32, bfloat16 or float16
    device: torch.device  # where this process computes (a server of its own may choose alike)
    pad_token_id: int | None  # the checkpoint's; None: pad with 0


@dataclass
class BaselineRun:
    """One row of the report: a baseline's requests over the work, by whoever sent them."""

    name: str  # the row's name, e.g. "transformers generate, batched x8"
    concurrency: int  # requests in flight at once
    requests: list[TimedRequest]
    #: (steps, tokens, seconds) of its decode steps, every sequence feeding its newest token; None where the
    #: baseline cannot tell its steps apart (the row then has no ``decode_steps``)
    decode: tuple[int, int, float] | None = None


class Baseline(Protocol):
    def runs(self, work: list[list[int]], load: Load) -> list[BaselineRun]:
        """Its timed runs of one repeat over ``work`` (token ids; prompt i is request i of ``load``), each
        after an untimed warm-up. The first run of the first baseline is the reference the platform's
        answers must equal (``stats.same_tokens``): each prompt's greedy tokens, generated alone."""
        ...


#: a registry entry: opens the baseline for a measurement, closes it (a server stopped, a model let go) on exit
StartBaseline = Callable[[BaselineSetup], AbstractContextManager[Baseline]]
