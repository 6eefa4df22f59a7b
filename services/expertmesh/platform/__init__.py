"""The composition roots: the data plane, the orchestrator process and expert groups as child processes,
brought up one way for ``up``, the benchmarks, chaos and the tests."""
