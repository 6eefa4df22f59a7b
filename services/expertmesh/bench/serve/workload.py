"""The requests' prompts: seeded token ids of the run's shape, or the classifier's text queries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from expertmesh.bench.report import BenchError

if TYPE_CHECKING:
    from expertmesh.bench.serve.options import Options

__all__ = ["FIRST_TOKEN_ID", "prompts", "text_prompts", "text_prompts_summary"]

FIRST_TOKEN_ID = 3  # seeded prompts avoid the tiny models' pad/bos/eos ids (0, 1, 2)


def prompts(options: Options, vocab_size: int) -> list[list[int]]:
    """N x R seeded prompts of prompt_tokens/2 .. prompt_tokens token ids (all prompt_tokens with equal_prompts)."""
    import torch

    gen = torch.Generator().manual_seed(options.seed)
    shortest = options.prompt_tokens if options.equal_prompts else max(1, options.prompt_tokens // 2)
    out = []
    for _ in range(options.clients * options.requests_per_client):
        length = int(torch.randint(shortest, options.prompt_tokens + 1, (1,), generator=gen))
        out.append(torch.randint(FIRST_TOKEN_ID, vocab_size, (length,), generator=gen).tolist())
    return out


def text_prompts(options: Options, checkpoint) -> list[tuple[str, str, int]]:
    """N x R (query, domain, tokens) of the classifier's eval split with at most prompt_tokens tokens, in
    seeded order (repeated when fewer fit)."""
    import random

    from expertmesh.classifier.corpus import load_examples, shipped
    from expertmesh.platform.router_apis import load_tokenizer

    tokenizer = load_tokenizer(checkpoint.path)
    if tokenizer is None:
        raise BenchError(f"--classifier sends text prompts, and the checkpoint {checkpoint.path} has no tokenizer")
    examples = load_examples(shipped("eval"))
    lengths = [len(tokenizer(e.text)["input_ids"]) for e in examples]
    fit = [(e.text, e.domain, n) for e, n in zip(examples, lengths) if n <= options.prompt_tokens]
    if not fit:
        raise BenchError(
            f"--classifier: no query of the classifier's eval split fits --prompt-tokens {options.prompt_tokens} "
            f"(the shortest has {min(lengths)} tokens)"
        )
    random.Random(options.seed).shuffle(fit)
    return [fit[i % len(fit)] for i in range(options.clients * options.requests_per_client)]


def text_prompts_summary(queries: list[tuple[str, str, int]]) -> dict:
    """The JSON's account of ``text_prompts``' queries: where they come from, each one's domain and tokens."""
    return {
        "source": "the classifier's eval split",
        "domains": [d for _, d, _ in queries],
        "lengths": [n for _, _, n in queries],
    }
