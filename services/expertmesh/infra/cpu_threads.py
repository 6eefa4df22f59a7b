"""How many torch intra-op threads a process computing beside expert groups on the same host should use.

Each expert group computes with ``max(1, int(num_cpus))`` threads of its own. A router that also takes every
core oversubscribes the host: its OpenMP threads spin between parallel regions on the cores the groups
compute on. Measured on 2 cores with 2 local groups (the 214 M Mixtral, one client, 96 decode tokens): 51 ms
per token with 1 router thread, 67 ms with 2 (8 clients: 95 and 102 ms; 32: 184 and 192 ms); a 32-token
prefill 124 ms against 174 ms.
"""

from __future__ import annotations


def group_threads(num_cpus: float) -> int:
    """The intra-op threads an expert group reserving ``num_cpus`` CPUs computes with (``expert_group.runtime``)."""
    return max(1, int(num_cpus))


def router_threads(setting: int, cpus: int, local_group_threads: int) -> int:
    """``setting`` if set (> 0); else (auto) the host's ``cpus`` less the threads of the expert groups this
    process started on the host, at least 1."""
    if setting > 0:
        return setting
    return max(1, cpus - local_group_threads)
