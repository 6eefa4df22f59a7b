"""Rolling 3-sigma baselines: per signal, is a new observation far off its recent ones? Pure: floats in, verdicts out.

Glossary
- *observation*: one number of a signal per engine step (a MoE layer's mean top-1 gate score over the step's
  tokens; the KV pool's fragmentation).
- *baseline*: mean and population standard deviation of the last ``window`` observations that were *in band*
  (a fixed window, not an EWMA: every figure is exactly the mean of named observations, so a test can state it,
  and there is no decay rate to tune beside the window). Observations that breach are kept out of it, so an
  anomaly cannot teach the baseline that it is normal.
- *warm-up*: until the baseline holds ``warm_up`` observations nothing breaches.
- *band*: ``mean ± sigma · max(std, min_std)``; ``min_std`` keeps a constant series from breaching on a rounding step.
- *breach*: an observation outside the band. ``persistence`` consecutive breaches start an *anomaly* (as
  ``for:`` in an alert rule: one odd step, a lone long prompt, is not one); it ends after ``recovery``
  consecutive in-band observations.

Example: ``Baseline(BaselineConfig(window=4, warm_up=4, persistence=1, recovery=2))`` fed 0.5, 0.6, 0.5, 0.6
(mean 0.55, std 0.05, band 0.40..0.70) then 0.1: a breach, the anomaly starts; then 0.5, 0.6: it ends on the
second.

A level that stays shifted (a workload that moved for good) keeps its anomaly on: it never enters the baseline.

``VectorBaseline`` is ``Baseline`` for many signals at once (every expert's load share, observed together): the
same rules element by element, kept in numpy arrays, so one observation of thousands of signals costs a few array
operations, not a Python loop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

__all__ = ["AnomalyDetector", "Baseline", "BaselineConfig", "VectorBaseline", "VectorVerdict", "Verdict"]


@dataclass(frozen=True)
class BaselineConfig:
    window: int = 256  # in-band observations the mean and std are taken over
    warm_up: int = 32  # observations the baseline needs before anything breaches (<= window)
    sigma: float = 3.0  # k of mean ± k·std
    persistence: int = 3  # consecutive breaches that start an anomaly
    recovery: int = 8  # consecutive in-band observations that end an anomaly
    min_std: float = 1e-3  # floor under std in the band (signals here lie in [0, 1])

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.warm_up <= self.window:
            raise ValueError(f"need 2 <= warm_up <= window, got warm_up {self.warm_up}, window {self.window}")
        if self.sigma <= 0 or self.persistence < 1 or self.recovery < 1 or self.min_std < 0:
            raise ValueError("need sigma > 0, persistence >= 1, recovery >= 1 and min_std >= 0")


@dataclass(frozen=True)
class Verdict:
    """What one observation of one signal did."""

    signal: str
    value: float
    mean: float  # the baseline it was judged against (before it joined); nan during warm-up
    std: float
    breach: bool
    active: bool  # an anomaly is on after this observation
    started: bool = False  # this observation started it
    ended: bool = False  # this observation ended it


class Baseline:
    """One signal's rolling baseline and anomaly state (see the module). Deterministic, no clock, no I/O."""

    def __init__(self, config: BaselineConfig = BaselineConfig(), signal: str = ""):
        self.config = config
        self.signal = signal
        self._values: deque[float] = deque()
        self._sum = self._squares = 0.0
        self.active = False
        self._normal_run = 0  # consecutive in-band observations while active
        self._breach_run = 0  # consecutive breaches

    @property
    def warm(self) -> bool:
        return len(self._values) >= self.config.warm_up

    def mean_std(self) -> tuple[float, float]:
        """The baseline's mean and population std (nan, nan while empty)."""
        n = len(self._values)
        if n == 0:
            return math.nan, math.nan
        mean = self._sum / n
        return mean, math.sqrt(max(0.0, self._squares / n - mean * mean))

    def observe(self, value: float) -> Verdict:
        value = float(value)
        c = self.config
        if not math.isfinite(value):  # nothing to judge (a step with no tokens at a layer)
            mean, std = self.mean_std()
            return Verdict(self.signal, value, mean, std, False, self.active)
        if not self.warm:
            self._add(value)
            return Verdict(self.signal, value, math.nan, math.nan, False, self.active)
        mean, std = self.mean_std()
        breach = abs(value - mean) > c.sigma * max(std, c.min_std)
        started = ended = False
        if breach:
            self._normal_run = 0
            self._breach_run += 1
            if not self.active and self._breach_run >= c.persistence:
                self.active = started = True
        else:
            self._breach_run = 0
            self._add(value)
            if self.active:
                self._normal_run += 1
                if self._normal_run >= c.recovery:
                    self.active, ended, self._normal_run = False, True, 0
        return Verdict(self.signal, value, mean, std, breach, self.active, started, ended)

    def _add(self, value: float) -> None:
        self._values.append(value)
        self._sum += value
        self._squares += value * value
        if len(self._values) > self.config.window:
            old = self._values.popleft()
            self._sum -= old
            self._squares -= old * old


