"""``expertmesh verify``: the platform against stock transformers on one checkpoint.

Loads the checkpoint into stock transformers (``experts_implementation="eager"``)
and into the platform (router + N expert groups on Ray Serve), runs the same
seeded token batch through both, and greedily decodes 16 tokens with each.
Fails (exit 1) if max |Δ logits| exceeds the tolerance of the dtype or any
token differs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.config.settings import DataPlaneConfig, add_data_plane_arguments
from expertmesh.contracts.errors import CheckpointError
from expertmesh.models.resolve import data_plane_config
from expertmesh.verify.tolerances import VERIFY_TOLERANCE

GREEDY_TOKENS = 16
PROMPT_TOKENS = 8

if TYPE_CHECKING:  # imported where used: the command line builds its parser without torch
    import torch


@dataclass(frozen=True)
class VerifyReport:
    model_type: str
    dtype: str
    groups: int
    tokens: int
    max_abs_diff: float
    tolerance: float
    reference_tokens: list[int]
    platform_tokens: list[int]

    @property
    def tokens_equal(self) -> bool:
        return self.reference_tokens == self.platform_tokens

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.tokens_equal

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.model_type} {self.dtype} groups={self.groups} tokens={self.tokens}: "
            f"max |Δ logits| = {self.max_abs_diff:.3g} (tolerance {self.tolerance:g}); "
            f"greedy {GREEDY_TOKENS} tokens {'identical' if self.tokens_equal else 'DIFFER'}"
        )


def _greedy(model, prompt: torch.Tensor) -> list[int]:
    out = model.generate(
        prompt, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0
    )
    return out[0, prompt.shape[1] :].tolist()


def compare(plane, tokens: int = 32, seed: int = 0) -> VerifyReport:
    """Run the seeded batch through ``plane.model`` and stock transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    config = plane.checkpoint.config.get_text_config()
    limit = plane.checkpoint.spec.max_context
    if tokens < 1 or (limit and tokens > limit) or (limit and PROMPT_TOKENS + GREEDY_TOKENS > limit):
        raise CheckpointError(f"--tokens must be between 1 and the model's context of {limit} tokens, got {tokens}")
    dtype = getattr(torch, plane.config.dtype)
    device = plane.model.device  # the reference computes where the router does
    reference = (
        AutoModelForCausalLM.from_pretrained(
            plane.checkpoint.path, experts_implementation="eager", dtype=dtype, local_files_only=True
        )
        .eval()
        .to(device)
    )
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, config.vocab_size, (2, tokens), generator=generator).to(device)  # [2, tokens]
    with torch.no_grad():
        expected = reference(batch).logits.float()
        actual = plane.model(batch).logits.float()
        prompt = batch[:1, :PROMPT_TOKENS]
        reference_tokens = _greedy(reference, prompt)
        platform_tokens = _greedy(plane.model, prompt)
    return VerifyReport(
        model_type=plane.checkpoint.spec.model_type,
        dtype=plane.config.dtype,
        groups=len(plane.placement.groups),
        tokens=tokens,
        max_abs_diff=float((expected - actual).abs().max()),
        tolerance=VERIFY_TOLERANCE[plane.config.dtype],
        reference_tokens=reference_tokens,
        platform_tokens=platform_tokens,
    )


def run(config: DataPlaneConfig, tokens: int = 32, seed: int = 0) -> VerifyReport:
    from expertmesh.platform.data_plane import DataPlane

    with DataPlane.start(config) as plane:
        return compare(plane, tokens, seed)


def add_command(commands) -> None:
    parser = commands.add_parser("verify", help="check the platform against stock transformers on a checkpoint")
    add_data_plane_arguments(parser)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence of the seeded batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token batch")
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="the report as JSON: on stdout, or into FILE"
    )
    sweep = parser.add_argument_group("sweep: every MoE family of the installed transformers, tiny and random")
    sweep.add_argument("--sweep", action="store_true", help="run every family (or --families) instead of --model")
    sweep.add_argument("--families", help="comma-separated families to sweep (default: all)")
    sweep.add_argument("--family-timeout", type=int, default=600, metavar="S", help="seconds one family may take")
    sweep.add_argument(
        "--markdown", dest="markdown_from", metavar="JSON", help="print the table of a sweep's JSON file"
    )
    sweep.add_argument(
        "--markdown-command", default="expertmesh verify --sweep", help="the command named above the table"
    )
    parser.set_defaults(run=_main)


def _main(args) -> int:
    if args.sweep or args.markdown_from is not None:
        from expertmesh.verify import sweep as verify_sweep

        return verify_sweep.main(args)
    report = run(data_plane_config(args), tokens=args.tokens, seed=args.seed)
    if args.json is None:
        print(report.summary())
    elif args.json == "-":
        print(json.dumps({**asdict(report), "passed": report.passed}))
    else:
        print(report.summary())
        Path(args.json).write_text(json.dumps({**asdict(report), "passed": report.passed}) + "\n")
    return 0 if report.passed else 1
