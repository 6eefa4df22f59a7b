"""Training a ``QueryClassifier`` from labelled queries (torch, CPU, seconds on two cores).

Softmax regression on the weighted bags of ``model.weighted_bag``: an ``EmbeddingBag`` with one column per
domain is exactly the sparse linear layer, trained with Adam and L2 weight decay from zero weights, in
minibatches whose order the seed fixes. The label set is the sorted set of the data's labels, so the
taxonomy is whatever the data says.
"""

from __future__ import annotations

import itertools

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.classifier.corpus import Example
from expertmesh.classifier.features import FeatureConfig, feature_ids
from expertmesh.classifier.model import QueryClassifier, weighted_bag
from expertmesh.contracts.errors import ExpertMeshError


class TrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: int = Field(10, ge=1, description="passes over the training data")
    seed: int = Field(0, description="orders the minibatches; the same seed gives the same model")
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(0.05, gt=0)
    weight_decay: float = Field(1e-4, ge=0, description="L2 penalty on the weights")
    features: FeatureConfig = FeatureConfig()


def inverse_document_frequency(bags: list[list[int]], buckets: int) -> np.ndarray:
    """Smoothed idf per bucket, ``log((1 + n) / (1 + df)) + 1``: [buckets] float32."""
    df = np.zeros(buckets, dtype=np.float64)
    for ids in bags:
        df[np.unique(np.asarray(ids, dtype=np.int64))] += 1
    return (np.log((1 + len(bags)) / (1 + df)) + 1).astype(np.float32)


def train(examples: list[Example], config: TrainConfig | None = None) -> QueryClassifier:
    import torch

    config = config or TrainConfig()
    domains = tuple(sorted({e.domain for e in examples}))
    if len(domains) < 2:
        raise ExpertMeshError(f"training needs at least two domains, the data has {list(domains)}")
    buckets = config.features.buckets
    bags = [feature_ids(e.text, config.features) for e in examples]
    idf = inverse_document_frequency(bags, buckets)
    weighted = [weighted_bag(ids, idf) for ids in bags]
    # Only buckets the data touches get a gradient; from zero weights, AdamW leaves every other row at zero,
    # so training a compact table over the used buckets is exact and several times cheaper.
    used, compact = np.unique(np.concatenate([i for i, _ in weighted]), return_inverse=True)
    bounds = np.cumsum([0] + [len(i) for i, _ in weighted])
    ids = [torch.from_numpy(compact[a:b]) for a, b in itertools.pairwise(bounds)]
    values = [torch.from_numpy(w) for _, w in weighted]
    index = {d: k for k, d in enumerate(domains)}
    labels = torch.tensor([index[e.domain] for e in examples])

    # The ops are tiny: with more than one intra-op thread the time goes to synchronisation (over 5x slower
    # on a loaded two-core machine), so train on one and give the caller its setting back.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer, bias = _fit(ids, values, labels, len(used), len(domains), config)
    finally:
        torch.set_num_threads(threads)
    weights = np.zeros((buckets, len(domains)), dtype=np.float32)
    weights[used] = layer.weight.detach().numpy()
    return QueryClassifier(domains, weights, bias.detach().numpy().copy(), idf, config.features)


def _fit(ids, values, labels, rows: int, classes: int, config: TrainConfig):
    """Softmax regression over ``rows`` compact feature ids: an EmbeddingBag [rows, classes] and a bias [classes]."""
    import torch

    layer = torch.nn.EmbeddingBag(rows, classes, mode="sum")
    bias = torch.nn.Parameter(torch.zeros(classes))
    with torch.no_grad():
        layer.weight.zero_()
    optimiser = torch.optim.AdamW([layer.weight, bias], lr=config.learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.epochs):
        order = torch.randperm(len(labels), generator=generator).tolist()
        for start in range(0, len(order), config.batch_size):
            batch = order[start : start + config.batch_size]
            lengths = torch.tensor([0] + [len(ids[b]) for b in batch[:-1]])
            bags = torch.cat([ids[b] for b in batch])
            weights = torch.cat([values[b] for b in batch])
            logits = layer(bags, offsets=lengths.cumsum(0), per_sample_weights=weights) + bias
            loss = torch.nn.functional.cross_entropy(logits, labels[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return layer, bias
