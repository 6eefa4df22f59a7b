"""The query classifier: hashed n-gram features -> one linear layer -> softmax over domains.

Why this model. The router classifies once per request on its own CPU, so the model must answer in well under
a millisecond, train on two cores in seconds from the corpus in this package, and read English and Chinese
without a tokenizer or weights to download. A fastText-style bag of hashed word and character n-grams
(``features``) does all of that. The bag feeds the softmax directly (multinomial logistic regression over
TF-IDF weights, ``2**18 x domains`` ~ 2.4 M parameters) instead of through a small embedding first: on a
corpus of about a thousand queries a factorised model learns nothing more, while the direct one is convex,
so training reaches the same answer from any start and a seed only orders the minibatches. Inference is a
gather of a few hundred weight rows and a sum in numpy, read-only, hence thread-safe with no lock.

Labels are whatever strings the training data uses: the default taxonomy is code, math, science, legal,
medical, finance, creative, translation, general, and hierarchical labels (``legal/contract``) are just
labels; ``domain.split("/")[0]`` is the top level.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from expertmesh.classifier.features import FeatureConfig, feature_ids
from expertmesh.contracts.errors import ExpertMeshError

FORMAT = 1


class ModelFileError(ExpertMeshError):
    """A classifier directory is missing, incomplete, or of another format."""


@dataclass(frozen=True)
class Classification:
    domain: str
    confidence: float  # the softmax probability of ``domain``
    seconds: float  # time spent classifying, featurisation included


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int
    domains: tuple[str, ...]
    features: FeatureConfig


def weighted_bag(ids: list[int], idf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids of a bag and their weights: (1 + log count) x idf, L2-normalised (empty bag: empty)."""
    unique, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
    weights = (1.0 + np.log(counts)).astype(np.float32) * idf[unique]
    norm = float(np.linalg.norm(weights))
    return unique, weights / norm if norm > 0 else weights


class QueryClassifier:
    """Domains of queries. ``weights``: [buckets, domains]; ``bias``: [domains]; ``idf``: [buckets]."""

    def __init__(
        self,
        domains: tuple[str, ...],
        weights: np.ndarray,
        bias: np.ndarray,
        idf: np.ndarray,
        features: FeatureConfig,
    ) -> None:
        if (
            weights.shape != (features.buckets, len(domains))
            or bias.shape != (len(domains),)
            or idf.shape != (features.buckets,)
        ):
            raise ModelFileError(
                f"classifier arrays do not fit {len(domains)} domains x {features.buckets} buckets: "
                f"weights {weights.shape}, bias {bias.shape}, idf {idf.shape}"
            )
        self.domains = tuple(domains)
        self.features = features
        self._weights = np.ascontiguousarray(weights, dtype=np.float32)
        self._bias = np.asarray(bias, dtype=np.float32)
        self._idf = np.asarray(idf, dtype=np.float32)

    def probabilities(self, text: str) -> np.ndarray:
        """Softmax over ``domains`` for one text: [domains]."""
        ids, weights = weighted_bag(feature_ids(text, self.features), self._idf)
        logits = weights @ self._weights[ids] + self._bias
        logits -= logits.max()
        exp = np.exp(logits)
        return exp / exp.sum()

    def classify(self, text: str) -> Classification:
        start = time.perf_counter()
        probs = self.probabilities(text)
        best = int(probs.argmax())
        return Classification(self.domains[best], float(probs[best]), time.perf_counter() - start)

    def classify_batch(self, texts: list[str]) -> list[Classification]:
        return [self.classify(text) for text in texts]

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "model.npz", weights=self._weights, bias=self._bias, idf=self._idf)
        meta = _Meta(format=FORMAT, domains=self.domains, features=self.features)
        (directory / "classifier.json").write_text(meta.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> QueryClassifier:
        directory = Path(directory)
        try:
            meta = _Meta.model_validate(json.loads((directory / "classifier.json").read_text()))
            with np.load(directory / "model.npz") as arrays:
                weights, bias, idf = arrays["weights"], arrays["bias"], arrays["idf"]
        except FileNotFoundError as err:
            raise ModelFileError(
                f"{directory} is not a trained classifier: {Path(err.filename).name} is missing"
            ) from None
        except (ValueError, KeyError, OSError) as err:
            raise ModelFileError(f"{directory}: unreadable classifier: {str(err).splitlines()[0]}") from None
        if meta.format != FORMAT:
            raise ModelFileError(
                f"{directory}: classifier format {meta.format}, this version reads {FORMAT}; retrain it"
            )
        return cls(meta.domains, weights, bias, idf, meta.features)
