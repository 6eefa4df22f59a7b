"""Rolling 3-sigma baselines (router/reporting/anomaly.py) on constructed series: quiet in band, a breach on a jump,
nothing during warm-up, an anomaly only after ``persistence`` breaches in a row, the anomaly ends after
``recovery`` normal observations, breaches kept out of the baseline."""

import math

import pytest

from expertmesh.router.reporting.anomaly import AnomalyDetector, Baseline, BaselineConfig


def _feed(baseline: Baseline, values):
    return [baseline.observe(v) for v in values]


def test_the_module_example():
    b = Baseline(BaselineConfig(window=4, warm_up=4, persistence=1, recovery=2))
    _feed(b, [0.5, 0.6, 0.5, 0.6])
    assert b.mean_std() == pytest.approx((0.55, 0.05))
    jump = b.observe(0.1)
    assert jump.breach and jump.started and jump.active
    assert jump.mean == pytest.approx(0.55) and jump.std == pytest.approx(0.05)
    first, second = _feed(b, [0.5, 0.6])
    assert first.active and not first.ended
    assert second.ended and not second.active


def test_a_wobbling_series_inside_its_band_never_breaches():
    b = Baseline(BaselineConfig(window=64, warm_up=16))
    verdicts = _feed(b, [0.6 + 0.02 * math.sin(i) for i in range(500)])
    assert not any(v.breach or v.active for v in verdicts)


def test_a_jump_breaches_both_ways_and_a_step_within_the_band_does_not():
    for jump, breaches in ((0.3, True), (0.9, True), (0.62, False)):
        b = Baseline(BaselineConfig(window=32, warm_up=8))
        _feed(b, [0.6 + (0.01 if i % 2 else -0.01) for i in range(32)])  # mean 0.6, std 0.01: band 0.57..0.63
        assert b.observe(jump).breach is breaches


def test_warm_up_suppresses_a_breach():
    b = Baseline(BaselineConfig(window=32, warm_up=10))
    verdicts = _feed(b, [0.5] * 5 + [0.99] + [0.5] * 4)  # the wild value is the 6th of 10
    assert not any(v.breach for v in verdicts) and all(math.isnan(v.mean) for v in verdicts)
    assert b.warm
    assert b.observe(0.99).breach  # now judged, against a baseline that includes the early one


def test_the_anomaly_lasts_until_recovery_normal_observations_in_a_row():
    b = Baseline(BaselineConfig(window=16, warm_up=8, persistence=1, recovery=3))
    _feed(b, [0.5, 0.52] * 8)
    verdicts = _feed(b, [0.1, 0.51, 0.51, 0.1, 0.51, 0.51, 0.51, 0.51])
    assert [v.breach for v in verdicts] == [True, False, False, True, False, False, False, False]
    assert [v.active for v in verdicts] == [True, True, True, True, True, True, False, False]
    assert [v.started for v in verdicts].count(True) == 1 and verdicts[0].started  # a second breach is the same one
    assert [v.ended for v in verdicts] == [False] * 6 + [True, False]


def test_breaches_stay_out_of_the_baseline_so_a_shifted_level_stays_anomalous():
    b = Baseline(BaselineConfig(window=16, warm_up=8, persistence=1, recovery=2))
    _feed(b, [0.5, 0.52] * 8)
    before = b.mean_std()
    verdicts = _feed(b, [0.1] * 100)
    assert all(v.breach and v.active for v in verdicts)
    assert b.mean_std() == before


def test_an_anomaly_starts_after_persistence_breaches_in_a_row():
    b = Baseline(BaselineConfig(window=16, warm_up=8, persistence=3, recovery=1))
    _feed(b, [0.5, 0.52] * 8)
    verdicts = _feed(b, [0.1, 0.1, 0.51, 0.1, 0.1, 0.1, 0.1])  # a run of two, broken; then a run of four
    assert [v.breach for v in verdicts] == [True, True, False, True, True, True, True]
    assert [v.active for v in verdicts] == [False, False, False, False, False, True, True]
    assert [v.started for v in verdicts] == [False] * 5 + [True, False]


