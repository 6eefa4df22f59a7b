"""Choosing the next token. Pure: logits and parameters in, token ids out.

No token is ever chosen from NaN or Inf: argmax picks the NaN index and
torch.multinomial fails or draws garbage, a wrong answer with status OK. Such
logits (a faulty expert, an overflow) raise ``NonFiniteLogits`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from expertmesh.contracts.errors import NonFiniteLogits
from expertmesh.infra.finite import all_finite

#: The smallest temperature above 0 (vLLM's floor too). Below it, dividing by the
#: temperature blows logit gaps up until sampling is greedy in all but name and, far
#: enough down, overflows float32 to Inf; 0 asks for greedy decoding explicitly.
MIN_TEMPERATURE = 1e-2
# temperature is a float32 on the wire: a client that sends 0.01 arrives as 0.0099999998.
_MIN_TEMPERATURE_F32 = float(torch.tensor(MIN_TEMPERATURE, dtype=torch.float32))


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy, else at least MIN_TEMPERATURE; top_k 0 is no limit (a top_k
    above the vocabulary keeps every token); top_p 1.0 is no nucleus cut."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def problems(self) -> list[str]:
        out = []
        temperature = self.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            out.append(f"temperature must be >= 0 and finite, got {temperature}")
        elif 0 < temperature < _MIN_TEMPERATURE_F32:
            out.append(f"temperature must be 0 or at least {MIN_TEMPERATURE}, got {temperature}; use 0 for greedy")
        if not 0 < self.top_p <= 1:  # also catches NaN and Inf
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0, got {self.top_k}")
        return out


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def require_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits if any value of ``logits`` (any shape) is NaN or Inf."""
    if not all_finite(logits):  # counting is only for the message
        nan = int(torch.isnan(logits).sum())
        inf = int(torch.isinf(logits).sum())
        raise NonFiniteLogits(
            f"the logits held {nan} NaN and {inf} Inf values (of {logits.numel()}): "
            "a faulty expert or an overflow; no token can be chosen from them"
        )


def greedy_tokens(rows: list[torch.Tensor]) -> list[int] | None:
    """The greedy choice for each of ``rows`` ([V] logits each) in one pass for all of them, the very
    ids ``next_token`` picks one row at a time (argmax, ties to the lowest id). None when one pass
    cannot answer: rows of different or no widths, or a NaN or Inf anywhere; then ``next_token``
    row by row raises for the rows that are bad and for no other."""
    if not rows or len({row.shape for row in rows}) != 1 or rows[0].numel() == 0:
        return None
    scores = torch.stack(rows).detach().float()  # [B, V]
    if not all_finite(scores):
        return None
    # numpy's argmax is vectorised: 19 us for 8 x 32000 here, torch's 600 (the engine's logits are on the host)
    return scores.cpu().numpy().argmax(axis=-1).tolist()


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> token id."""
    greedy = params.temperature == 0
    scores = logits.float() if greedy else logits.float() / params.temperature  # [V]
    require_finite(scores)  # after the division, which can overflow
    if greedy:
        return int(torch.argmax(scores))
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
