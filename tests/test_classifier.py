"""The query classifier: metrics on hand-computed cases, deterministic training, save/load, the default
model's quality on the shipped eval split (English and Chinese), and the commands' bad-input paths.

Nothing is faked: the default model is trained from the shipped corpus into a temporary cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from expertmesh.classifier import (
    Classification,
    QueryClassifier,
    cache,
    default_classifier,
)
from expertmesh.classifier.corpus import Example, load_examples, shipped
from expertmesh.classifier.evaluate import (
    accuracy,
    confusion_matrix,
    macro_f1,
    per_domain_scores,
)
from expertmesh.classifier.features import FeatureConfig, features
from expertmesh.classifier.train import TrainConfig, train
from expertmesh.cli.main import main

PROBES = [
    "How do I fix a KeyError when reading a dict in Python?",
    "Prove that the sum of two even numbers is even",
    "我的合同被对方违约了，可以要求赔偿吗",
    "头疼发烧三天了，要不要去医院",
    "Translate 'good evening' into Italian",
    "写一首关于大海的诗",
]


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """The default classifier, trained into a fresh cache folder (the process-wide singleton is reset)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("EXPERTMESH_HOME", str(tmp_path_factory.mktemp("home")))
    patch.setattr(cache, "_default", None)
    yield default_classifier()
    patch.undo()


@pytest.fixture(scope="module")
def small():
    """A fifth of the shipped train split: enough to learn something, quick to train twice."""
    return load_examples(shipped("train"))[::5]


# -- metrics: pure functions on hand-computed cases ------------------------------------


def test_confusion_matrix_counts_true_by_predicted():
    truth = ["a", "a", "b", "b", "c"]
    predicted = ["a", "b", "b", "b", "a"]
    assert confusion_matrix(truth, predicted, ["a", "b", "c"]) == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]


