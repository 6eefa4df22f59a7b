"""``expertmesh classifier train|eval|predict``: the query classifier from the command line.

``--data`` defaults to the shipped data (train split and terms for ``train``, eval split for ``eval``) and
``--model`` to the default classifier, trained and cached on first use.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def add_command(commands) -> None:
    classifier = commands.add_parser("classifier", help="the query classifier: train, evaluate, predict")
    sub = classifier.add_subparsers(dest="classifier_command", required=True, metavar="ACTION")

    train = sub.add_parser("train", help="train a classifier on labelled queries (JSONL text/domain lines)")
    train.add_argument(
        "--data",
        type=Path,
        action="append",
        help="labelled queries, repeatable (default: the shipped train split and terms)",
    )
    train.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    train.add_argument("--epochs", type=int, help="passes over the data (default 10)")
    train.add_argument("--seed", type=int, help="minibatch order; the same seed gives the same model (default 0)")
    train.set_defaults(run=_train)

    evaluate = sub.add_parser("eval", help="accuracy, macro-F1, confusion matrix and latency on labelled queries")
    evaluate.add_argument("--data", type=Path, help="labelled queries (default: the shipped eval split)")
    evaluate.add_argument("--model", type=Path, help="a trained classifier directory (default: the default one)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    evaluate.set_defaults(run=_eval)

    predict = sub.add_parser("predict", help="classify one query")
    predict.add_argument("text", help="the query to classify")
    predict.add_argument("--model", type=Path, help="a trained classifier directory (default: the default one)")
    predict.set_defaults(run=_predict)


def _classifier(model: Path | None):
    from expertmesh.classifier import QueryClassifier, default_classifier

    return QueryClassifier.load(model) if model else default_classifier()


def _train(args) -> int:
    from expertmesh.classifier.corpus import default_training_examples, load_examples
    from expertmesh.classifier.train import TrainConfig, train

    examples = [e for path in args.data for e in load_examples(path)] if args.data else default_training_examples()
    config = TrainConfig(**{k: v for k, v in (("epochs", args.epochs), ("seed", args.seed)) if v is not None})
    start = time.perf_counter()
    classifier = train(examples, config)
    classifier.save(args.out)
    print(
        f"trained on {len(examples)} queries, {len(classifier.domains)} domains ({', '.join(classifier.domains)}) "
        f"in {time.perf_counter() - start:.1f} s; wrote {args.out}",
        file=sys.stderr,
    )
    return 0


def _eval(args) -> int:
    from expertmesh.classifier.corpus import CorpusError, load_examples, shipped
    from expertmesh.classifier.evaluate import evaluate

    path = args.data or shipped("eval")
    examples = load_examples(path)
    classifier = _classifier(args.model)
    unknown = [e for e in examples if e.domain not in classifier.domains]
    if unknown:
        names = sorted({e.domain for e in unknown})
        raise CorpusError(
            f"{path}:{unknown[0].line}: domain {unknown[0].domain!r} is not one the model knows "
            f"({len(unknown)} queries in {', '.join(names)}; model: {', '.join(classifier.domains)})"
        )
    report = evaluate(classifier, examples)
    if args.json:
        print(json.dumps(report.model_dump(include={"accuracy", "macro_f1", "per_domain", "latency_ms", "n"})))
    else:
        print(format_report(report))
    return 0


def format_report(report) -> str:
    lines = [
        (
            f"{report.n} queries   accuracy {report.accuracy:.3f}   macro-F1 {report.macro_f1:.3f}   "
            f"latency per query p50 {report.latency_ms.p50:.3f} ms  p99 {report.latency_ms.p99:.3f} ms"
        ),
        "",
        f"{'domain':<16}{'precision':>10}{'recall':>10}{'F1':>10}{'n':>6}",
    ]
    for domain, s in report.per_domain.items():
        lines.append(f"{domain:<16}{s.precision:>10.3f}{s.recall:>10.3f}{s.f1:>10.3f}{s.support:>6}")
    lines += [
        "",
        "confusion (rows: true, columns: predicted)",
        " " * 16 + "".join(f"{d[:5]:>6}" for d in report.domains),
    ]
    for domain, row in zip(report.domains, report.confusion, strict=True):
        lines.append(f"{domain:<16}" + "".join(f"{c:>6}" for c in row))
    return "\n".join(lines)


def _predict(args) -> int:
    result = _classifier(args.model).classify(args.text)
    print(f"{result.domain}\t{result.confidence:.3f}")
    return 0
