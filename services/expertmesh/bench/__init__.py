"""Data-plane benchmarks: ``expertmesh bench dispatch`` and ``expertmesh bench serve``.

Each runs the platform and its stock-transformers baseline in one run, on the
same checkpoint and machine, prints one table and writes JSON (``report``).
"""

from __future__ import annotations


def add_commands(bench_commands) -> None:
    """Register the benchmarks on the ``expertmesh bench`` subparsers."""
    from expertmesh.bench import dispatch, serve

    dispatch.add_command(bench_commands)
    serve.add_command(bench_commands)
