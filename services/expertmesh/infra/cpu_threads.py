"""How many torch intra-op threads a process computing beside expert groups on the same host should use.

Each expert group computes with ``max(1, int(num_cpus))`` threads of its own. The router computes with every
core of the host: it and its local groups take turns each MoE layer (the router waits while the groups compute,
the groups wait while it computes), and its idle OpenMP threads sleep rather than spin (``OMP_WAIT_POLICY``
PASSIVE, set by the CLI; with the groups in its own process they spin a short while first: ``infra.openmp_wait``),
so its threads do not take cores from them. Measured (2 cores, 2 local groups, the
214 M Mixtral, 2026-12-05, clients in their own process, each setting twice, interleaved): 2 router threads
against 1 gave 71.8 / 78.9 against 69.4 / 72.0 tok/s at 8 clients of 480-token prompts and 96-token answers,
134.3 / 140.0 against 125.2 / 130.2 at 32, 104.5 against 101.6 at 8 clients of 64 / 256 (decode-heavy), and
24.4 / 25.1 against 25.5 / 27.0 at one client (a one-token step gains nothing from a second thread). Before
the OpenMP threads slept and the row sums stopped waking them (``infra.row_sums``), 1 thread was faster (one
client: 51 against 67 ms a token).
"""

from __future__ import annotations


def group_threads(num_cpus: float) -> int:
    """The intra-op threads an expert group reserving ``num_cpus`` CPUs computes with (``expert_group.runtime``)."""
    return max(1, int(num_cpus))


def router_threads(setting: int, cpus: int) -> int:
    """``setting`` if set (> 0); else (auto) all the host's ``cpus``, whether or not expert groups run beside it."""
    if setting > 0:
        return setting
    return max(1, cpus)
