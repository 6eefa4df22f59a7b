"""The serving engine's KV-cache metrics, read when an exporter collects (``Engine.kv_usage``), labelled
``model_name`` (``protocol_metrics.model_label``) when given one.

Observable instruments, nothing computed on the data path (vLLM's nearest name in brackets, for
porting dashboards; in Prometheus the dots are underscores and counters end in ``_total``):

- ``expertmesh.kv.blocks.capacity``: blocks in the pool (``vllm:num_gpu_blocks`` of ``cache_config_info``)
- ``expertmesh.kv.blocks.used``: blocks held by sequences
- ``expertmesh.kv.usage``: used / total, 0..1 (``vllm:kv_cache_usage_perc``)
- ``expertmesh.kv.fragmentation``: allocated slots no token fills yet / allocated slots, 0..1
- ``expertmesh.kv.preemptions``: sequences preempted for lack of blocks (counter; ``vllm:num_preemptions``)
- ``expertmesh.kv.prefix_cache.queries`` / ``.hits``: prompt tokens looked up in the prefix cache, and
  found (counters, tokens; ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.infra.telemetry.setup import meter
from expertmesh.serving.protocol_metrics import model_label

if TYPE_CHECKING:  # telemetry sits below serving: only the type
    from expertmesh.serving.kv_cache_manager import KVUsage

__all__ = ["register_kv_metrics"]

#: name -> (what it reads of KVUsage, counter?, unit, description)
_INSTRUMENTS: dict[str, tuple[Callable[["KVUsage"], float], bool, str, str]] = {
    "expertmesh.kv.blocks.capacity": (lambda u: u.blocks_total, False, "{block}", "KV-cache blocks in the pool"),
    "expertmesh.kv.blocks.used": (lambda u: u.blocks_used, False, "{block}", "KV-cache blocks held by sequences"),
    "expertmesh.kv.usage": (lambda u: u.usage, False, "1", "KV-cache blocks used / total"),
    "expertmesh.kv.fragmentation": (
        lambda u: u.fragmentation,
        False,
        "1",
        "allocated KV slots no token fills yet / allocated KV slots",
    ),
    "expertmesh.kv.preemptions": (lambda u: u.preemptions, True, "{sequence}", "sequences preempted for KV blocks"),
    "expertmesh.kv.prefix_cache.queries": (
        lambda u: u.prefix_queries,
        True,
        "{token}",
        "prompt tokens looked up in the prefix cache",
    ),
    "expertmesh.kv.prefix_cache.hits": (
        lambda u: u.prefix_hits,
        True,
        "{token}",
        "prompt tokens found in the prefix cache",
    ),
}


def register_kv_metrics(usage: Callable[[], "KVUsage | None"], model_name: str | None = None) -> None:
    """Report ``usage()`` (an engine's ``kv_usage``; None: no pool, nothing reported) at each collection."""
    m = meter()
    labels = None if model_name is None else {"model_name": model_label(model_name)}
    for name, (read, counter, unit, description) in _INSTRUMENTS.items():

        def observe(options: CallbackOptions, read=read):
            current = usage()
            return [] if current is None else [Observation(float(read(current)), labels)]

        create = m.create_observable_counter if counter else m.create_observable_gauge
        create(name, [observe], unit=unit, description=description)
