"""Serving: the public ``expertmesh.v1.Inference`` gRPC API over the router, and its OpenAI-compatible HTTP twin.

- ``sampling``: per-request token choice (greedy, temperature, top-k, top-p, seed).
- ``text_stream``: incremental detokenisation with stop sequences.
- ``engine``: continuous batching — one forward per step for every active
  sequence, so each MoE layer's dispatch carries all their tokens.
- ``schedule``: how many tokens each sequence feeds a step (chunked prefill).
- ``forward``: the packed forward of a step (and the per-sequence fallback).
- ``kv_cache``: the per-sequence KV cache the packed forward writes to.
- ``service``: the gRPC servicer (validation, flow control, deadlines, cancellation).
- ``http_api`` (over ``openai_schema``, ``openai_adapter``, ``openai_errors``, ``chat``,
  ``async_events``, ``readiness``) and ``http_server``: the OpenAI-compatible HTTP API,
  ``/health`` and ``/metrics`` beside the gRPC API, over the same engine.
- ``up``: ``expertmesh up``, the whole platform in one command.
"""
