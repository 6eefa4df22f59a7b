"""Serving: the public ``expertmesh.v1.Inference`` gRPC API over the router.

- ``sampling``: per-request token choice (greedy, temperature, top-k, top-p, seed).
- ``text_stream``: incremental detokenisation with stop sequences.
- ``engine``: continuous batching — every decode step runs all active
  sequences together, so each MoE layer's dispatch carries all their tokens.
- ``service``: the gRPC servicer (validation, flow control, deadlines, cancellation).
- ``up``: ``expertmesh up``, the whole platform in one command.
"""