def test_scores_and_macro_f1_by_hand():
    matrix = [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    scores = per_domain_scores(matrix, ["a", "b", "c"])
    # a: precision 1/2, recall 1/2, F1 1/2; b: precision 2/3, recall 1, F1 0.8; c: never right, F1 0.
    assert scores["a"].precision == pytest.approx(0.5) and scores["a"].recall == pytest.approx(0.5)
    assert scores["b"].precision == pytest.approx(2 / 3) and scores["b"].recall == 1.0
    assert scores["b"].f1 == pytest.approx(0.8)
    assert scores["c"].f1 == 0.0 and scores["c"].support == 1
    assert macro_f1(scores) == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert accuracy(matrix) == pytest.approx(3 / 5)


def test_macro_f1_ignores_domains_absent_from_the_truth():
    scores = per_domain_scores([[2, 0], [0, 0]], ["a", "b"])
    assert macro_f1(scores) == 1.0


# -- features and training -------------------------------------------------------------


def test_chinese_is_cut_into_character_ngrams_and_digits_fold():
    grams = features("合同违约 2024", FeatureConfig())
    assert {"h合", "h合同", "h合同违", "h约"} <= set(grams)
    assert "w0000" in grams and not any("2" in g for g in grams)


def test_training_is_deterministic_with_a_seed(small):
    texts = [e.text for e in small[:50]] + PROBES
    config = TrainConfig(epochs=3, seed=7)
    first, second = train(small, config), train(small, config)
    other = train(small, TrainConfig(epochs=3, seed=8))
    assert all(np.array_equal(first.probabilities(t), second.probabilities(t)) for t in texts)
    assert not all(np.array_equal(first.probabilities(t), other.probabilities(t)) for t in texts)


def test_save_load_round_trip_gives_the_same_predictions(small, tmp_path):
    model = train(small, TrainConfig(epochs=2))
    model.save(tmp_path / "m")
    loaded = QueryClassifier.load(tmp_path / "m")
    assert loaded.domains == model.domains
    for text in [e.text for e in small[:50]] + PROBES:
        assert np.array_equal(loaded.probabilities(text), model.probabilities(text))


def test_the_label_set_comes_from_the_data():
    examples = [
        Example("draft an NDA clause", "legal/contract"),
        Example("court appeal deadline", "legal/litigation"),
    ] * 3
    model = train(examples, TrainConfig(epochs=5))
    assert model.domains == ("legal/contract", "legal/litigation")
    assert model.classify("please draft an NDA clause").domain == "legal/contract"


# -- the default model -------------------------------------------------------------------


def test_default_model_meets_the_macro_f1_target_on_the_eval_split(default, capsys):
    assert main(["classifier", "eval", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    report = json.loads(out[0])
    assert set(report) == {"accuracy", "macro_f1", "per_domain", "latency_ms", "n"}
    assert report["n"] == len(load_examples(shipped("eval")))
    assert set(report["per_domain"]) == set(default.domains)
    assert set(report["per_domain"]["code"]) == {"precision", "recall", "f1", "support"}
    assert (
        set(report["latency_ms"]) == {"p50", "p99"} and 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
    )
    assert report["macro_f1"] >= 0.85, report


def test_default_model_classifies_chinese(default):
    chinese = [e for e in load_examples(shipped("eval")) if any("\u4e00" <= c <= "\u9fff" for c in e.text)]
    right = sum(default.classify(e.text).domain == e.domain for e in chinese)
    assert len(chinese) >= 9 * 7 and right / len(chinese) >= 0.8
    assert [default.classify(t).domain for t in PROBES[2:]] == ["legal", "medical", "translation", "creative"]


def test_classify_returns_a_label_confidence_and_time(default):
    results = default.classify_batch(PROBES[:2])
    assert [r.domain for r in results] == ["code", "math"]
    for r in results:
        assert isinstance(r, Classification) and 0 < r.confidence <= 1 and r.seconds > 0
    assert default.classify("").domain in default.domains  # no features: the prior, not an error


def test_default_model_is_cached_and_not_retrained(default, monkeypatch):
    path = cache.default_model_dir()
    assert (path / "classifier.json").is_file()
    monkeypatch.setattr(cache, "train", lambda *_: pytest.fail("retrained a cached model"))
    assert cache.build_default(path) == path
    assert default_classifier() is default


_TRAIN_ONCE = """
import sys, time
from expertmesh.classifier import cache
from expertmesh.classifier.corpus import Example
real = cache.train
def counted(examples):
    with open(sys.argv[1], "a") as log:
        log.write("trained\\n")
    time.sleep(3)  # hold the lock long enough for the other process to arrive
    return real(examples, cache.TrainConfig(epochs=1))
cache.train = counted
cache.default_training_examples = lambda: [Example("solve x", "math"), Example("fix bug", "code")]
cache.build_default(cache.default_model_dir())
"""


def test_two_processes_build_the_default_model_once(tmp_path):
    """The real lock and cache folder; only the training data is cut to two lines so the test is quick."""
    log = tmp_path / "log"
    env = {**os.environ, "EXPERTMESH_HOME": str(tmp_path / "home")}
    procs = [subprocess.Popen([sys.executable, "-c", _TRAIN_ONCE, str(log)], env=env) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert log.read_text().count("trained") == 1
    assert len(list((tmp_path / "home").glob("classifier-*/classifier.json"))) == 1


# -- commands ----------------------------------------------------------------------------


def test_train_command_writes_a_loadable_model(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": t, "domain": d}) + "\n"
            for t, d in [
                ("solve the integral", "math"),
                ("prove the lemma", "math"),
                ("fix my python bug", "code"),
                ("git merge conflict", "code"),
            ]
        )
    )
    assert (
        main(
            ["classifier", "train", "--data", str(data), "--out", str(tmp_path / "m"), "--epochs", "20", "--seed", "3"]
        )
        == 0
    )
    assert QueryClassifier.load(tmp_path / "m").domains == ("code", "math")
    assert main(["classifier", "predict", "--model", str(tmp_path / "m"), "a python bug"]) == 0
    assert capsys.readouterr().out.split("\t")[0] == "code"


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    model = tmp_path / "m"
    train([Example("solve x", "math"), Example("fix bug", "code")], TrainConfig(epochs=1)).save(model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok", "domain": "math"}\n\n{"text": "oops"\n')
    assert "bad.jsonl:3: not JSON" in _one_line_error(
        capsys, ["classifier", "eval", "--model", str(model), "--data", str(bad)]
    )
    bad.write_text('{"text": "ok", "domain": "math"}\n["text", "domain"]\n')
    assert "bad.jsonl:2: expected" in _one_line_error(
        capsys, ["classifier", "train", "--data", str(bad), "--out", str(model)]
    )
    assert "no such file" in _one_line_error(capsys, ["classifier", "eval", "--data", str(tmp_path / "none.jsonl")])
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"text": "x", "domain": "math"}\n{"text": "y", "domain": "poetry"}\n')
    err = _one_line_error(capsys, ["classifier", "eval", "--model", str(model), "--data", str(unknown)])
    assert "unknown.jsonl:2: domain 'poetry' is not one the model knows" in err
    assert "not a trained classifier" in _one_line_error(
        capsys, ["classifier", "predict", "--model", str(tmp_path), "hi"]
    )
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "x", "domain": "math"}\n')
    assert "at least two domains" in _one_line_error(
        capsys, ["classifier", "train", "--data", str(one), "--out", str(model)]
    )
