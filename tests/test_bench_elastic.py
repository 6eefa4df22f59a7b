"""``expertmesh bench elastic``'s pure parts: phases cut from the clients' records, ITL ratios, the group
figures and the table; bad flags (exit 2, one line, nothing started). The run itself:
``test_elastic_groups_live.py``."""

import math

import pytest

from expertmesh.bench.elastic import Window, add_figures, median_of, p99_ratio, remove_figures, summarize, table
from expertmesh.bench.looping import Completion
from expertmesh.cli.main import main
from expertmesh.models.tiny import make_tiny_checkpoint

CONTEXT = 64


def _record(**changes) -> dict:
    record = {
        "name": "g2",
        "phase": "serving",
        "address": "127.0.0.1:1",
        "pid": 42,
        "experts": 8,
        "reason": "",
        "requested_at": 100.0,
        "registered_at": 102.0,
        "first_listed_at": 103.5,
        "finished_at": 106.0,
        "moves_planned": 8,
        "moves_done": 8,
        "bytes_moved": 3 << 20,
        "exit_code": None,
    }
    return {**record, **changes}


WINDOWS = [
    Window("baseline", 2, 0.0, 10.0),
    Window("add g2", 2, 10.0, 20.0, "baseline", change=True),
    Window("step up", 4, 20.0, 30.0, "baseline"),
    Window("remove g0", 4, 30.0, 40.0, "step up", change=True),
]
# ITL gaps (arrival, seconds): baseline 10 and 20 ms; add 30 ms; step up 20 ms; none during the remove
GAPS = [(1.0, 0.010), (2.0, 0.020), (15.0, 0.030), (25.0, 0.020), (45.0, 0.5)]
COMPLETED = [
    Completion(0, 0.5, 3.0, False),
    Completion(1, 9.0, 11.0, True),  # ended in the add: counted there, and as differing
    Completion(0, 21.0, 22.0, False),
]
FAILED = [(35.0, 1, "UNAVAILABLE: gone")]


def test_summarize_cuts_the_records_into_phases_by_time():
    phases = {p["phase"]: p for p in summarize(WINDOWS, GAPS, COMPLETED, FAILED)}
    assert list(phases) == ["baseline", "add g2", "step up", "remove g0"]
    base, add, step, remove = phases.values()
    assert base["tokens"] == 2 and base["itl_p50_ms"] == pytest.approx(15.0)
    assert base["itl_p99_ms"] == pytest.approx(19.9)
    assert base["requests"] == 1 and base["failed"] == 0 and base["differing"] == 0
    assert base["before"] is None and base["p99_over_before"] is None and not base["change"]
    assert add["requests"] == 1 and add["differing"] == 1 and add["change"] and add["seconds"] == 10.0
    assert add["p99_over_before"] == pytest.approx(30.0 / 19.9)
    assert step["clients"] == 4 and step["p99_over_before"] == pytest.approx(20.0 / 19.9)
    # no token arrived during the remove: no ITL and no ratio, but its failure is counted there
    assert remove["tokens"] == 0 and remove["itl_p99_ms"] is None and remove["p99_over_before"] is None
    assert remove["failed"] == 1


def test_p99_ratio():
    assert p99_ratio({"tokens": 3, "itl_p99_ms": 12.0}, {"tokens": 5, "itl_p99_ms": 10.0}) == pytest.approx(1.2)
    assert p99_ratio({"tokens": 3, "itl_p99_ms": 12.0}, None) is None
    assert p99_ratio({"tokens": 0, "itl_p99_ms": None}, {"tokens": 5, "itl_p99_ms": 10.0}) is None
    assert p99_ratio({"tokens": 3, "itl_p99_ms": 12.0}, {"tokens": 0, "itl_p99_ms": None}) is None
    assert p99_ratio({"tokens": 3, "itl_p99_ms": 12.0}, {"tokens": 1, "itl_p99_ms": 0.0}) is None


def test_group_figures_come_from_the_records():
    add = add_figures(_record(), first_token_s=4.2, held=8)
    assert add["to_first_token_s"] == 4.2 and add["to_listed_s"] == 3.5 and add["to_serving_s"] == 6.0
    assert (add["moves"], add["moves_planned"], add["bytes_moved"], add["experts_held"]) == (8, 8, 3 << 20, 8)
    unfinished = add_figures(_record(first_listed_at=0.0, finished_at=0.0), None, None)
    assert unfinished["to_listed_s"] is None and unfinished["to_serving_s"] is None
    removed = remove_figures(_record(name="g0", phase="stopped", experts=0, exit_code=0), group_ended=True)
    # a removal's registered_at is when its last expert left it
    assert removed["to_drained_s"] == 2.0 and removed["to_stopped_s"] == 6.0 and removed["stop_after_drain_s"] == 4.0
    assert removed["exit_code"] == 0 and removed["group_ended"]


