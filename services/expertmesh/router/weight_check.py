"""The router's own weights (embeddings, attention, norms, gates, shared experts, LM head: everything its model
holds) checked against their fingerprints at load, as expert groups check their experts (``models.fingerprint``).

``tensor_fingerprints`` takes one fingerprint per tensor (so a difference names the tensor) and ``changed_tensors``
compares two such maps: plain data in, plain data out. ``WeightWatch`` is the I/O around them: it fingerprints the
model when it is built, checks again every ``interval_s`` in a thread of its own and on demand (``check``), and
keeps the latest result (``last``), which ``/health`` reads (a router whose weights changed is not ready, naming the
tensors) and the gauge ``expertmesh_router_weights_changed`` reports; a change is logged as an error naming them.
The check only reads the weights: it takes no lock a request's step takes, and a step never waits for it.

Glossary
- *tensor*: a parameter or persistent buffer of the router's model, by its ``state_dict`` name; a tensor tied to
  another (an LM head sharing the embeddings) is checked once, under its first name.
- *changed*: its fingerprint now differs from the one taken at load (a stray write, a bit flip, a hot update that
  overwrote a LayerNorm), or the packed copy its products read (``linear_kernels``) no longer equals it
  (``copies_apart``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from opentelemetry.metrics import CallbackOptions, Observation
from torch import nn

from expertmesh.infra.telemetry.setup import meter
from expertmesh.models.fingerprint import fingerprint
from expertmesh.models.linear_kernels import PackedLinear

__all__ = ["WeightCheck", "WeightWatch", "changed_tensors", "copies_apart", "tensor_fingerprints"]

log = logging.getLogger(__name__)

#: an on-demand check within this many seconds of the last one answers with that one: a burst of asks (the HTTP
#: API's POST /health/weights takes no credentials) is one check, not a core kept busy
MIN_GAP_S = 5.0


def router_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of everything ``model`` holds (its ``state_dict``), each storage once (tied weights)."""
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def tensor_fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> the fingerprint of that tensor alone (``models.fingerprint``), where it lives."""
    return {name: fingerprint({name: t}) for name, t in tensors.items()}


def copies_apart(model: nn.Module) -> list[str]:
    """The weights whose packed copy (``linear_kernels.PackedLinear``: what the products read) no longer equals the
    parameter, named ``<module>.weight (packed copy)``: a fault in the copy the fingerprints of the state dict do not
    read, or a write torch did not see in the parameter."""
    return sorted(
        f"{name}.weight (packed copy)"
        for name, module in model.named_modules()
        if isinstance(module, PackedLinear)
        and (computed := module.computed_weight()) is not None
        and not torch.equal(computed, module.weight.detach())
    )


def changed_tensors(at_load: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The tensors whose fingerprint ``now`` differs from ``at_load`` (or that one of them lacks), sorted.

    Example: ({"a": "1", "b": "2"}, {"a": "1", "b": "3"}) -> ["b"]."""
    return sorted(name for name in at_load.keys() | now.keys() if at_load.get(name) != now.get(name))


@dataclass(frozen=True)
class WeightCheck:
    """One check of the router's weights: the tensors changed since load (empty: none), how many were checked, when
    it finished (``time.time()``) and how long it took."""

    changed: tuple[str, ...]
    tensors: int
    at: float
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.changed


class WeightWatch:
    def __init__(self, model: nn.Module, interval_s: float = 300.0):
        """Fingerprints ``model``'s tensors now (at load); ``interval_s``: seconds between the thread's checks once
        started (0: on demand only)."""
        self._model = model
        started = time.perf_counter()
        self._at_load = tensor_fingerprints(router_tensors(model))
        log.info(
            "router weights: %d tensors fingerprinted at load in %.3fs",
            len(self._at_load),
            time.perf_counter() - started,
        )
        self.interval_s = interval_s
        #: the latest check (None: none yet since load); replaced whole, read without a lock
        self.last: WeightCheck | None = None
        self._checking = threading.Lock()  # one check at a time; only checks take it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: called with each check whose changed tensors differ from the last one's (the gRPC health's hook)
        self.on_change: list[Callable[[WeightCheck], None]] = []
        meter().create_observable_gauge(
            "expertmesh.router.weights_changed",
            callbacks=[self._gauge],
            description="tensors of the router's own weights whose fingerprint differs from the one taken at load "
            "(its /health names them); 0: unchanged",
        )

    @property
    def tensors(self) -> int:
        return len(self._at_load)

    def check(self, min_gap_s: float = 0.0) -> WeightCheck:
        """Fingerprint every tensor again and compare; a check finishing within ``min_gap_s`` of now (or running
        now) answers instead. Logs an error naming the changed tensors when they differ from the last check's."""
        with self._checking:
            last = self.last
            if last is not None and min_gap_s > 0 and time.time() - last.at < min_gap_s:
                return last
            started = time.perf_counter()
            # the model's tensors as they are now: one replaced whole (``param.data = ...``) is read, not the old one
            changed = tuple(
                changed_tensors(self._at_load, tensor_fingerprints(router_tensors(self._model)))
                + copies_apart(self._model)
            )
            check = WeightCheck(changed, len(self._at_load), time.time(), time.perf_counter() - started)
            if changed and (last is None or last.changed != changed):
                log.error(
                    "the router's weights changed since load: %s%s; it reports not ready until restarted",
                    ", ".join(changed[:10]),
                    f" and {len(changed) - 10} more" if len(changed) > 10 else "",
                )
            elif not changed and last is not None and last.changed:
                log.warning("the router's weights match their fingerprints at load again")
            self.last = check
            if last is None or last.changed != check.changed:  # in the lock: the hooks hear the checks in order
                for call in self.on_change:
                    call(check)
            return check

    def start(self) -> "WeightWatch":
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="expertmesh-weight-check", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a failed check must not end the checks
                log.exception("checking the router's weights failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _gauge(self, _options: CallbackOptions) -> list[Observation]:
        last = self.last
        return [Observation(len(last.changed) if last is not None else 0)]
