"""The ``generate`` baseline: stock transformers ``generate`` in this process, one prompt at a time and batched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from expertmesh.bench.serve.baselines.base import BaselineRun, BaselineSetup, Load
from expertmesh.bench.serve.stats import TimedRequest
from expertmesh.infra.console import progress

__all__ = ["TransformersGenerate", "started"]


class _Clock:
    """A transformers streamer that only notes when generate hands it tokens (the prompt first, then each step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@contextmanager
def started(setup: BaselineSetup) -> Iterator[TransformersGenerate]:
    """Stock transformers loaded once, on ``setup.device``, for every repeat of a measurement."""
    import torch
    from transformers import AutoModelForCausalLM

    progress(f"bench serve: loading stock transformers ({setup.dtype}, on {setup.device})")
    model = (
        AutoModelForCausalLM.from_pretrained(
            setup.model, experts_implementation="eager", dtype=getattr(torch, setup.dtype), local_files_only=True
        )
        .eval()
        .to(setup.device)
    )
    yield TransformersGenerate(model, setup)


class TransformersGenerate:
    """Two runs a repeat: the N × R prompts one after the other (the reference: each prompt alone), then R
    calls of N prompts left-padded into one batch; greedy, with no end-of-sequence token: exactly M tokens,
    as the platform streams them with ``stop_at_eos=False``."""

    def __init__(self, model, setup: BaselineSetup) -> None:
        self._model = model
        self._device = setup.device
        self._pad = setup.pad_token_id if setup.pad_token_id is not None else 0

    def runs(self, work: list[list[int]], load: Load) -> list[BaselineRun]:
        m, n = load.max_new_tokens, load.clients
        progress(f"bench serve: transformers generate, {len(work)} requests one at a time")
        self._generate(work[:1], 2)  # warm-up
        sequential = [r for i, p in enumerate(work) for r in self._generate([p], m, i)]
        progress(f"bench serve: transformers generate, {load.requests_per_client} batches of {n}")
        self._generate(work[:n], 2)  # warm-up
        decode: list[tuple[int, int, float]] = []
        batched = [
            r
            for b in range(load.requests_per_client)
            for r in self._generate(work[b * n : (b + 1) * n], m, b * n, decode)
        ]
        return [
            BaselineRun("transformers generate, one at a time", 1, sequential),
            BaselineRun(
                f"transformers generate, batched x{n}",
                n,
                batched,
                decode=(sum(s for s, _, _ in decode), sum(t for _, t, _ in decode), sum(x for _, _, x in decode)),
            ),
        ]

    def _generate(
        self, batch: list[list[int]], new_tokens: int, first: int = 0, decode: list | None = None
    ) -> list[TimedRequest]:
        """``batch`` = prompts ``first``, ``first`` + 1, ... of the work, in one ``generate``. ``decode``, when
        given, gets (steps, tokens, seconds) of its decode steps: each streamer call after the first token's."""
        import torch

        pad, device = self._pad, self._device
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)  # [B, width]
        clock = _Clock()
        sent = time.perf_counter()
        with torch.no_grad():
            # No end-of-sequence token (rather than min_new_tokens, which forbids it): exactly new_tokens
            # tokens, each the argmax, as the platform streams them with stop_at_eos=False.
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                do_sample=False,
                pad_token_id=pad,
                streamer=clock,
            )  # [B, width + new_tokens]
        steps = clock.times[1:]  # the first call hands over the prompt
        if decode is not None and len(steps) > 1:
            decode.append((len(steps) - 1, (len(steps) - 1) * len(batch), steps[-1] - steps[0]))
        new = out[:, width:].tolist()
        return [TimedRequest(sent, first + j, [(t, 1) for t in steps], new[j]) for j in range(len(batch))]