def test_a_constant_series_needs_more_than_a_rounding_step_to_breach():
    b = Baseline(BaselineConfig(window=8, warm_up=8, min_std=1e-3))
    _feed(b, [0.25] * 8)
    assert not b.observe(0.25 + 1e-7).breach
    assert b.observe(0.25 + 0.01).breach


def test_the_window_forgets_old_observations():
    b = Baseline(BaselineConfig(window=4, warm_up=4))
    _feed(b, [0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # the two early zeros left the window
    assert b.mean_std() == pytest.approx((1.0, 0.0))


def test_a_missing_observation_is_not_judged():
    b = Baseline(BaselineConfig(window=4, warm_up=4))
    _feed(b, [0.5] * 4)
    v = b.observe(float("nan"))
    assert not v.breach and len(b._values) == 4


def test_the_detector_keeps_one_baseline_per_signal():
    d = AnomalyDetector(BaselineConfig(window=8, warm_up=4, persistence=1, recovery=1))
    for _ in range(8):
        d.observe({"a": 0.5, "b": 0.2})
    verdicts = d.observe({"a": 0.5, "b": 0.9})
    assert [(v.signal, v.breach) for v in verdicts] == [("a", False), ("b", True)]
    assert d.active() == ["b"] and d.active(["a"]) == [] and d.active(["b", "c"]) == ["b"]
    d.observe({"b": 0.2})
    assert d.active() == []


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 1}, {"warm_up": 1}, {"window": 4, "warm_up": 5}, {"sigma": 0}, {"persistence": 0}, {"recovery": 0}],
)
def test_a_config_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError):
        BaselineConfig(**kwargs)


# -- VectorBaseline: Baseline's rules element by element ---------------------------------------------------------


def test_the_vector_baseline_judges_each_element_as_a_scalar_baseline_would():
    """Random series with jumps (some lasting, some one step), gaps (nan) and levels that move for good: every
    verdict of every element equals what its own ``Baseline`` says."""
    import numpy as np

    from expertmesh.router.reporting.anomaly import VectorBaseline

    config = BaselineConfig(window=16, warm_up=6, sigma=3.0, persistence=2, recovery=3)
    rng = np.random.default_rng(7)
    n, steps = 12, 400
    series = 0.25 + 0.01 * rng.standard_normal((steps, n))
    for i in range(n):  # a jump of a few steps, somewhere, per element; a lasting one for two of them
        start = int(rng.integers(20, steps - 40))
        series[start : start + int(rng.integers(1, 12)), i] += 0.2
    series[300:, 3] += 0.3
    series[rng.random((steps, n)) < 0.05] = np.nan
    vector = VectorBaseline(n, config)
    scalars = [Baseline(config, str(i)) for i in range(n)]
    started = 0
    for row in series:
        v = vector.observe(row)
        for i, baseline in enumerate(scalars):
            s = baseline.observe(row[i])
            assert (v.breach[i], v.active[i], v.started[i], v.ended[i]) == (s.breach, s.active, s.started, s.ended)
            if math.isfinite(row[i]) and not math.isnan(s.mean):  # (a gap reports the baseline so far)
                assert v.mean[i] == pytest.approx(s.mean) and v.std[i] == pytest.approx(s.std, abs=1e-9)
            started += s.started
    assert started >= n, "the series did start anomalies"
    assert vector.active[3], "a level moved for good stays anomalous"


def test_the_vector_baseline_example_and_its_shape_check():
    import numpy as np

    from expertmesh.router.reporting.anomaly import VectorBaseline

    b = VectorBaseline(2, BaselineConfig(window=4, warm_up=4, persistence=1, recovery=2))
    for value in (0.5, 0.6, 0.5, 0.6):
        b.observe(np.array([value, value]))
    jump = b.observe(np.array([0.1, 0.55]))
    assert jump.breach.tolist() == [True, False] and jump.started.tolist() == [True, False]
    assert jump.mean == pytest.approx([0.55, 0.55]) and jump.std == pytest.approx([0.05, 0.05])
    with pytest.raises(ValueError):
        b.observe(np.zeros(3))