def _result(cycles: list[dict]) -> dict:
    ratios = {
        kind: [next(p["p99_over_before"] for p in c["phases"] if p["phase"].startswith(kind + " ")) for c in cycles]
        for kind in ("add", "remove")
    }
    return {
        "model": {"model_type": "mixtral", "path": "/m/tiny", "moe_layers": 2, "num_experts": 8},
        "setup": {
            "groups": 2,
            "clients": 2,
            "step_clients": 2,
            "prompt_tokens": 8,
            "max_new_tokens": 16,
            "machine": {"cpus": 2},
            "load_average": {"start": 3.94, "end": 4.1},
        },
        "cycles": cycles,
        "p99_during_change_over_before": ratios,
        "p99_median": {kind: median_of(values) for kind, values in ratios.items()},
        "requests": {"completed": 3, "failed": 1, "differing_from_stock": 1},
    }


def _one_cycle(windows=WINDOWS, gaps=GAPS) -> dict:
    return {
        "phases": summarize(windows, gaps, COMPLETED, FAILED),
        "add": add_figures(_record(), 4.2, 8),
        "remove": remove_figures(_record(name="g0", phase="stopped", experts=0, exit_code=0), True),
    }


def test_table():
    cycle = _one_cycle()
    lines = table(_result([cycle])).splitlines()
    assert "2 CPUs, load average 3.9 at the start, 4.1 at the end" in lines[0]
    assert lines[1].split() == [
        "phase", "clients", "s", "requests", "failed", "changed", "ITL", "p50", "ms", "ITL", "p99", "ms", "p99", "vs",
        "ratio",
    ]  # fmt: skip
    assert lines[3].split() == ["baseline", "2", "10.0", "1", "0", "0", "15.0", "19.9", "-", "-"]
    assert lines[4].split() == ["add", "g2", "2", "10.0", "1", "0", "1", "30.0", "30.0", "baseline", "1.51x"]
    assert lines[6].split() == ["remove", "g0", "4", "10.0", "0", "1", "0", "-", "-", "step", "up", "-"]
    text = "\n".join(lines)
    assert "add g2: first token through it 4.2 s after the add (target <= 30 s), listed 3.5 s, serving 6.0 s" in text
    assert "8/8 moves, 3.0 MiB copied" in text
    assert "remove g0: drained 2.0 s after the request, stopped 4.0 s after its drain (target <= 10 s)" in text
    assert "ITL p99 during a change over before it: add 1.51x; remove - (target <= 1.2x)" in text
    assert text.endswith("3 completed, 1 failed, 1 with tokens different from stock transformers (targets: 0, 0)")
    assert not any(math.isnan(p["seconds"]) for p in cycle["phases"])


def test_cycles_each_get_their_table_and_the_target_is_read_on_the_median():
    # the second cycle's add: 60 ms against a 20 ms baseline (3.00x); the third's 20 against 20 (1.00x)
    second = _one_cycle(gaps=[(1.0, 0.020), (15.0, 0.060)])
    third = _one_cycle(gaps=[(1.0, 0.020), (15.0, 0.020)])
    result = _result([_one_cycle(), second, third])
    assert result["p99_during_change_over_before"]["add"] == pytest.approx([1.5075, 3.0, 1.0], abs=1e-3)
    assert result["p99_median"] == {"add": pytest.approx(1.5075, abs=1e-3), "remove": None}
    text = table(result)
    assert [line for line in text.splitlines() if line.startswith("cycle ")] == [
        "cycle 1 of 3",
        "cycle 2 of 3",
        "cycle 3 of 3",
    ]
    assert "add 1.51x, 3.00x, 1.00x (median 1.51x); remove -, -, - (median -) (target <= 1.2x, on the median)" in text


def test_median_of():
    assert median_of([1.0, None, 3.0, 2.0]) == 2.0
    assert median_of([4.0, 1.0]) == 2.5
    assert median_of([None]) is None and median_of([]) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("ckpt"), max_position_embeddings=CONTEXT)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--clients", "0"], "--clients must be at least 1, got 0"),
        (["--step-clients", "-1"], "--step-clients must be 0 or more, got -1"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--groups", "0"], "--groups must be at least 1, got 0"),
        (["--groups", "9"], "--groups must be at most the model's 4 experts, got 9"),
        (["--phase-seconds", "0"], "--phase-seconds must be a number of seconds > 0, got 0.0"),
        (["--heartbeat", "nan"], "--heartbeat must be a number of seconds > 0, got nan"),
        (["--timeout", "-1"], "--timeout must be > 0, got -1.0"),
        (["--cycles", "0"], "--cycles must be 1 to 20, got 0"),
        (["--prompt-tokens", "40", "--max-new-tokens", "40"], f"at most the model's context of {CONTEXT} tokens"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, checkpoint, tmp_path, argv, message):
    capsys.readouterr()
    code = main(["bench", "elastic", *argv, "--model", str(checkpoint), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "x.json").exists()
