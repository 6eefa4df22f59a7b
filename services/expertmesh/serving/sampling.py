"""Choosing the next token. Pure: logits and parameters in, token ids out.

Before temperature, top-k and top-p, a request's controls change its logits (``controlled``), in
vLLM's order: a bias per token id (OpenAI's ``logit_bias``), no end of sequence before ``min_tokens``
new tokens, then the penalties: ``repetition_penalty`` (transformers' and vLLM's: over the prompt and
the tokens generated, a logit above 0 divided by it, one below multiplied), ``frequency_penalty`` and
``presence_penalty`` (OpenAI's: over the tokens generated, minus the penalty times the token's count,
and minus the penalty once for a token that occurred).

No token is ever chosen from NaN or Inf: argmax picks the NaN index and
torch.multinomial fails or draws garbage, a wrong answer with status OK. Such
logits (a faulty expert, an overflow) raise ``NonFiniteLogits`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
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

#: OpenAI's bounds: a bias in [-100, 100] per token; the penalties in [-2, 2]
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
#: token ids one request may bias (a bound on the request's size), and stop token ids it may name
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 64
#: most likely tokens a request may ask the log-probability of, per new token (OpenAI's chat limit)
MAX_TOP_LOGPROBS = 20
#: choices one request may ask for (``n``)
MAX_CHOICES = 16


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy, else at least MIN_TEMPERATURE; top_k 0 is no limit (a top_k
    above the vocabulary keeps every token); top_p 1.0 is no nucleus cut."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    #: (token id, bias) pairs added to the logits
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: new tokens before an end of sequence (the model's EOS, a stop token id) may be chosen
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def controls(self) -> bool:
        """Whether any control changes the logits (else ``controlled`` returns them as they are)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )

    def problems(self, vocab_size: int | None = None) -> list[str]:
        """What is wrong with these parameters, one line each (``vocab_size``: also check the token ids)."""
        return [message for _, message in self.field_problems(vocab_size)]

    def field_problems(self, vocab_size: int | None = None) -> list[tuple[str, str]]:
        """(the field at fault, what is wrong with it) of each problem of ``problems``."""
        out = []
        temperature = self.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            out.append(("temperature", f"temperature must be >= 0 and finite, got {temperature}"))
        elif 0 < temperature < _MIN_TEMPERATURE_F32:
            out.append(
                (
                    "temperature",
                    f"temperature must be 0 or at least {MIN_TEMPERATURE}, got {temperature}; use 0 for greedy",
                )
            )
        if not 0 < self.top_p <= 1:  # also catches NaN and Inf
            out.append(("top_p", f"top_p must be in (0, 1], got {self.top_p}"))
        if self.top_k < 0:
            out.append(("top_k", f"top_k must be >= 0, got {self.top_k}"))
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            count = len(self.logit_bias)
            out.append(("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {count}"))
        for token, bias in self.logit_bias[:MAX_LOGIT_BIAS_TOKENS]:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                out.append(("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token}"))
                break
        bad = [t for t, _ in self.logit_bias if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = f" (0-{vocab_size - 1})" if vocab_size is not None else ""
            out.append(("logit_bias", f"logit_bias token ids {bad[:5]} are outside the vocabulary{limit}"))
        if self.min_tokens < 0:
            out.append(("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"))
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            out.append(
                ("repetition_penalty", f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                out.append((name, f"{name} must be in [-2, 2], got {value}"))
        return out


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a request's choice ``choice`` (of ``n``): seed + choice, kept in the seed's 64-bit range."""
    if seed is None:
        return None
    seeded = seed + choice
    return seeded - 2**64 if seeded > 2**64 - 1 else seeded


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


def require_choosable(scores: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless a token can be chosen from ``scores`` [V]: no NaN, no +Inf (an overflow),
    not every token at -Inf."""
    if torch.isnan(scores).any() or torch.isposinf(scores).any() or torch.isneginf(scores).all():
        raise NonFiniteLogits(
            "no token can be chosen from the controlled logits: NaN, +Inf (an overflow) or every token masked"
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
    return row_argmax(scores)


def row_argmax(scores: torch.Tensor) -> list[int]:
    """scores [B, V] float -> each row's argmax (ties to the lowest id; a NaN, where there is one, wins, as in
    torch and numpy alike). On the host by numpy's argmax, which is vectorised where torch's CPU argmax reduces
    element by element: 13 / 95 us for 8 / 64 rows of 32000 against torch's 142 / 1150 at one intra-op thread
    and 474 / 1941 at two (this project's 2-core host); elsewhere torch's, where the rows are."""
    if scores.shape[-1] == 0:  # torch's own refusal (numpy's would be a ValueError)
        raise IndexError("row_argmax: rows of no scores have no argmax")
    if scores.device.type == "cpu":
        return scores.detach().numpy().argmax(axis=-1).tolist()
    return scores.argmax(dim=-1).cpu().tolist()


def next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, masked: bool = False
) -> int:
    """logits [V] -> token id. ``masked``: ``logits`` hold -inf on purpose (a grammar's mask), and the
    caller checked the model's logits were finite before."""
    greedy = params.temperature == 0
    scores = logits.float() if greedy else logits.float() / params.temperature  # [V]
    if params.controls or masked:  # ``controlled`` checked the model's logits; its -inf (min_tokens) are on purpose
        require_choosable(scores)
    else:
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


def controlled(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    end_ids: Collection[int],
) -> torch.Tensor:
    """logits [V] with the request's controls applied (the same tensor when it has none). ``end_ids``:
    the token ids that would end the sequence (its EOS when it stops at one, its stop token ids)."""
    if not params.controls:
        return logits
    require_finite(logits)  # the model's own logits, before any control masks a token with -inf
    scores = logits.float().clone()  # [V]
    vocab = scores.numel()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        scores.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype))
    if len(generated) < params.min_tokens:
        ends = [t for t in end_ids if 0 <= t < vocab]
        if ends:
            scores[torch.tensor(ends, dtype=torch.long)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *generated}), dtype=torch.long)
        if seen.numel():
            picked = scores[seen]
            scores[seen] = torch.where(
                picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
            )
    if (params.frequency_penalty or params.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab].to(scores.dtype)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores
