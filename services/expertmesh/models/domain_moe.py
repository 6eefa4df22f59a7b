"""A small Mixtral trained on the project's multi-domain queries, so routing means something.

Random-weight checkpoints route by noise; profiles, heatmaps and routing policies shown on them show
nothing. This one is the embedded default's family (Mixtral, the same byte-level tokenizer) trained on
the classifier's labelled corpus (``expertmesh.classifier.corpus``, train split) for a few hundred
steps on the CPU. The loss: next-byte cross-entropy; Mixtral's own load-balancing loss (experts used
evenly overall, so none collapses); a router z-loss (gate logits kept small); and a domain routing
loss that steers each domain's tokens toward a pair of experts of its own (``domain_experts``), as
DEMix-style domain experts do, but soft: the label is used only in training, so at serving time the
gate has to tell the domain from the text itself. Left to the next-byte loss alone, a model this small
routes by byte class (letters, digits, CJK bytes) and its per-domain profiles hardly differ (measured:
mutual information of domain and expert choice below 0.01 bit per layer, ``--route-coef 0``).

``specialisation`` measures the result on held-out text (the eval split): per MoE layer, the mutual
information between a token's domain and the experts it chooses, and the largest lift (how many times
more often a domain chooses an expert than traffic overall). The same figures for the untrained
initial weights are the baseline: byte statistics alone already differ between domains.

Cache folder: ``$EXPERTMESH_HOME`` or ``~/.cache/expertmesh`` (as ``expertmesh.models.embedded``); the
cached checkpoint's name carries a hash of the recipe and the training corpus, so a change trains a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from expertmesh.classifier.corpus import Example, load_examples, shipped
from expertmesh.infra.home import home
from expertmesh.models.embedded import cached

# Bump the suffix when the shape or the recipe changes, so a stale cache is never reused.
NAME = "domain-moe-v1"
#: ``expertmesh up --model domain-moe`` serves the cached (built on first use) checkpoint
ALIAS = "domain-moe"
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    router_aux_loss_coef=0.02,
)
REPORT = "training.json"  # written beside the checkpoint


@dataclass(frozen=True)
class Recipe:
    steps: int = 400
    seed: int = 0
    per_domain: int = 2  # queries of each domain in every batch, so each batch sees every domain
    max_tokens: int = 128  # a query longer than this many bytes is cut
    lr: float = 3e-3
    warmup: int = 20
    z_loss_coef: float = 1e-3
    route_coef: float = 0.5  # weight of the domain routing loss (0: plain LM training)


@dataclass(frozen=True)
class LayerSpecialisation:
    layer: int
    mutual_information_bits: float  # I(domain; expert choice) over the tokens' top-k picks
    normalised: float  # / H(domain): 0 = routing says nothing about the domain, 1 = all of it
    max_lift: float  # max over (domain, expert) of P(expert | domain) / P(expert)


@dataclass(frozen=True)
class TrainingReport:
    recipe: Recipe
    train_sha256: str  # of the training queries as trained on
    train_queries: int
    first_loss: float  # next-byte cross-entropy (nats), first step
    last_loss: float  # mean of the last 20 steps
    seconds: float
    trained: tuple[LayerSpecialisation, ...]
    untrained: tuple[LayerSpecialisation, ...]  # the same initial weights before any step

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TrainingReport:
        d = json.loads(text)
        layers = lambda rows: tuple(LayerSpecialisation(**r) for r in rows)
        return cls(
            **{
                **d,
                "recipe": Recipe(**d["recipe"]),
                "trained": layers(d["trained"]),
                "untrained": layers(d["untrained"]),
            }
        )


def corpus_hash(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cached_checkpoint(recipe: Recipe = Recipe()) -> Path:
    """The trained checkpoint for ``recipe``, trained on first use."""
    train, held_out = shipped("train"), shipped("eval")
    key = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode() + corpus_hash([train]).encode())
    return cached(
        home() / f"{NAME}-{key.hexdigest()[:12]}",
        lambda staging: train_domain_moe(staging, recipe, load_examples(train), load_examples(held_out)),
    )


def train_domain_moe(
    out: Path, recipe: Recipe, train: Sequence[Example], held_out: Sequence[Example]
) -> TrainingReport:
    """Train from seeded initial weights, save checkpoint + tokenizer + ``training.json`` to ``out``."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertmesh.models.tiny import CONFIG_BUILDERS
    from expertmesh.models.tokenizer import save_byte_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_byte_tokenizer(out, vocab_size=SHAPE["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = CONFIG_BUILDERS["mixtral"](**SHAPE)
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    untrained = specialisation(model, tokenizer, held_out, recipe.max_tokens)

    encoded = [encode(tokenizer, ex.text, recipe.max_tokens) for ex in train]
    domains = sorted({ex.domain for ex in train})
    labels_of = torch.tensor([domains.index(ex.domain) for ex in train])
    members = [torch.nonzero(labels_of == d).flatten() for d in range(len(domains))]
    pairs = torch.zeros((len(domains), config.num_local_experts), dtype=torch.bool)  # [D, E]
    for d, experts in enumerate(domain_experts(len(domains), config.num_local_experts)):
        pairs[d, list(experts)] = True
    order = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    model.train()
    losses = []
    start = time.perf_counter()
    for _ in range(recipe.steps):
        pick = torch.cat([m[torch.randint(len(m), (recipe.per_domain,), generator=order)] for m in members]).tolist()
        ids, mask = pad([encoded[i] for i in pick], tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        result = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        z = torch.stack(
            [torch.logsumexp(logits.float(), dim=-1).pow(2).mean() for logits in result.router_logits]
        ).mean()
        real = mask.flatten().bool()  # router logits are [B*T, E], pads included
        allowed = pairs[labels_of[pick].repeat_interleave(ids.shape[1])[real]]  # [N, E] each real token's pair
        route = torch.stack([domain_routing_loss(logits[real], allowed) for logits in result.router_logits]).mean()
        # result.loss already holds the balancing loss
        loss = result.loss + recipe.z_loss_coef * z + recipe.route_coef * route
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float((result.loss - config.router_aux_loss_coef * result.aux_loss).detach()))
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out)
    report = TrainingReport(
        recipe,
        _examples_hash(train),
        len(train),
        losses[0] if losses else math.nan,
        sum(losses[-20:]) / len(losses[-20:]) if losses else math.nan,
        seconds,
        specialisation(model, tokenizer, held_out, recipe.max_tokens),
        untrained,
    )
    (out / REPORT).write_text(report.to_json() + "\n")
    return report


def domain_experts(num_domains: int, num_experts: int) -> list[tuple[int, int]]:
    """The pair of experts each domain's tokens are steered toward in training: domain i (sorted names) gets
    (i, 3i + 1 + i // E) mod E, so every domain has its own pair and every expert serves two or three
    domains (9 domains on 8 experts: (0,1) (1,4) (2,7) (3,2) (4,5) (5,0) (6,3) (7,6) (0,2))."""
    return [(i % num_experts, (3 * i + 1 + i // num_experts) % num_experts) for i in range(num_domains)]


def domain_routing_loss(router_logits, allowed):
    """-log of the gate probability on the token's domain pair, mean over tokens.

    router_logits [N, E]; allowed [N, E] bool (the token's domain pair). As in DEMix-style domain experts,
    but soft: the gate still chooses freely, and at serving time it sees no label, only the text."""
    import torch

    logp = torch.log_softmax(router_logits.float(), dim=-1)
    return -torch.logsumexp(logp.masked_fill(~allowed, float("-inf")), dim=-1).mean()


def _examples_hash(examples: Sequence[Example]) -> str:
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.text, ex.domain], ensure_ascii=False).encode())
    return digest.hexdigest()


def _lr_factor(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def encode(tokenizer, text: str, max_tokens: int) -> list[int]:
    """A query's byte tokens, cut to ``max_tokens`` with the end-of-sequence token last."""
    return tokenizer(text, add_special_tokens=False)["input_ids"][: max_tokens - 1] + [tokenizer.eos_token_id]


def pad(rows: list[list[int]], pad_id: int):
    """Token rows -> ids [B, T] right-padded, attention mask [B, T] (1 on real tokens)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def domain_choice_counts(model, tokenizer, examples: Sequence[Example], max_tokens: int, batch: int = 32):
    """-> (domains, counts [L, D, E]): top-k expert choices of each domain's tokens per MoE layer."""
    import numpy as np
    import torch

    domains = sorted({ex.domain for ex in examples})
    config = model.config
    counts = np.zeros((config.num_hidden_layers, len(domains), config.num_local_experts))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for first in range(0, len(examples), batch):
            part = examples[first : first + batch]
            ids, mask = pad([encode(tokenizer, ex.text, max_tokens) for ex in part], tokenizer.pad_token_id)
            logits = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits  # L x [B*T, E]
            token_domain = np.repeat([domains.index(ex.domain) for ex in part], ids.shape[1])  # [B*T]
            real = mask.flatten().bool().numpy()
            for layer, layer_logits in enumerate(logits):
                picks = layer_logits.topk(config.num_experts_per_tok, dim=-1).indices.numpy()  # [B*T, k]
                np.add.at(counts[layer], (token_domain[real, None], picks[real]), 1.0)
    model.train(was_training)
    return tuple(domains), counts


def specialisation(model, tokenizer, examples: Sequence[Example], max_tokens: int) -> tuple[LayerSpecialisation, ...]:
    _, counts = domain_choice_counts(model, tokenizer, examples, max_tokens)
    return tuple(layer_specialisation(layer, c) for layer, c in enumerate(counts))


def layer_specialisation(layer: int, counts) -> LayerSpecialisation:
    """counts [D, E] expert choices per domain -> mutual information (bits), normalised, max lift."""
    import numpy as np

    joint = counts / counts.sum()
    p_domain, p_expert = joint.sum(axis=1), joint.sum(axis=0)
    independent = p_domain[:, None] * p_expert[None, :]
    nz = joint > 0
    mi = float((joint[nz] * np.log2(joint[nz] / independent[nz])).sum())
    h_domain = float(-(p_domain[p_domain > 0] * np.log2(p_domain[p_domain > 0])).sum())
    lift = np.divide(joint, independent, out=np.ones_like(joint), where=independent > 0)
    return LayerSpecialisation(layer, mi, mi / h_domain if h_domain > 0 else 0.0, float(lift.max()))
