"""The model-server protocol's gauges: what an inference gateway's endpoint picker (EPP) scrapes to choose a router.

The Gateway API Inference Extension's model-server protocol (``003-model-server-protocol``) asks a model server
for the requests queued, the requests running and the KV-cache utilisation, and optionally the block size and
the block count. Read when an exporter collects (``Engine.load``, ``Engine.kv_usage``), nothing computed on the
data path. Every series carries ``model_name``, the served model's name (vLLM's label; at most
``MAX_MODEL_LABEL`` characters). In Prometheus the dots are underscores; the protocol's names in brackets:

- ``expertmesh.requests.waiting``: requests in the engine's waiting queue, not running yet, preempted ones
  included (TotalQueuedRequests, ``vllm:num_requests_waiting``)
- ``expertmesh.requests.running``: requests the engine steps (TotalRunningRequests, ``vllm:num_requests_running``)
- ``expertmesh.kv.usage``: KV blocks used / total, 0..1 (KVCacheUtilization, ``vllm:kv_cache_usage_perc``;
  registered by ``kv_metrics``, with the same label)
- ``expertmesh.kv.cache_config_info``: 1, labelled ``block_size`` and ``num_gpu_blocks`` (BlockSize and
  NumGPUBlocks, ``vllm:cache_config_info``); absent under the per-sequence fallback, which has no pool

Our names, not vLLM's: OpenTelemetry instrument names cannot hold the ``:`` of ``vllm:…``, and a dashboard that
reads ``vllm:*`` would take this server for a vLLM. The EPP is told the names with its metric flags
(``EPP_METRIC_FLAGS``; the Helm chart passes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.infra.telemetry.setup import meter

if TYPE_CHECKING:  # telemetry sits below serving: only the type
    from expertmesh.serving.kv_cache_manager import KVUsage

__all__ = ["EPP_METRIC_FLAGS", "MAX_MODEL_LABEL", "model_label", "register_protocol_metrics"]

#: characters of a model name kept in the ``model_name`` label
MAX_MODEL_LABEL = 128

#: the EPP's flag -> the Prometheus name it should read (the chart's endpoint picker gets exactly these)
EPP_METRIC_FLAGS: dict[str, str] = {
    "total-queued-requests-metric": "expertmesh_requests_waiting",
    "total-running-requests-metric": "expertmesh_requests_running",
    "kv-cache-usage-percentage-metric": "expertmesh_kv_usage",
    "cache-info-metric": "expertmesh_kv_cache_config_info",
    "lora-info-metric": "",  # no LoRA adapters here: "" tells the EPP not to look for them
}


def model_label(name: str) -> str:
    """``name`` as a label value: at most ``MAX_MODEL_LABEL`` characters, never empty.

    Example: ``model_label("")`` -> ``"unnamed"``."""
    return name[:MAX_MODEL_LABEL] or "unnamed"


def register_protocol_metrics(
    load: Callable[[], tuple[int, int]],
    usage: Callable[[], "KVUsage | None"],
    model_name: str,
) -> None:
    """Report ``load()`` (an engine's ``load``: (running, waiting)) and the pool's shape from ``usage()`` (its
    ``kv_usage``) at each collection, labelled with ``model_name``."""
    labels = {"model_name": model_label(model_name)}
    m = meter()

    def waiting(_options: CallbackOptions):
        return [Observation(load()[1], labels)]

    def running(_options: CallbackOptions):
        return [Observation(load()[0], labels)]

    def cache_config(_options: CallbackOptions):
        current = usage()
        if current is None:
            return []
        shape = {"block_size": str(current.block_size), "num_gpu_blocks": str(current.blocks_total)}
        return [Observation(1, {**labels, **shape})]

    m.create_observable_gauge(
        "expertmesh.requests.waiting",
        [waiting],
        unit="{request}",
        description="requests in the engine's waiting queue, not running yet (preempted ones included)",
    )
    m.create_observable_gauge(
        "expertmesh.requests.running", [running], unit="{request}", description="requests the engine steps"
    )
    m.create_observable_gauge(
        "expertmesh.kv.cache_config_info",
        [cache_config],
        description="1, labelled with the KV pool's block_size (tokens) and num_gpu_blocks (blocks in the pool)",
    )
