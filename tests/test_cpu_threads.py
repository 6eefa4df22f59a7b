"""The router's intra-op threads beside expert groups on the same host (``infra.cpu_threads``): pure functions, and
the narrowing of a small step (real torch thread settings, restored after)."""

import pytest
import torch

from expertmesh.infra.cpu_threads import WIDE_WORK, all_threads_for, group_threads, one_thread_while, router_threads


@pytest.mark.parametrize("num_cpus, threads", [(0.25, 1), (1, 1), (1.5, 1), (2, 2), (8.0, 8)])
def test_a_group_computes_with_its_whole_cpus_and_at_least_one_thread(num_cpus, threads):
    assert group_threads(num_cpus) == threads


@pytest.mark.parametrize(
    "setting, cpus, threads",
    [
        (0, 2, 2),  # the embedded default on 2 cores: both (its local groups compute while it waits)
        (0, 16, 16),  # a big host: all of them
        (0, 0, 1),  # no CPU reported: still 1
        (3, 2, 3),  # set: as set, even oversubscribed
    ],
)
def test_the_router_computes_on_every_core_unless_set(setting, cpus, threads):
    assert router_threads(setting, cpus) == threads


@pytest.mark.parametrize("serial, inside", [(True, 1), (False, 2)])
def test_one_thread_while_narrows_only_when_asked_and_restores(serial, inside):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread_while(serial):
            assert torch.get_num_threads() == inside
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_thread_while(serial):
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == 2, "restored after an error too"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "work, threads, inside",
    [
        (WIDE_WORK, 2, 2),  # a large product in a narrowed step: the router's threads back
        (WIDE_WORK - 1, 2, 1),  # a small one stays on one
        (WIDE_WORK, 0, 1),  # no router threads given: as it is
        (WIDE_WORK, 1, 1),
    ],
)
def test_a_large_product_takes_the_routers_threads_back_in_a_narrowed_step(work, threads, inside):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread_while(True):
            with all_threads_for(work, threads):
                assert torch.get_num_threads() == inside
            assert torch.get_num_threads() == 1, "narrowed again after the product"
            with pytest.raises(RuntimeError), all_threads_for(work, threads):
                raise RuntimeError("a failed product")
            assert torch.get_num_threads() == 1, "restored after an error too"
        with all_threads_for(WIDE_WORK, 2):  # a step that was not narrowed: left as it is
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