class AnomalyDetector:
    """Named signals, each with its own ``Baseline`` of one config, made on a signal's first observation."""

    def __init__(self, config: BaselineConfig = BaselineConfig()):
        self.config = config
        self.baselines: dict[str, Baseline] = {}

    def observe(self, values: Mapping[str, float]) -> list[Verdict]:
        """One step's observations (signal -> value) -> their verdicts, in ``values``' order."""
        out = []
        for signal, value in values.items():
            baseline = self.baselines.get(signal)
            if baseline is None:
                baseline = self.baselines[signal] = Baseline(self.config, signal)
            out.append(baseline.observe(value))
        return out

    def active(self, signals: Iterable[str] | None = None) -> list[str]:
        """The signals (of ``signals``; None: all) with an anomaly on, sorted."""
        names = self.baselines if signals is None else [s for s in signals if s in self.baselines]
        return sorted(s for s in names if self.baselines[s].active)


@dataclass(frozen=True, eq=False)
class VectorVerdict:
    """What one observation of ``n`` signals did, element by element (as ``Verdict``). Shape: every field [n]."""

    value: np.ndarray  # float64
    mean: np.ndarray  # float64, nan while the element warms up
    std: np.ndarray  # float64
    breach: np.ndarray  # bool
    active: np.ndarray  # bool
    started: np.ndarray  # bool
    ended: np.ndarray  # bool


class VectorBaseline:
    """``Baseline`` over ``n`` signals at once: element ``i`` of every observation is judged, kept or left out
    exactly as one ``Baseline`` would judge signal ``i`` (each element has its own window, since breaches stay out
    of it). Deterministic, no clock, no I/O.

    Example: ``VectorBaseline(4, config).observe(np.array([0.25, 0.25, 0.3, 0.2]))`` -> a ``VectorVerdict`` of 4.

    Memory: a [window, n] float64 ring (DeepSeek-V3's 58 layers x 256 experts at window 256: 30 MiB).
    """

    def __init__(self, n: int, config: BaselineConfig = BaselineConfig()):
        self.config = config
        self.n = n
        self._values = np.zeros((config.window, n))  # ring buffer per element: [window, n]
        self._next = np.zeros(n, dtype=np.int64)  # each element's next slot
        self._count = np.zeros(n, dtype=np.int64)  # in-band observations held, <= window
        self._sum = np.zeros(n)
        self._squares = np.zeros(n)
        self.active = np.zeros(n, dtype=bool)
        self._normal_run = np.zeros(n, dtype=np.int64)
        self._breach_run = np.zeros(n, dtype=np.int64)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """[n] means and population stds of the elements' baselines (nan where empty)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(self._count > 0, self._sum / np.maximum(self._count, 1), np.nan)
            var = self._squares / np.maximum(self._count, 1) - mean * mean
        return mean, np.sqrt(np.maximum(var, 0.0))

    def observe(self, values: np.ndarray) -> VectorVerdict:
        """One observation [n] (nan: nothing to judge for that element, e.g. a layer that saw no token)."""
        c = self.config
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.n,):
            raise ValueError(f"expected {self.n} values, got shape {values.shape}")
        finite = np.isfinite(values)
        warm = self._count >= c.warm_up
        mean, std = self.mean_std()
        judged = finite & warm
        with np.errstate(invalid="ignore"):
            breach = judged & (np.abs(values - mean) > c.sigma * np.maximum(std, c.min_std))
        normal = judged & ~breach
        self._breach_run = np.where(breach, self._breach_run + 1, np.where(normal, 0, self._breach_run))
        started = breach & ~self.active & (self._breach_run >= c.persistence)
        self._normal_run = np.where(self.active & normal, self._normal_run + 1, np.where(breach, 0, self._normal_run))
        ended = self.active & normal & (self._normal_run >= c.recovery)
        self._normal_run[ended] = 0
        self.active = (self.active | started) & ~ended
        self._add(np.flatnonzero(finite & ~breach), values)
        reported_mean = np.where(warm, mean, np.nan)
        reported_std = np.where(warm, std, np.nan)
        return VectorVerdict(values, reported_mean, reported_std, breach, self.active.copy(), started, ended)

    def _add(self, idx: np.ndarray, values: np.ndarray) -> None:
        if idx.size == 0:
            return
        slot = self._next[idx]
        full = self._count[idx] >= self.config.window
        old = np.where(full, self._values[slot, idx], 0.0)
        new = values[idx]
        self._sum[idx] += new - old
        self._squares[idx] += new * new - old * old
        self._values[slot, idx] = new
        self._next[idx] = (slot + 1) % self.config.window
        self._count[idx] = np.minimum(self._count[idx] + 1, self.config.window)
