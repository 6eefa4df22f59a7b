"""How good and how fast a classifier is on labelled queries.

The metrics are pure functions of label lists; ``evaluate`` runs the classifier one query at a time (the way
the router calls it) and times each call, featurisation included.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from expertmesh.classifier.corpus import Example
from expertmesh.classifier.model import QueryClassifier


class DomainScore(BaseModel):
    precision: float
    recall: float
    f1: float
    support: int


class LatencyMs(BaseModel):
    p50: float
    p99: float


class EvalReport(BaseModel):
    accuracy: float
    macro_f1: float
    per_domain: dict[str, DomainScore]
    latency_ms: LatencyMs
    n: int
    domains: list[str]
    confusion: list[list[int]]  # [true domain][predicted domain], in ``domains`` order


def confusion_matrix(truth: list[str], predicted: list[str], domains: list[str]) -> list[list[int]]:
    """Counts of [true][predicted] over ``domains`` (both lists must use only those labels)."""
    index = {d: k for k, d in enumerate(domains)}
    matrix = [[0] * len(domains) for _ in domains]
    for t, p in zip(truth, predicted, strict=True):
        matrix[index[t]][index[p]] += 1
    return matrix


def per_domain_scores(matrix: list[list[int]], domains: list[str]) -> dict[str, DomainScore]:
    """Precision, recall and F1 per domain; a ratio with nothing to divide by counts as 0."""
    scores = {}
    for k, domain in enumerate(domains):
        hits = matrix[k][k]
        predicted = sum(row[k] for row in matrix)
        support = sum(matrix[k])
        precision = hits / predicted if predicted else 0.0
        recall = hits / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        scores[domain] = DomainScore(precision=precision, recall=recall, f1=f1, support=support)
    return scores


def macro_f1(scores: dict[str, DomainScore]) -> float:
    """Mean F1 over the domains that occur in the truth (a domain absent from the data does not count)."""
    present = [s.f1 for s in scores.values() if s.support]
    return sum(present) / len(present) if present else 0.0


def accuracy(matrix: list[list[int]]) -> float:
    total = sum(map(sum, matrix))
    return sum(matrix[k][k] for k in range(len(matrix))) / total if total else 0.0


def evaluate(classifier: QueryClassifier, examples: list[Example]) -> EvalReport:
    results = [classifier.classify(e.text) for e in examples]
    domains = list(classifier.domains)
    matrix = confusion_matrix([e.domain for e in examples], [r.domain for r in results], domains)
    scores = per_domain_scores(matrix, domains)
    ms = np.array([r.seconds for r in results]) * 1000
    return EvalReport(
        accuracy=accuracy(matrix),
        macro_f1=macro_f1(scores),
        per_domain=scores,
        latency_ms=LatencyMs(p50=float(np.percentile(ms, 50)), p99=float(np.percentile(ms, 99))),
        n=len(examples),
        domains=domains,
        confusion=matrix,
    )
