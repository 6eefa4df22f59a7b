"""The router's intra-op threads beside expert groups on the same host (``infra.cpu_threads``): pure functions."""

import pytest

from expertmesh.infra.cpu_threads import group_threads, router_threads


@pytest.mark.parametrize("num_cpus, threads", [(0.25, 1), (1, 1), (1.5, 1), (2, 2), (8.0, 8)])
def test_a_group_computes_with_its_whole_cpus_and_at_least_one_thread(num_cpus, threads):
    assert group_threads(num_cpus) == threads


@pytest.mark.parametrize(
    "setting, cpus, local, threads",
    [
        (0, 2, 2, 1),  # the embedded default on 2 cores: 2 groups of 1 thread leave none: at least 1
        (0, 2, 4, 1),  # more group threads than cores: still 1
        (0, 16, 2, 14),  # a big host: what the groups leave
        (0, 16, 0, 16),  # --router-only / --ray-address: the groups run elsewhere
        (3, 2, 2, 3),  # set: as set, even oversubscribed
    ],
)
def test_the_router_takes_what_its_local_groups_leave_unless_set(setting, cpus, local, threads):
    assert router_threads(setting, cpus, local) == threads
