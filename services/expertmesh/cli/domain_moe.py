"""``expertmesh tiny train-domain-moe``: train the small domain MoE (``expertmesh.models.domain_moe``) and print
how specialised its routing came out on held-out text.

Without ``--out`` the checkpoint goes to the cache that ``expertmesh up --model domain-moe`` serves from
(trained there on first use anyway); an existing cached checkpoint for the same recipe and corpus is
reused, not retrained.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from expertmesh.contracts.errors import ExpertMeshError


def add_command(commands) -> None:
    tiny = commands.add_parser("tiny", help="small built-in models")
    sub = tiny.add_subparsers(dest="tiny_command", required=True, metavar="ACTION")
    train = sub.add_parser(
        "train-domain-moe", help="train the small Mixtral on the multi-domain corpus (routing that means something)"
    )
    train.add_argument(
        "--out", type=Path, help="checkpoint folder to write (default: the cache `up --model domain-moe` uses)"
    )
    train.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's, 400)")
    train.add_argument("--seed", type=int, help="seed of the initial weights and batch order (default 0)")
    train.add_argument(
        "--route-coef", type=float, help="weight of the domain routing loss (default 0.5; 0: next-byte loss only)"
    )
    train.add_argument("--json", action="store_true", help="print the training report as JSON")
    train.set_defaults(run=_train)


def _train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from expertmesh.classifier.corpus import load_examples, shipped
    from expertmesh.models.domain_moe import REPORT, Recipe, TrainingReport, cached_checkpoint, train_domain_moe

    recipe = Recipe()
    if args.steps is not None:
        if args.steps < 1:
            raise ExpertMeshError(f"--steps must be >= 1, got {args.steps}")
        recipe = replace(recipe, steps=args.steps)
    if args.seed is not None:
        recipe = replace(recipe, seed=args.seed)
    if args.route_coef is not None:
        if not 0 <= args.route_coef <= 10:
            raise ExpertMeshError(f"--route-coef must be between 0 and 10, got {args.route_coef}")
        recipe = replace(recipe, route_coef=args.route_coef)
    if args.out is None:
        path = cached_checkpoint(recipe)
        report = TrainingReport.from_json((path / REPORT).read_text())
    else:
        if (args.out / "config.json").exists():
            raise ExpertMeshError(f"{args.out} already holds a checkpoint; choose an empty folder")
        path = args.out
        report = train_domain_moe(path, recipe, load_examples(shipped("train")), load_examples(shipped("eval")))
    print(report.to_json() if args.json else format_report(report, path))
    return 0


def format_report(report, path: Path) -> str:
    lines = [
        f"{path}: {report.recipe.steps} steps (seed {report.recipe.seed}) on {report.train_queries} queries"
        f" in {report.seconds:.0f} s; next-byte loss {report.first_loss:.3f} -> {report.last_loss:.3f} nats",
        "routing on held-out queries: mutual information of domain and expert choice (bits; share of H(domain)),"
        " max lift",
        f"{'layer':>5} {'trained MI':>11} {'norm':>6} {'max lift':>9}   "
        f"{'untrained MI':>12} {'norm':>6} {'max lift':>9}",
    ]
    for t, u in zip(report.trained, report.untrained):
        lines.append(
            f"{t.layer:>5} {t.mutual_information_bits:>11.4f} {t.normalised:>6.3f} {t.max_lift:>9.2f}"
            f"   {u.mutual_information_bits:>12.4f} {u.normalised:>6.3f} {u.max_lift:>9.2f}"
        )
    return "\n".join(lines)
